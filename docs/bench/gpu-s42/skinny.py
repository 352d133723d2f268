"""A matrix product for passes of 2-16 positions on CUDA that reads the weights once, as the
one-position kernel (gemv) does, instead of MLX's cuBLAS path for M > 1.

    python3 docs/bench/gpu-s42/skinny.py

Checks the kernel against ``x @ w.T`` and times, per width, one projection and the whole model
(30 layers and the tied output head) with and without it. Float32 only.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn

from warmspec.model import load
from widths import one_pass, timed  # this folder's: the same pass and timing

SOURCE = """
    int lane = threadIdx.x;
    int n = blockIdx.y * blockDim.y + threadIdx.y;
    if (n >= N) return;
    float acc[P];
    #pragma unroll
    for (int p = 0; p < P; ++p) acc[p] = 0.0f;
    const T* row = w + (size_t)n * K;
    for (int k = lane; k < K; k += 32) {
        float wv = static_cast<float>(row[k]);
        #pragma unroll
        for (int p = 0; p < P; ++p) acc[p] += wv * static_cast<float>(x[p * K + k]);
    }
    #pragma unroll
    for (int p = 0; p < P; ++p) {
        float v = acc[p];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffff, v, o);
        if (lane == 0) out[p * N + n] = static_cast<T>(v);
    }
"""


@functools.cache
def _kernel():
    return mx.fast.cuda_kernel(name="skinny_mm", input_names=["x", "w"], output_names=["out"],
                               source=SOURCE)


def skinny(x: mx.array, w: mx.array) -> mx.array:
    """``x @ w.T`` for x of shape (..., K) with 2-16 rows in all, w of shape (N, K)."""
    lead = x.shape[:-1]
    K = x.shape[-1]
    P = x.size // K
    N = w.shape[0]
    out = _kernel()(inputs=[x.reshape(P, K), w], template=[("T", x.dtype), ("P", P), ("K", K), ("N", N)],
                  grid=(32, ((N + 7) // 8) * 8, 1), threadgroup=(32, 8, 1),
                  output_shapes=[(P, N)], output_dtypes=[x.dtype])[0]
    return out.reshape(*lead, N)


def use(x: mx.array) -> bool:
    rows = x.size // x.shape[-1]
    return 2 <= rows <= 16 and x.dtype == mx.float32


_linear = nn.Linear.__call__
_as_linear = nn.Embedding.as_linear


def linear(self, x):
    if "weight" in self and use(x) and "scales" not in self:
        y = skinny(x, self.weight)
        return y + self.bias if "bias" in self else y
    return _linear(self, x)


def as_linear(self, x):
    if use(x) and "scales" not in self:
        return skinny(x, self.weight)
    return _as_linear(self, x)


def main() -> None:
    lm = load(None, dequantize=True)
    model = lm.model
    from mlx_lm.models.cache import make_prompt_cache
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1] * 256]), cache=cache))
    layer = model.model.layers[0] if hasattr(model, "model") else model.layers[0]
    W = layer.mlp.up_proj.weight
    for w in (2, 4, 8, 16):
        x = mx.random.normal((1, w, W.shape[1]))
        err = mx.abs(skinny(x, W) - x @ W.T).max().item()
        whole = one_pass(model, cache, w)
        base_model = timed(whole)
        ref = whole()
        nn.Linear.__call__, nn.Embedding.as_linear = linear, as_linear
        try:
            fast_model = timed(whole)
            got = whole()
        finally:
            nn.Linear.__call__, nn.Embedding.as_linear = _linear, _as_linear
        logit_err = mx.abs(got - ref).max().item()
        same = (mx.argmax(got, -1) == mx.argmax(ref, -1)).all().item()
        print(f"width {w:2d}: up_proj mm {timed(lambda: x @ W.T):6.3f} skinny {timed(lambda: skinny(x, W)):6.3f} ms"
              f" (max err {err:.1e}) | model {base_model:6.2f} -> {fast_model:6.2f} ms"
              f" (logits max diff {logit_err:.1e}, argmax same {same})", flush=True)
    print(f"one position: model {timed(one_pass(model, cache, 1)):6.2f} ms", flush=True)


if __name__ == "__main__":
    main()
