"""The gate on a GPU, replayed on this CPU without the GPU's noise: a virtual clock.

    python3 refs.py REFS.json PROMPTS.jsonl...          (plain greedy answers, once: ~25 s a prompt)
    python3 vlab.py REFS.json GPU_RESULTS.json PREFIX REPEAT HOST_MS

Each reference answer is decoded again by the real engine (n-gram drafter, gate, ledger, request
calibration, all as shipped) over the bench's script model (``bench.replay_engine``: logits
one-hot on the reference), so the output is the reference and only the gate's decisions vary.
Time is virtual: ``time`` in the engine, gate and drafters modules reads a clock that each pass
advances by its cost in GPU_RESULTS.json's measured table (a one-position pass at the pipelined
plain step, a wider one at that width's pass cost) and each proposal by HOST_MS. The ledger,
host-time and cost-table observations run on that clock. A case's figure is the plain cost of
its tokens over the virtual decode time; each case runs REPEAT times in a row on one engine (as
``warmspec bench --repeat``), the median reported, cases in file order or shuffled
(``ORDER_SEED``) -- the gate's estimates carry over from case to case, so the order matters.

Knobs (environment): GATE_SET="NAME=VALUE,..." sets ``core.gate`` constants; ORDER_SEED shuffles
the case order; DEBUG=ID prints that case's drafting steps and the gate's estimates for them;
QUIET=1 prints the summary only. ``sweep2.sh TABLE PREFIX ENV...`` runs several orders (SEEDS).

What it leaves out: the GPU's own noise, the host's time outside proposing, and the refill of the
pipeline after a verify step (a plain pass after one costs the same as any). So its figures run
a little above the device's (our 36 prose prompts, float32 table of gpu-s41: geomean 1.33x here,
1.27x paired on the H100).
"""
import json, sys, statistics as st, math, types
from pathlib import Path
import warmspec.core.engine as E, warmspec.core.gate as G, warmspec.core.drafters as D, warmspec.core.ngram as N
from warmspec.model import load
from warmspec.core.gate import CostTable
from warmspec import bench
from warmspec.core.engine import Run, Engine
from warmspec.core import GenerationStats
from warmspec.bench import GREEDY

refs = json.load(open(sys.argv[1]))
res = json.load(open(sys.argv[2]))
prefix = sys.argv[3]
repeat = int(sys.argv[4])
HOST = float(sys.argv[5]) * 1e-3
OUTSIDE = float(sys.argv[6]) * 1e-3 if len(sys.argv) > 6 else 0.0
import os
for kv in filter(None, os.environ.get("GATE_SET", "").split(",")):
    k, v = kv.split("=")
    setattr(G, k, type(getattr(G, k))(float(v)))
QUIET = os.environ.get("QUIET")
clock = [0.0]
fake = types.SimpleNamespace(perf_counter=lambda: clock[0], monotonic=lambda: clock[0], time=lambda: clock[0])
for m in (E, G, D):
    m.time = fake
points = {int(c): {int(w): s for w, s in row.items()} for c, row in res["costs"].items()}
plain_t = {int(c): s for c, s in res["plain_costs"].items()}
base = CostTable(points, plain_t)
lm = load(None, dequantize=True)
eng = bench.replay_engine(lm, base, 64)
eng.observe_costs = True
eng.observe_host = True
eng._gate = None
eng._costs = CostTable(points, plain_t)
eng._pipelining_pays = lambda: True
model = eng.model
orig_call = type(model).__call__
def call(self, inputs, cache):
    c, w = cache[0].offset, inputs.shape[1]
    clock[0] += base.plain(c) if w == 1 else base.cost(w, c) + OUTSIDE
    return orig_call(self, inputs, cache)
type(model).__call__ = call
orig_prop = N.NgramDrafter.propose
def prop(self, k):
    clock[0] += HOST
    return orig_prop(self, k)
N.NgramDrafter.propose = prop
rows = []
DEBUG = os.environ.get("DEBUG")
ob = G.Ledger.book
def book(self, tokens, seconds, estimate, drafting, proposing=0.0):
    r = ob(self, tokens, seconds, estimate, drafting, proposing)
    if DEBUG and cur_key[0].endswith(DEBUG) and (drafting or r or self.drafted):
        print(f"  step el={self.elapsed*1e3:7.1f} tok={tokens} s={seconds*1e3:5.2f} drafting={drafting} bal={self.balance*1e3:6.1f} start={self.start*1e3:6.1f} drafts={self.drafts} pause={'PAUSE '+str(self.left) if r else ''}")
    return r
G.Ledger.book = book
oc = G.Gate.choose
def choose(self, available, confidence, context=0, *, source=""):
    k = oc(self, available, confidence, context, source=source)
    if DEBUG and cur_key[0].endswith(DEBUG) and k:
        r = self.acceptance(confidence, source)
        print(f"    choose k={k} of {available} conf={confidence:.3f} bin={self.bin(confidence, source)} rates=({r.first:.2f},{r.later:.2f}) calib={tuple(round(x,2) for x in self.calibration(source))} tallies acc={self.accepted.get(source,0):.2f} exp={self.expected.get(source,0):.2f}")
    return k
G.Gate.choose = choose
cur_key = [""]
items = list(refs.items())
if os.environ.get("ORDER_SEED"):
    import random
    random.Random(int(os.environ["ORDER_SEED"])).shuffle(items)
for key, r in items:
    if not key.startswith(prefix):
        continue
    prompt, ref = r["prompt"], r["ref"]
    sp = []
    cur_key[0] = key
    for _ in range(repeat):
        eos = eng.tokenizer.eos_ids
        end = next((t for t in reversed(prompt) if t in eos), min(eos, default=0))
        model.script = bench.Script(prompt, ref, end)
        bench.flush(eng)
        if DEBUG and key.endswith(DEBUG): print('--- run')
        run = Run(GREEDY, 256, GenerationStats())
        out = []
        t0 = None
        for new in eng.generate_tokens(prompt, run):
            if t0 is None:
                t0 = clock[0]  # after prefill and first token
            out.extend(new)
        spent = clock[0] - t0
        assert out == ref[:len(out)], key
        plain = sum(base.plain(len(prompt) - 1 + i) for i in range(1, len(out)))
        L = eng.gate.ledger
        sp.append((plain / spent, run.stats.drafted, run.stats.accepted, run.stats.passes, L.paused, round(L.balance * 1e3, 1)))
    m = sorted(sp)[len(sp) // 2]
    rows.append((m[0], key.split("/")[1], *m[1:]))
    if not QUIET: print(f"{key.split('/')[1]:18s} {m[0]:.3f} drafted {m[1]:4d} acc {m[2]:4d} passes {m[3]} paused {m[4]} bal {m[5]}  all {' '.join(f'{s[0]:.3f}' for s in sp)}", flush=True)
g = math.exp(st.mean(math.log(r[0]) for r in rows))
low = sorted(rows)[:4]
print(os.environ.get("GATE_SET",""), "lowest", " ".join(f"{r[1]}:{r[0]:.3f}" for r in low))
print(f"geomean {g:.3f}  min {min(rows)[0]:.3f} ({min(rows)[1]})  under0.97 {sum(r[0] < 0.97 for r in rows)}  "
      f"drafted {sum(r[2] for r in rows)} accepted {sum(r[3] for r in rows)}")
