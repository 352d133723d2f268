"""Linear layers for verify passes of a few positions on a CUDA GPU.

Why: on the H200 a forward pass of the default model (float32) cost 5.5 ms with one position and
10.0 ms with two (``docs/bench/h200-s31``): MLX multiplies one row by a weight matrix with a gemv
(0.020 ms for 576 x 1536) and 2 to 16 rows with a gemm tuned for large products (0.047-0.064
ms), and a pass has 210 such products. So a drafting step had to emit about 2.4 tokens before it
beat a plain step, and on prose it seldom did. Batched, broadcast and per-row gemv calls did not
help there (MLX folds the batch back into one gemm; per-row launches cost more).

What: ``matmul(x, w)`` computes ``x @ w.T`` for up to ``MAX_ROWS`` rows in one kernel that reads
the weights once, as the gemv does: one warp per output column walks its weight row and
accumulates it against every input row, then reduces across the warp. Each row's result is
summed in the same order whatever the number of rows, so the rows of a wide pass agree with each
other's one-row results exactly (not with MLX's gemv, whose order differs: the same kind of
difference a wide pass through MLX's gemm already had).

Where: ``install(model)`` turns the model's float ``nn.Linear`` layers into ``RowsLinear`` on a
CUDA device only, and only those of a shape where the kernel, timed there at load, beats MLX's
product for 4 rows (``MIN_GAIN``). Passes of one row (plain steps) and of more than
``MAX_ROWS`` (prefill chunks, long n-gram drafts) keep MLX's product; so do quantized layers,
which MLX multiplies with its own kernels (their pass cost did not jump from 1 to 2 positions).

Off unless ``WARMSPEC_ROWS=1``: measured on the lent H100 (``docs/bench/h100-s33``), it does not
pay. Timed inside a pass (32 products to an evaluation) MLX's product for 2 to 16 rows costs
0.014-0.024 ms and the kernel 0.013-0.029 ms, both near the cost of any kernel launch there (MLX's
one-row gemv: 0.006-0.013 ms); the s31 figures above timed one product per evaluation, which adds
a wait to both. With the kernel on every float layer the pass was no faster at any width. What
does make a pass of 4 or more positions dearer is attention (MLX's fused attention: 0.007 ms for
1 or 2 queries, 0.08 ms for 4 to 16, in each of 30 layers), which this module does not touch.
"""

from __future__ import annotations

import os
import statistics
import time

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

# Part of the key of the cost tables kept on disk (``core.engine.default_cost_cache``).
VERSION = "rows-1"
# Above this many rows MLX's gemm is the better product: every extra row costs the kernel
# another pass over its registers, while the gemm's cost stayed flat up to 32 rows.
MAX_ROWS = 16
# The kernel is kept only if it takes at most this share of MLX's time for 4 rows, measured at
# load: a product that merely ties is not worth a second code path.
MIN_GAIN = 0.8
WARP = 32
THREADS = 256

# Sizes the kernel is compiled for: a pass of n rows runs the smallest that holds n, with n read
# at run time. Why not one compile per n: MLX compiles a kernel per template instance on first
# use (NVRTC), and each new draft length then stalled its first pass; on the H100 the first run
# of a prose case took 2.4 s against 0.3 s for the next two (``docs/bench/h100-s33``).
BUCKETS = (2, 4, 8, 16)

SOURCE = """
    constexpr int WARP = 32;
    const int o = (blockIdx.x * blockDim.x + threadIdx.x) / WARP;
    const int lane = threadIdx.x % WARP;
    const int n = rows[0];
    if (o >= OUT) return;
    float acc[P];
    #pragma unroll
    for (int p = 0; p < P; ++p) acc[p] = 0.f;
    const T* w = W + (size_t)o * D;
    for (int d = lane; d < D; d += WARP) {
        const float wv = static_cast<float>(w[d]);
        #pragma unroll
        for (int p = 0; p < P; ++p)
            if (p < n) acc[p] += wv * static_cast<float>(x[p * D + d]);
    }
    #pragma unroll
    for (int p = 0; p < P; ++p) {
        if (p >= n) break;
        float v = acc[p];
        for (int off = WARP / 2; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffff, v, off);
        if (lane == 0) y[p * OUT + o] = static_cast<T>(v);
    }
"""

_kernel = None


def _compiled():
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="warmspec_rows_matmul", input_names=["x", "W", "rows"],
                                      output_names=["y"], source=SOURCE)
    return _kernel


