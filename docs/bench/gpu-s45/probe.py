"""Stop 45's checks of ``warmspec.attention_cuda`` on CUDA.

    python3 docs/bench/gpu-s45/probe.py [--weights float32|quantized]

1. The load-time compile (``attention_cuda.warm``, commit 7b16109): the load's time, then the
   first 4-position pass after prefill against the next ones. Without it the first pass paid
   MLX's NVRTC compile (seconds); with it, the first pass should cost what the others do.
2. The shared score buffer (``MAX_KEYS``): the kernel timed with 8192 floats (as measured in
   gpu-s44) and with 2048 (the most the scores bound lets through at 4 queries), per width and
   context, each the time of 30 independent calls in one evaluation over 30.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from warmspec import attention_cuda
from warmspec.model import load
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpu-s42"))
from widths import timed  # noqa: E402


def first_pass(weights: str) -> None:
    t = time.perf_counter()
    lm = load(None, dequantize=weights == "float32")
    print(f"load {weights}: {time.perf_counter() - t:.2f} s, kernels {lm.kernels}", flush=True)
    model = lm.model
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1] * 64]), cache=cache))
    for i in range(4):
        t = time.perf_counter()
        mx.eval(model(mx.array([[2] * 4]), cache=cache))
        print(f"  4-position pass {i}: {(time.perf_counter() - t) * 1e3:.1f} ms", flush=True)
        for c in cache:
            c.trim(4)


def buffer_sizes() -> None:
    for S in (64, 256, 512, 1024, 2048):
        for L in (4, 8, 16, 32):
            if L * S > attention_cuda.MAX_SCORES or S < L:
                continue
            qs = [mx.random.normal((1, 9, L, 64)) for _ in range(30)]
            k = mx.random.normal((1, 3, S, 64))
            v = mx.random.normal((1, 3, S, 64))
            line = f"context {S:5d} queries {L:2d}:"
            for keys in (8192, 2048):
                attention_cuda.MAX_KEYS = keys
                ms = timed(lambda: [attention_cuda.attend(q, k, v, 0.125, True) for q in qs]) / 30
                line += f" MAX_KEYS {keys} {ms:.4f} ms"
            attention_cuda.MAX_KEYS = 8192
            print(line, flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default="float32", choices=("float32", "quantized"))
    a = ap.parse_args()
    print(f"device {mx.default_device()} mlx {mx.__version__}", flush=True)
    first_pass(a.weights)
    buffer_sizes()
