"""Usage: MAXD=64 python accdist.py edits-public.jsonl costs-cpu.json (MAXD: the draft ceiling)

Per confidence bin: how drafts fare -- first-token acceptance, and acceptance of the rest given the first."""
import sys, collections, tempfile
from warmspec import blas
blas.reexec_with_openblas(sys.argv)
from pathlib import Path
from warmspec import bench
from warmspec.model import load
from warmspec.core.gate import CostTable, Gate
from warmspec.core import gate as gmod
REC = []
_obs = Gate.observe
def observe(self, confidence, drafted, accepted, *, source=""):
    REC.append((self.bin(confidence, source)[1], drafted, accepted))
    return _obs(self, confidence, drafted, accepted, source=source)
Gate.observe = observe
lm = load(None)
costs = bench.read_costs(Path(sys.argv[2]))
cases = bench.read_cases([Path(p) for p in sys.argv[1].split(",")])
import os
eng = bench.replay_engine(lm, CostTable(costs.points), int(os.environ.get("MAXD", 64)))
tp = []
for file, case in cases:
    prep = bench.prepare(case, lm.tokenizer, Path(tempfile.mkdtemp()))
    ref = lm.tokenizer.encode(case.reference) if case.reference else None
    if ref is None: continue
    r = bench.replay(eng, prep.turns[-1], ref)
    tp.append((r.stats.completion_tokens, r.stats.passes, r.cost_s, r.plain_cost_s))
T, Pp, C, PC = map(sum, zip(*tp))
print(f"tok/pass {T/Pp:.2f} projected {PC/C:.2f}x cases {len(tp)}")
by = collections.defaultdict(list)
for b, d, a in REC: by[b].append((d, a))
for b in sorted(by):
    xs = by[b]
    first = sum(a >= 1 for d, a in xs) / len(xs)
    rest_a = sum(a - 1 for d, a in xs if a >= 1 and d > 1); rest_n = rest_a + sum(1 for d, a in xs if 1 <= a < d and d > 1)
    full = sum(a == d for d, a in xs) / len(xs)
    per_tok = sum(a for d, a in xs) / max(1, sum(min(d, a + 1) for d, a in xs))
    print(f"bin {b}: n={len(xs)} mean k={sum(d for d,a in xs)/len(xs):.1f} first={first:.2f} rest|first={rest_a/max(rest_n,1):.2f} full={full:.2f} geometric-a={per_tok:.2f}")
