"""Usage: python missed.py edits-public.jsonl costs-cpu.json [N cases]

For each no-draft pass in the replay, how long a continuation was copyable from the context."""
import sys, collections, tempfile
from warmspec import blas
blas.reexec_with_openblas(sys.argv)
from pathlib import Path
from warmspec import bench
from warmspec.model import load
from warmspec.core.gate import CostTable

from warmspec.core import ngram, gate as gmod
LOG = {}
_prop = ngram.NgramDrafter.propose
def propose(self, k):
    r = _prop(self, k)
    f = self.follow
    LOG[len(self.own.tokens)] = ["none" if r is None else f"prop agree={f.agree if f else '-'} conf={r.confidence:.2f} n={len(r.tokens)}", None, f is not None and f.anchor is not None, list(r.tokens) if r else []]
    return r
ngram.NgramDrafter.propose = propose
_choose = gmod.Gate.choose
CUR = [0]
def choose(self, available, confidence, context=0, *, source=""):
    k = _choose(self, available, confidence, context, source=source)
    last = max(LOG) if LOG else None
    if last is not None: LOG[last][1] = (k, round(self.acceptance(confidence, source), 2))
    return k
gmod.Gate.choose = choose
lm = load(None)
costs = bench.read_costs(Path(sys.argv[2]))
cases = bench.read_cases([Path(sys.argv[1])])
eng = bench.replay_engine(lm, CostTable(costs.points), 64)
hist = collections.Counter()
examples = []; reasons = collections.Counter(); ex2 = []; gm = collections.Counter()
def longest_copy(ctx, fut, maxl=64):
    # longest L with fut[:L] contiguous in ctx (naive, via string search on token tuples)
    s = ",".join(map(str, ctx)) + ","
    best = 0
    for L in range(1, min(maxl, len(fut)) + 1):
        if ("," + ",".join(map(str, fut[:L])) + ",") in ("," + s):
            best = L
        else:
            break
    return best
for file, case in cases[: int(sys.argv[3]) if len(sys.argv) > 3 else None]:
    prep = bench.prepare(case, lm.tokenizer, Path(tempfile.mkdtemp()))
    prompt = prep.turns[-1]
    ref = lm.tokenizer.encode(case.reference)
    LOG.clear()
    r = bench.replay(eng, prompt, ref)
    ps = eng.model.script.decode_passes()
    P = len(prompt)
    for (s, w), (s2, _) in zip(ps, ps[1:]):
        if w != 1: continue
        p = s + 1 - P  # index into ref of the token this pass produces
        if p < 0 or p >= len(ref): continue
        L = longest_copy(prompt + ref[:p], ref[p:p + 64])
        b = 0 if L == 0 else (1 if L < 4 else (2 if L < 8 else (3 if L < 16 else 4)))
        hist[b] += 1
        e = LOG.get(P + p)
        why = "skip" if e is None else (e[0].split()[0] if e[1] is None else f"gated a={e[1][1]}")
        if e is not None and e[1] is not None and e[1][0] == 0:
            drafted = e[3]; m = 0
            while m < len(drafted) and p + m < len(ref) and drafted[m] == ref[p + m]: m += 1
            gm[min(m, 20) // 4 if m else -1] += 1
        if L >= 16: reasons[why.split('=')[0] if why.startswith('gated') else why] += 1
        if L >= 16 and len(ex2) < 25: ex2.append((case.id[:30], p, L, e))
        if L >= 8 and len(examples) < 12:
            examples.append((case.id[:40], p, L, repr(lm.tokenizer.decode(ref[max(p-8,0):p])), repr(lm.tokenizer.decode(ref[p:p+L]))))
names = ["0", "1-3", "4-7", "8-15", "16+"]
print({names[k]: v for k, v in sorted(hist.items())})
print(reasons); print('gated proposals, matching prefix (-1: 0, 0: 1-3, 1: 4-7, ... 5: 20+)', sorted(gm.items()))
for e in ex2: print(e)
