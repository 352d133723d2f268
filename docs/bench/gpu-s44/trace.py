"""Where a prose prompt's n-gram run loses to plain on a GPU, step by step.

    python3 docs/bench/gpu-s42/trace.py OUT.json PROMPTS.jsonl [--ids a,b] [--repeat 3] [--warm N]

One loaded model; ``--warm N`` first decodes the file's first N prompts on the n-gram engine (the
gate's estimates as the bench leaves them); then per prompt and repeat, plain and n-gram
alternating. Every step of the n-gram run is recorded: its time read-back to read-back, tokens,
whether it verified drafts (and how many, how many accepted), the host time of proposing
(``NgramDrafter.propose``) and of the gate's choice (``Gate.choose``) within it, what the ledger
was charged, and the ledger's balance after it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from warmspec.bench import GREEDY, chat_ids, flush, read_cases
from warmspec.core import gate as G
from warmspec.core import ngram as N
from warmspec.core.engine import Engine, Run
from warmspec.core.types import GenerationStats
from warmspec.model import load

cur: dict = {}


def wrap(cls, name, key):
    orig = getattr(cls, name)

    def f(*a, **k):
        t = time.perf_counter()
        r = orig(*a, **k)
        cur[key] = cur.get(key, 0.0) + time.perf_counter() - t
        return r
    setattr(cls, name, f)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("prompts", type=Path)
    ap.add_argument("--weights", default="float32", choices=("quantized", "float32"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ids", default="")
    ap.add_argument("--warm", type=int, default=0)
    a = ap.parse_args()
    lm = load(None, dequantize=a.weights == "float32")
    costs = Engine(lm).measure_costs()
    plain_e, ngram_e = Engine(lm, speculate=False, costs=costs), Engine(lm, costs=costs)
    wrap(N.NgramDrafter, "propose", "propose")
    wrap(G.Gate, "choose", "choose")
    orig_charge = G.Ledger.charge

    def charge(self, s):
        cur["charged"] = cur.get("charged", 0.0) + s
        orig_charge(self, s)
    G.Ledger.charge = charge
    cases = read_cases([a.prompts])
    ids = [i for i in a.ids.split(",") if i]

    def run(engine, prompt, max_tokens, trace):
        r = Run(GREEDY, max_tokens, GenerationStats())
        steps, last = [], None
        cur.clear()
        for new in engine.generate_tokens(prompt, r):
            now = time.perf_counter()
            if last is not None and trace:
                L = engine.gate.ledger
                steps.append({"s": now - last, "n": len(new), "dp": r.stats.draft_passes,
                              "drafted": r.stats.drafted, "acc": r.stats.accepted,
                              "bal": L.balance, "paused": L.paused, **cur})
            cur.clear()
            last = now
        return {"decode_s": sum(s["s"] for s in steps) if trace else 0.0, "steps": steps,
                "stats": {k: getattr(r.stats, k) for k in ("drafted", "accepted", "draft_passes",
                                                           "gated_steps", "paused_steps", "passes")}}

    for file, case in cases[:a.warm]:
        flush(ngram_e)
        run(ngram_e, chat_ids(lm.tokenizer, case.messages), case.max_tokens, False)
    out = {"device": str(lm.device), "weights": a.weights, "cases": {}}
    for file, case in cases:
        if ids and case.id not in ids:
            continue
        prompt = chat_ids(lm.tokenizer, case.messages)
        res = {"plain": [], "ngram": []}
        for _ in range(a.repeat):
            for m, e in (("plain", plain_e), ("ngram", ngram_e)):
                flush(e)
                t = time.perf_counter()
                x = run(e, prompt, case.max_tokens, True)
                x["total_s"] = time.perf_counter() - t
                res[m].append(x)
        ratio = statistics.median(p["total_s"] / n["total_s"] for p, n in zip(res["plain"], res["ngram"]))
        print(case.id, f"ngram {ratio:.3f}x paired", [r["stats"] for r in res["ngram"]], file=sys.stderr, flush=True)
        out["cases"][case.id] = res
        a.out.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
