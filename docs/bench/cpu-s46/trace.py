"""Stop 46: the gate's estimate of each drafting step against its measured time (read-back to
read-back), and each timed verify pass against the cost table. Run in place of `warmspec`:

    WARMSPEC_BLAS_CHECKED=1 BLIS_NUM_THREADS=2 LD_PRELOAD=.../blis-openmp/libblis.so.4 \
        PYTHONPATH=daemon:protocol python trace.py bench l13.jsonl --out o --modes ngram ...

(the BLAS set by hand: the re-exec would drop the patches). Writes /tmp/tr/steps.json."""
import json, os, sys
from warmspec.core import gate as G
rec = []
last = {}
orig_choose = G.Gate.choose
def choose(self, available, confidence, context=0, *, source=""):
    k = orig_choose(self, available, confidence, context, source=source)
    if k:
        a = self._calibrated(self.acceptance(confidence, source), source)
        costs = self.costs.costs(1 + k, context)
        last.update(k=k, first=a.first, later=a.later, est_exp=a.expected(k),
                    est_draft=costs[1 + k] + self.host_source.get(source, self.host_s) + self._outside(),
                    est_plain=self._plain_s(context), pipelined=self.pipelined, overlapped=self.overlapped,
                    outside=self.outside_s, conf=confidence)
    return k
G.Gate.choose = choose
orig_step = G.Gate.observe_step
def observe_step(self, tokens, seconds, *, drafting, context=0):
    r = dict(tokens=tokens, s=seconds, drafting=drafting, price=self.ledger.price(self._plain_s(context)),
             bal=self.ledger.balance, left=self.ledger.left)
    if drafting:
        r.update(last); last.clear()
    rec.append(r)
    return orig_step(self, tokens, seconds, drafting=drafting, context=context)
G.Gate.observe_step = observe_step
orig_obs = G.CostTable.observe
def cobs(self, p, context, seconds, alpha=0.05, beta=0.2):
    rec.append(dict(pass_p=p, pass_s=seconds, pred=self.cost(p, context), base=self.base(p, context), ctx=context))
    return orig_obs(self, p, context, seconds, alpha, beta)
G.CostTable.observe = cobs
import atexit
OUT = "/tmp/tr/steps.json"
os.makedirs(os.path.dirname(OUT), exist_ok=True)
atexit.register(lambda: json.dump(rec, open(OUT, "w")))
from warmspec.cli import main
sys.exit(main(sys.argv[1:]))
