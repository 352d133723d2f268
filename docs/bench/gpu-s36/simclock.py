"""Replay plain outputs through the real engine -- drafter, gate, ledger, verify loop -- over a
replay model, on a simulated clock: each pass advances it by a device's measured cost (width 1:
the pipelined plain step; wider: the table's synchronous pass). Host time is free. Variants:
old (no calibration), new (this tree)."""
import sys, json, statistics, os
sys.path[:0] = ["/work/main/daemon", "/work/main/protocol"]
from warmspec import bench as B
from warmspec.core import gate as G, engine as E
from warmspec.core.gate import CostTable
from warmspec.core.engine import Run, MAX_DRAFT
from warmspec.core.types import GenerationStats
from warmspec.model import load

class Clock:
    t = 0.0
    @staticmethod
    def perf_counter():
        return Clock.t
E.time = Clock
G.time = Clock
E.Engine._overlap = lambda self, steps: True
E.Engine._pipelining_pays = lambda self: True
def plain_steps(self):
    if self._plain_steps is None:
        self._plain_steps = E.PlainSteps(self.costs, True, learn=False)
    return self._plain_steps
E.Engine.plain_steps = property(plain_steps)

r = json.load(open(sys.argv[1]))
pts = {int(c): {int(w): t for w, t in row.items()} for c, row in r["costs"].items()}
plain = {int(c): t for c, t in r["plain_costs"].items()}
data = json.load(open("/tmp/hb/plain.json"))
only = os.environ.get("ONLY")
lm = load()
variants = sys.argv[2].split(",")
orig_cal = G.Gate.calibration
ORIG = {k: getattr(G, k) for k in dir(G) if k.isupper()}
res = {}
for v in variants:
    G.Gate.calibration = (lambda self, s: (1.0, 1.0)) if v.startswith("old") else orig_cal
    for kv in v.split("+")[1:]:  # e.g. new+LOSS_SHARE=0.01
        k, x = kv.split("="); setattr(G, k, type(getattr(G, k))(float(x)))
    costs = CostTable(pts, plain)  # the clock's: fixed
    table = CostTable(pts, plain)  # the engine's: online corrections off (the clock ticks at graph build)
    table.observe = lambda *a, **k: None
    table.observe_plain = lambda *a, **k: None
    eng = B.replay_engine(lm, table, MAX_DRAFT)
    eng.observe_costs = True; eng.observe_host = True
    model = eng.model
    cls = type(model)
    base_call = cls.__call__
    def call(self, inputs, cache, _base=base_call, _costs=costs):
        start, width = cache[0].offset, inputs.shape[1]
        Clock.t += _costs.plain_points and (_costs.plain(start) if width == 1 else _costs.cost(width, start))
        return _base(self, inputs, cache)
    cls.__call__ = call
    rows = []
    import random
    items = list(data.items())
    seeds = [int(x) for x in os.environ.get("SEEDS", "-1").split(",")]
    order = []
    for seed in seeds:
        its = list(items)
        if seed >= 0:
            random.Random(seed).shuffle(its)
        order += its
    for key, d in order:
        if only and not key.startswith(only): continue
        prompt, ref = d["prompt"], d["out"]
        eos = eng.tokenizer.eos_ids
        end = next((t for t in reversed(prompt) if t in eos), min(eos, default=0))
        eng.model.script = script = B.Script(prompt, ref, end)
        B.flush(eng)
        run = Run(B.GREEDY, d["max_tokens"], GenerationStats())
        out = [t for new in eng.generate_tokens(prompt, run) for t in new]
        assert out == ref[:len(out)], key
        pc = sum(costs.plain(len(prompt) - 1 + i) for i in range(len(out)))
        st = run.stats
        rows.append((key, pc / st.decode_s, st.drafted, st.accepted, st.paused_steps))
    cls.__call__ = base_call
    for kv in v.split("+")[1:]:
        k, x = kv.split("="); setattr(G, k, ORIG[k])
    res[v] = rows
if len(seeds) > 1:
    for v in variants:
        for f in ("prose-own", "prose-public"):
            sp = [x[1] for x in res[v] if x[0].startswith(f)]
            per = [sorted(sp[i::1]) for i in range(1)]
            print(f"ALL {f:12s} {v:34s} geomean {statistics.geometric_mean(sp):.3f} min {min(sp):.3f} below0.97 {sum(s < 0.97 for s in sp)/len(seeds):.1f}/run below0.95 {sum(s < 0.95 for s in sp)/len(seeds):.1f}/run 10th pct {sorted(sp)[len(sp)//10]:.3f}")
    sys.exit()
for f in ("prose-own", "prose-public"):
    for v in variants:
        rs = [x for x in res[v] if x[0].startswith(f)]
        if not rs: continue
        sp = [x[1] for x in rs]
        print(f"{f:12s} {v:28s} geomean {statistics.geometric_mean(sp):.3f} min {min(sp):.3f} below0.97 {sum(s < 0.97 for s in sp):2d} drafted {sum(x[2] for x in rs)} accepted {sum(x[3] for x in rs)} paused {sum(x[4] for x in rs)}")
if "-v" in sys.argv:
    for i, x in enumerate(res[variants[0]]):
        print(x[0], *[f"{v}:{res[v][i][1]:.3f}({res[v][i][2]}/{res[v][i][3]} p{res[v][i][4]})" for v in variants])
