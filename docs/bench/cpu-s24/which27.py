import sys, logging, statistics as st
from warmspec import blas
blas.reexec_with_openblas(sys.argv)
from pathlib import Path
from warmspec.bench import flush, prepare, read_cases
from warmspec.core import GenerationStats, SamplingParams
from warmspec.core.engine import Engine, Run
from warmspec.model import load
logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
class Silent:
    wants_hidden = False
    def commit(self, t, h=None): pass
    def propose(self, k): return None
lm = load(None)
path = Path("bench/prose-own.jsonl")
case = next(c for _, c in read_cases([path]) if c.id == "own-letter-27")
prompt = prepare(case, lm.tokenizer, path.parent).turns[0]
eng = {"plain": Engine(lm, speculate=False), "silent": Engine(lm, speculate=True)}
def go(m):
    e = eng[m]; flush(e)
    run = Run(SamplingParams(), 128, GenerationStats())
    n = sum(len(x) for x in e.generate_tokens(prompt, run, drafter=Silent() if m == "silent" else None))
    return run.stats.decode_s / n
for m in eng: go(m)
res = {m: [] for m in eng}
for r in range(6):
    for m in eng:
        c0 = dict(eng["silent"].plain_steps.count) if m == "silent" else None
        res[m].append(go(m))
        if m == "silent":
            ps = eng["silent"].plain_steps
            print(f"rep {r}: plain {res['plain'][-1]*1e3:.1f} ms/tok silent {res['silent'][-1]*1e3:.1f}; best={'pipelined' if ps.best else 'sync'} "
                  f"steps timed pipelined +{ps.count[True]-c0[True]} sync +{ps.count[False]-c0[False]}; means {ps.mean}", flush=True)
print("paired", st.median(p / s for p, s in zip(res["plain"], res["silent"])))
