"""GPU diagnosis: plain vs ngram vs ngram-with-a-silent-drafter on the weak own-36 cases."""
import sys, json, time, statistics, collections
import sys
from warmspec import blas
blas.reexec_with_openblas(sys.argv)
from warmspec.model import load
from warmspec.core.engine import Engine, Run
from warmspec.core.types import GenerationStats
from warmspec.core import SamplingParams
from warmspec.core.gate import Gate
from warmspec.bench import flush
def chat_ids(tok, msgs):
    return tok.encode(tok.apply_chat_template(msgs))
import warmspec.core.engine as E
W = sys.argv[1] if len(sys.argv) > 1 else "float32"
lm = load(None, dequantize=(W == "float32"))
ids = sys.argv[2].split(",")
cases = {}
for f in ["bench/prose-own.jsonl", "/work/shared/bench/prose-public.jsonl"]:
    try:
        for l in open(f):
            c = json.loads(l); cases[c["id"]] = c
    except OSError: pass
class Silent:
    wants_hidden = False
    def commit(self, t, h=None): pass
    def propose(self, k): return None
import os
from warmspec.core.gate import CostTable
kw = {}
if os.environ.get("COSTS"):  # simulate another machine's gate: its frozen table (CPU run)
    r = json.load(open(os.environ["COSTS"]))
    kw = dict(costs=CostTable({int(c): {int(p): t for p, t in row.items()} for c, row in r["costs"].items()},
                              {int(c): t for c, t in r["plain_costs"].items()}), observe_costs=False)
    if os.environ.get("OUTSIDE_MS"):
        Gate.observe_outside = lambda self, s: setattr(self, "outside_s", float(os.environ["OUTSIDE_MS"]) / 1000)
    Engine._pipelining_pays = lambda self: True
modes = os.environ.get("MODES", "plain,ngram,silent").split(",")
eng = {m: Engine(lm, speculate=(m != "plain"), **(kw if m in ("ngram", "uncal") else {})) for m in modes}
if "uncal" in eng:  # the gate as it was: learned rates without the request's calibration
    eng["uncal"].gate.calibration = lambda source: 1.0
log = []
orig_choose = Gate.choose
def choose(self, available, confidence, context=0, *, source=""):
    k = orig_choose(self, available, confidence, context, source=source)
    log.append(("choose", available, round(confidence, 3), k, round(self.acceptance(confidence, source), 3), source))
    return k
Gate.choose = choose
orig_verify = Engine._verify
def verify(self, head, draft, run):
    t = time.perf_counter(); s = orig_verify(self, head, draft, run)
    log.append(("verify", len(draft.tokens), len(s.tokens), round(1000 * (time.perf_counter() - t), 2), isinstance(head, E._Ahead)))
    return s
Engine._verify = verify
def go(mode, prompt):
    e = eng[mode]; flush(e)
    if os.environ.get("FRESH_GATE"): e._gate = None
    run = Run(SamplingParams(), int(__import__("os").environ.get("NTOK", "256")), GenerationStats())
    out = []
    for new in e.generate_tokens(prompt, run, drafter=Silent() if mode == "silent" else None):
        out.extend(new)
    return len(out) / run.stats.decode_s, out, run.stats
for m in eng: go(m, chat_ids(lm.tokenizer, cases[ids[0]]["messages"]))  # warm-up (and cost table)
g = eng["ngram"].gate
print("costs", {c: {p: round(1000 * t, 2) for p, t in r.items()} for c, r in g.costs.points.items()}, "plain", {c: round(1000*t,2) for c, t in g.costs.plain_points.items()}, flush=True)
for cid in ids:
    prompt = chat_ids(lm.tokenizer, cases[cid]["messages"])
    res = collections.defaultdict(list)
    for r in range(int(sys.argv[3]) if len(sys.argv) > 3 else 5):
        for m in eng:
            log.clear()
            v, out, st = go(m, prompt)
            res[m].append(v)
            if m == "ngram" and r == 0:
                L = list(log); S = st; toks = len(out)
    med = {m: statistics.median(v) for m, v in res.items()}
    print(f"{cid}:", {m: round(v / med.get('plain', v), 3) for m, v in med.items()}, "runs", {m: [round(x) for x in v] for m, v in res.items()}, flush=True)
    ver = [x for x in L if x[0] == "verify" and x[1] > 0]
    ch = [x for x in L if x[0] == "choose"]
    print("   tokens", toks, "passes", S.passes, "verify steps", len(ver), "drafted", sum(x[1] for x in ver), "emitted", sum(x[2] for x in ver),
          "verify ms med", statistics.median([x[3] for x in ver]) if ver else None, "proposals", len(ch), "refused", sum(1 for x in ch if x[3] == 0), "outside_ms", round(1000*eng['ngram'].gate.outside_s, 2), "host_ms", round(1000*eng['ngram'].gate.host_s, 3))
    print("   first choices", [x[1:5] for x in ch if x[3] > 0][:40])
    print("   verifies", [x[1:3] for x in ver][:40], flush=True)
