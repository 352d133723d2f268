"""Stop 46: the speculative loop with drafting turned off, to see what it costs by itself on BLIS.
ND=nopropose: never propose (``blis-np1``); ND=choose: propose, never verify (``blis-np2``).
Run in place of `warmspec`, with the BLAS set by hand (see trace.py)."""
import sys, os
from warmspec.core import gate as G
mode = os.environ.get("ND", "choose")
if mode == "choose":   # propose, never verify
    G.Gate.choose = lambda self, *a, **k: 0
    G.Gate.depth = lambda self, *a, **k: 0
elif mode == "nopropose":  # never propose
    G.Gate.should_propose = lambda self: False
from warmspec.cli import main
sys.exit(main(sys.argv[1:]))
