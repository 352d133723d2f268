"""Where a prose prompt that drafts little loses to plain decoding on a GPU: per-step times.

    python3 docs/bench/gpu-s40/steps.py OUT.json [--weights quantized] [--repeat 5] PROMPTS.jsonl...

Modes, alternating within each repeat on one loaded model (one process):
- plain:   plain decoding (pipelined, no drafter);
- idle:    n-gram speculation whose proposals are never verified (the drafter is told every token
           and proposes; the gate always answers 0): the speculative loop's own cost;
- ngram:   n-gram speculation as shipped.
Every step is timed read-back to read-back (the time between two yields of the decode loop), and
for n-gram tagged drafting / refill (the plain step right after a drafting step) / plain, so a
loss splits into the steps that cost it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from warmspec.bench import GREEDY, chat_ids, flush, read_cases
from warmspec.core.engine import Engine, Run
from warmspec.core.types import GenerationStats
from warmspec.model import load
from warmspec_protocol import Message


def decode(engine: Engine, prompt: list[int], max_tokens: int) -> dict:
    run = Run(GREEDY, max_tokens, GenerationStats())
    steps: list[tuple[float, int, int]] = []  # (seconds since the last yield, tokens, drafted passes so far)
    last = None
    t0 = time.perf_counter()
    n = 0
    for new in engine.generate_tokens(prompt, run):
        now = time.perf_counter()
        if last is not None:
            steps.append((now - last, len(new), run.stats.draft_passes))
        last = now
        n += len(new)
    total = time.perf_counter() - t0
    kinds: dict[str, list[float]] = {"plain": [], "drafting": [], "refill": []}
    prev_passes = steps[0][2] if steps else 0
    prev_drafting = False
    for s, _, dp in steps:
        drafting = dp > prev_passes
        kind = "drafting" if drafting else "refill" if prev_drafting else "plain"
        kinds[kind].append(s)
        prev_passes, prev_drafting = dp, drafting
    st = run.stats
    return {"tokens": n, "decode_s": sum(s for s, _, _ in steps), "total_s": total,
            "steps": len(steps), "drafted": st.drafted, "accepted": st.accepted,
            "draft_passes": st.draft_passes, "gated": st.gated_steps, "paused": st.paused_steps,
            "balance_s": engine.gate.ledger.balance if engine.speculate else 0.0,
            "kinds": {k: {"n": len(v), "sum_s": sum(v), "median_ms": 1e3 * statistics.median(v) if v else 0.0}
                      for k, v in kinds.items()}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("prompts", nargs="+", type=Path)
    ap.add_argument("--weights", default="quantized", choices=("quantized", "float32"))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--ids", default="")
    ap.add_argument("--budget", type=float, default=480)
    ap.add_argument("--max-tokens", type=int, default=None)
    a = ap.parse_args()
    start = time.time()
    lm = load(None, dequantize=a.weights == "float32")
    costs = Engine(lm).measure_costs()
    engines = {"plain": Engine(lm, speculate=False, costs=costs),
               "idle": Engine(lm, costs=costs), "ngram": Engine(lm, costs=costs)}
    engines["idle"].gate.choose = lambda *args, **kw: 0  # propose, never verify
    ids = set(filter(None, a.ids.split(",")))
    cases = [(f, c) for f, c in read_cases(a.prompts) if not ids or c.id in ids]
    for e in engines.values():
        decode(e, chat_ids(lm.tokenizer, [Message(role="user", content="Hello!")]), 16)
    out: dict = {"device": str(lm.device), "weights": a.weights, "cases": {}}
    for file, case in cases:
        prompt = chat_ids(lm.tokenizer, case.messages)
        res = {m: [] for m in engines}
        for _ in range(a.repeat):
            for m, e in engines.items():
                flush(e)
                res[m].append(decode(e, prompt, a.max_tokens or case.max_tokens))
        plain = statistics.median(r["decode_s"] for r in res["plain"])
        line = [case.id]
        for m in ("idle", "ngram"):
            ratio = statistics.median(p["decode_s"] / r["decode_s"] for p, r in zip(res["plain"], res[m]))
            line.append(f"{m} {ratio:.3f}x")
        print(" ".join(line), f"plain {plain:.3f}s", file=sys.stderr, flush=True)
        out["cases"][case.id] = res
        a.out.write_text(json.dumps(out))
        if time.time() - start > a.budget:
            print("budget spent", file=sys.stderr)
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
