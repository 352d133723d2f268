"""Where the H200 host's run-to-run spread comes from (a diagnostic, not a test): plain greedy
decoding of one prompt, many times, variants interleaved so drift hits each alike. Per run: the
total, the median time between tokens, and the time in spikes (intervals over 3x the median).
Variants: as shipped; Python's garbage collector off during the decode; MLX's buffer cache never
cleared; both.  Usage: python docs/bench/h200-s24/noise/noise_probe.py PROMPTS.jsonl CASE_ID [--weights float32|quantized] [--runs N]"""
from __future__ import annotations

import argparse, gc, json, statistics as st, time
from pathlib import Path

import mlx.core as mx

from warmspec.bench import flush, prepare, read_cases
from warmspec.core import GenerationStats, SamplingParams
from warmspec.core import engine as engine_mod
from warmspec.core.engine import Engine, Run
from warmspec.model import load

ap = argparse.ArgumentParser()
ap.add_argument("prompts", type=Path)
ap.add_argument("case")
ap.add_argument("--weights", default="float32")
ap.add_argument("--runs", type=int, default=8)
ap.add_argument("--tokens", type=int, default=256)
ap.add_argument("--out", type=Path, default=None)
a = ap.parse_args()
lm = load(None, dequantize=a.weights == "float32")
case = next(c for _, c in read_cases([a.prompts]) if c.id == a.case)
prep = prepare(case, lm.tokenizer, a.prompts.parent)
prompt = prep.turns[0]
engine = Engine(lm, speculate=False)
real_clear = mx.clear_cache


def one(gc_off: bool, no_clear: bool) -> dict:
    flush(engine)
    mx.clear_cache = (lambda: None) if no_clear else real_clear
    engine_mod.mx.clear_cache = mx.clear_cache
    gc.collect()
    if gc_off:
        gc.disable()
    run = Run(SamplingParams(), a.tokens, GenerationStats())
    ticks = []
    try:
        t0 = time.perf_counter()
        for new in engine.generate_tokens(prompt, run):
            ticks.append(time.perf_counter())
    finally:
        gc.enable()
        mx.clear_cache = real_clear
        engine_mod.mx.clear_cache = real_clear
    iv = [b - a_ for a_, b in zip(ticks, ticks[1:])]
    med = st.median(iv)
    return dict(total=run.stats.decode_s, med_ms=med * 1e3, p90_ms=sorted(iv)[int(0.9 * len(iv))] * 1e3,
                max_ms=max(iv) * 1e3, spikes_ms=sum(x for x in iv if x > 3 * med) * 1e3,
                tokens=run.stats.completion_tokens)


variants = {"shipped": (False, False), "gc_off": (True, False), "no_clear": (False, True), "both": (True, True)}
one(False, False)  # warm-up
res = {v: [] for v in variants}
for r in range(a.runs):
    for v, (g, c) in variants.items():
        res[v].append(one(g, c))
for v, rows in res.items():
    tot = [x["total"] for x in rows]
    print(f"{v:9s} total med {st.median(tot):.3f} s min {min(tot):.3f} max {max(tot):.3f} "
          f"| step med {st.median(x['med_ms'] for x in rows):.2f} ms (runs {min(x['med_ms'] for x in rows):.2f}-{max(x['med_ms'] for x in rows):.2f}) "
          f"p90 {st.median(x['p90_ms'] for x in rows):.2f} max {max(x['max_ms'] for x in rows):.1f} "
          f"spikes {st.median(x['spikes_ms'] for x in rows):.1f} ms")
if a.out:
    a.out.write_text(json.dumps(res, indent=1))
