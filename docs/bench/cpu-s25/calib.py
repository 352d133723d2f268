"""Head calibration on the model's own prose: per verified one-token head draft, the head's
probability of it and whether the target agreed (gate off, n-gram off)."""
import sys
from warmspec import blas
blas.reexec_with_openblas(sys.argv)
import json  # noqa
from pathlib import Path  # noqa
import numpy as np  # noqa
from warmspec.bench import prepare, read_cases  # noqa
from warmspec.core import GenerationStats, SamplingParams  # noqa
from warmspec.core.engine import Engine, Run  # noqa
from warmspec.core import drafters  # noqa
from warmspec.core.drafters import MtpDrafter, Proposal  # noqa
from warmspec.heads import resolve_head  # noqa
from warmspec.model import load  # noqa
import mlx.core as mx  # noqa

lm = load(None)
head = resolve_head("shipped", lm)
log = []

def propose(self, k):
    if not self._tokens:
        return None
    hidden = mx.concatenate(self._hidden)[None]
    tokens = mx.array([self._tokens])
    self._hidden, self._tokens = [], []
    drafted, _, first = self.head.draft(hidden, tokens, self.cache, 1, self.params, self.rng)
    self.last = (drafted[0], first)
    return Proposal(tokens=drafted, confidence=first, source=self.source)

MtpDrafter.propose = propose
e = Engine(lm, speculate=True, mtp=head, drafting="mtp", gated=False)
orig = e.gate.observe
def observe(confidence, drafted, accepted, *, source=""):
    log.append((confidence, accepted))
    return orig(confidence, drafted, accepted, source=source)
e.gate.observe = observe
tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 128
for path in sys.argv[1].split(","):
    p = Path(path)
    for _, c in read_cases([p]):
        prompt = prepare(c, lm.tokenizer, p.parent).turns[0]
        run = Run(SamplingParams(), tokens, GenerationStats())
        for _ in e.generate_tokens(prompt, run):
            pass
        print(c.id, len(log), flush=True)
json.dump(log, open("/tmp/s25/calib.json", "w"))
a = np.array(log)
for lo, hi in [(0, .2), (.2, .3), (.3, .4), (.4, .5), (.5, .6), (.6, .7), (.7, .8), (.8, .9), (.9, 1.01)]:
    m = (a[:, 0] >= lo) & (a[:, 0] < hi)
    print(f"p in [{lo:.1f},{hi:.1f}): {m.sum():4d} drafts ({m.mean():.0%}), accepted {a[m,1].mean() if m.sum() else 0:.0%}")
print("all", len(a), a[:, 1].mean())