def matmul(x: mx.array, w: mx.array) -> mx.array:
    """``x @ w.T`` for ``x`` (..., D) holding at most ``MAX_ROWS`` rows and ``w`` (OUT, D)."""
    *lead, d = x.shape
    n = x.size // d
    out = w.shape[0]
    bucket = next(b for b in BUCKETS if b >= n)
    y = _compiled()(inputs=[x.reshape(n, d), w, mx.array([n], dtype=mx.int32)],
                    template=[("T", x.dtype), ("P", bucket), ("D", d), ("OUT", out)],
                    grid=(out * WARP, 1, 1), threadgroup=(THREADS, 1, 1),
                    output_shapes=[(n, out)], output_dtypes=[x.dtype])[0]
    return y.reshape(*lead, out)


class RowsLinear(nn.Linear):
    """``nn.Linear`` whose passes of 2 to ``MAX_ROWS`` rows go through ``matmul``."""

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if rows < 2 or rows > MAX_ROWS or x.dtype != self.weight.dtype:
            return super().__call__(x)
        y = matmul(x, self.weight)
        return y + self.bias if "bias" in self else y

    @classmethod
    def of(cls, layer: nn.Linear) -> "RowsLinear":
        """The same layer, sharing ``layer``'s arrays."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for name in ("weight", "bias"):
            if name in layer:
                new[name] = layer[name]
        return new


def _ms(fn, n: int = 20) -> float:
    for _ in range(3):
        mx.eval(fn())
    times = []
    for _ in range(n):
        t = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def measure(w: mx.array, rows: int = 4, batch: int = 32) -> tuple[float, float]:
    """Milliseconds of MLX's product and of ``matmul`` for ``rows`` rows against ``w``, each the
    time of ``batch`` independent products in one evaluation divided by ``batch``.

    Why batched: in a pass the products run back to back on the device; one product evaluated
    alone also pays a launch and a wait (about 0.025 ms on the H100, as much as the product), which
    pulled both times toward each other and hid the kernel's gain (s32: 0.044 against 0.054 ms for
    4 rows, judged not worth it)."""
    xs = [mx.random.normal((1, rows, w.shape[1])).astype(w.dtype) for _ in range(batch)]
    mx.eval(xs)
    return (_ms(lambda: [x @ w.T for x in xs]) / batch,
            _ms(lambda: [matmul(x, w) for x in xs]) / batch)


def on_cuda() -> bool:
    return mx.default_device() != mx.cpu and hasattr(mx, "cuda") and mx.cuda.is_available()


def install(model: nn.Module, *, choose=measure) -> list[str]:
    """On a CUDA device, make those of ``model``'s float linear layers ``RowsLinear`` whose shape
    the kernel multiplies faster (``choose``: the two products' times for a weight, measured once
    per shape). Returns what it measured and chose, a line per shape (empty: nothing changed).
    Only with ``WARMSPEC_ROWS=1`` (see the module's docstring for why it is off)."""
    if os.environ.get("WARMSPEC_ROWS", "0") != "1" or not on_cuda():
        return []
    layers = [m for _, m in model.named_modules()
              if type(m) is nn.Linear and m.weight.dtype in (mx.float32, mx.float16, mx.bfloat16)]
    fast, lines = {}, []
    for m in layers:
        key = (tuple(m.weight.shape), str(m.weight.dtype))
        if key not in fast:
            mlx_ms, rows_ms = choose(m.weight)
            fast[key] = rows_ms <= MIN_GAIN * mlx_ms
            lines.append(f"{key[0][0]}x{key[0][1]} {key[1]}: 4 rows {mlx_ms:.3f} ms (MLX) against "
                         f"{rows_ms:.3f} ms ({VERSION}): {'kernel' if fast[key] else 'MLX'}")
    chosen = {id(m) for m in layers if fast[(tuple(m.weight.shape), str(m.weight.dtype))]}
    warmed = set()
    for m in layers:  # compile every bucket now, not in a request's first passes
        key = (tuple(m.weight.shape), str(m.weight.dtype))
        if id(m) in chosen and key not in warmed:
            warmed.add(key)
            mx.eval([matmul(mx.zeros((b, key[0][1]), m.weight.dtype), m.weight) for b in BUCKETS])
    if chosen:
        model.update_modules(tree_map(lambda m: RowsLinear.of(m) if id(m) in chosen else m,
                                      model.leaf_modules(), is_leaf=nn.Module.is_module))
    return lines if chosen else []
