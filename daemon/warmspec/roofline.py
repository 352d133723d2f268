"""The roofline of plain decoding on this machine, for the status page.

A plain decode step reads every weight once, plus the KV cache of the context, to produce one
token: its speed is bounded by memory bandwidth over the bytes a step reads. Speculation verifies
several positions in that one read, so its effective rate can pass the plain ceiling -- the page
shows by how much. Bandwidth is measured the way a decode step uses it: a float32 matrix-vector
product over a 64 MiB matrix on the model's device (the BLAS gemv the weights go through on a
CPU), best of five. On this 2-core VM that measured ~6-9 GB/s (shared, noisy): about the 538 MB
of the default model's float32 weights at 12-17 steps a second.
"""

from __future__ import annotations

import time

import msgspec

PROBE_BYTES = 64 << 20


class Roofline(msgspec.Struct, kw_only=True):
    bandwidth_bytes_s: float | None  # None: not measured
    weights_bytes: int
    kv_bytes: int
    step_bytes: int  # read by one plain step: weights + the live KV cache
    ceiling_tok_s: float | None  # bandwidth / step bytes: plain decoding cannot be faster
    effective_tok_s: float  # speculative decoding as measured (current request, else recent ones)
    over_ceiling: float | None  # effective / ceiling


def measure_bandwidth(nbytes: int = PROBE_BYTES, repeats: int = 5) -> float:
    """Bytes per second read by a matrix-vector product over ``nbytes`` of float32 (on the
    default device; call on the thread that owns MLX, before decoding starts)."""
    import mlx.core as mx

    cols = 4096
    rows = nbytes // (4 * cols)
    w = mx.full((rows, cols), 0.5, dtype=mx.float32)
    v = mx.full((cols,), 0.5, dtype=mx.float32)
    mx.eval(w, v)
    mx.eval(w @ v)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(w @ v)
        best = min(best, time.perf_counter() - t)
    del w, v
    mx.clear_cache()
    return rows * cols * 4 / best


def roofline(bandwidth: float | None, weights_bytes: int, kv_bytes: int, effective_tok_s: float) -> Roofline:
    step = weights_bytes + kv_bytes
    ceiling = bandwidth / step if bandwidth and step else None
    return Roofline(bandwidth_bytes_s=bandwidth, weights_bytes=weights_bytes, kv_bytes=kv_bytes,
                    step_bytes=step, ceiling_tok_s=ceiling, effective_tok_s=effective_tok_s,
                    over_ceiling=effective_tok_s / ceiling if ceiling and effective_tok_s else None)
