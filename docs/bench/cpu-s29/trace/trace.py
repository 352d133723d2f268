"""Record every scored proposal (verified: Gate.observe; unverified: Gate.settle) during a bench run.

    python docs/bench/cpu-s29/trace/trace.py OUT.json bench own12.jsonl --modes ngram --repeat 1 \
        --max-tokens-cap 128 --out DIR

It ran on the code before the two rates (78ec796), whose gate kept one per-token rate; ``est`` is
that rate at the time of the proposal. ``summary.py OUT.json`` prints the table in ../README.md.
"""
import sys, json, atexit
from pathlib import Path
root = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(root / "daemon"), str(root / "protocol")]
from warmspec import blas
blas.reexec_with_openblas([sys.argv[0], *sys.argv[1:]])
from warmspec.core import gate as g
log = []
orig_observe, orig_settle = g.Gate.observe, g.Gate.settle
state = {"shadow": False}
def observe(self, confidence, drafted, accepted, *, source=""):
    log.append(dict(kind="shadow" if state["shadow"] else "verify", conf=confidence, drafted=drafted,
                    accepted=accepted, source=source, est=self.acceptance(confidence, source)))
    return orig_observe(self, confidence, drafted, accepted, source=source)
def settle(self, emitted):
    state["shadow"] = True
    try:
        return orig_settle(self, emitted)
    finally:
        state["shadow"] = False
g.Gate.observe, g.Gate.settle = observe, settle
atexit.register(lambda: json.dump(log, open(sys.argv[1], "w")))
from warmspec import cli
sys.exit(cli.main(sys.argv[2:]))
