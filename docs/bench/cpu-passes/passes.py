"""Usage: PYTHONPATH=daemon:protocol python passes.py edits-public.jsonl costs-cpu.json

Classify the replay's decode passes on edits-public: no draft, full accept, cut by divergence."""
import sys, json, collections
from warmspec import blas
blas.reexec_with_openblas(sys.argv)
from pathlib import Path
from warmspec import bench
from warmspec.model import load
from warmspec.core.gate import CostTable

lm = load(None)
costs = bench.read_costs(Path(sys.argv[2]))
cases = bench.read_cases([Path(sys.argv[1])])
eng = bench.replay_engine(lm, CostTable(costs.points), 64)
tot = collections.Counter(); toks = collections.Counter(); hist = collections.Counter()
for file, case in cases:
    import tempfile
    prep = bench.prepare(case, lm.tokenizer, Path(tempfile.mkdtemp()))
    ref = lm.tokenizer.encode(case.reference)
    r = bench.replay(eng, prep.turns[-1], ref)
    ps = eng.model.script.decode_passes()
    c = collections.Counter(); t = collections.Counter()
    for (s, w), (s2, _) in zip(ps, ps[1:] + [(s + 1, 0) for s, _ in ps[-1:]]):
        k = w - 1; a = s2 - s
        cat = "nodraft" if k == 0 else ("full" if a - 1 >= k else "cut")
        if cat == "full": hist[k] += 1
        c[cat] += 1; t[cat] += a
    tot.update(c); toks.update(t)
    print(f"{case.id[:60]:60s} tok/pass {r.stats.tokens_per_pass:5.1f} " + " ".join(f"{k}={c[k]}/{t[k]}" for k in ("nodraft", "full", "cut")), flush=True)
print("passes", dict(tot), "tokens", dict(toks))
print("full-accept widths", sorted(hist.items()))
