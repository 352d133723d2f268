"""What the speculative loop costs where drafting finds nothing, apart from the machine's noise:
plain decoding, n-gram speculation, and the speculative loop with a drafter that never proposes
(``silent``: every step a plain step of the loop, with its bookkeeping), interleaved per repeat
on one prompt at a time, each mode on its own engine. Prints per case each mode's median tok/s
against plain's and the paired ratios (each repeat's own), and plain's own spread.

Usage: PYTHONPATH=daemon:protocol python docs/bench/cpu-s24/silent.py PROMPTS.jsonl ID[,ID...] [REPEATS] [TOKENS]
"""
import statistics as st
import sys

from warmspec import blas

blas.reexec_with_openblas(sys.argv)

from pathlib import Path  # noqa: E402

from warmspec.bench import flush, prepare, read_cases  # noqa: E402
from warmspec.core import GenerationStats, SamplingParams  # noqa: E402
from warmspec.core.engine import Engine, Run  # noqa: E402
from warmspec.model import load  # noqa: E402


class Silent:
    """A drafter that never proposes."""
    wants_hidden = False

    def commit(self, tokens, hidden=None):
        pass

    def propose(self, k):
        return None


path, ids = Path(sys.argv[1]), sys.argv[2].split(",")
repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 5
tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 128
lm = load(None)
cases = {c.id: c for _, c in read_cases([path])}
modes = ("plain", "ngram", "silent")
engines = {m: Engine(lm, speculate=m != "plain") for m in modes}


def go(mode, prompt):
    e = engines[mode]
    flush(e)
    run = Run(SamplingParams(), tokens, GenerationStats())
    out = [t for new in e.generate_tokens(prompt, run, drafter=Silent() if mode == "silent" else None)
           for t in new]
    return out, run.stats.decode_s


first = prepare(cases[ids[0]], lm.tokenizer, path.parent).turns[0]
for m in modes:
    go(m, first)  # warm-up, and the cost table
for cid in ids:
    prompt = prepare(cases[cid], lm.tokenizer, path.parent).turns[0]
    times = {m: [] for m in modes}
    outs = {}
    for _ in range(repeats):
        for m in modes:
            out, s = go(m, prompt)
            outs.setdefault(m, out)
            times[m].append(s / len(out))
    med = {m: st.median(v) for m, v in times.items()}
    paired = {m: st.median(p / x for p, x in zip(times["plain"], times[m])) for m in modes}
    same = all(outs[m] == outs["plain"] for m in modes)
    print(f"{cid}: medians " + ", ".join(f"{m} {med['plain'] / med[m]:.3f}" for m in modes[1:])
          + " | paired " + ", ".join(f"{m} {paired[m]:.3f}" for m in modes[1:])
          + f" | plain ms/token {min(times['plain']) * 1e3:.1f}-{max(times['plain']) * 1e3:.1f}"
          + f" | identical {same}", flush=True)
