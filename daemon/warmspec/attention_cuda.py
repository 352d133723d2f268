"""Attention for verify passes of a few positions on a CUDA GPU.

Why: on the H100 a pass of the default model (float32, 30 layers) cost 5.6 ms at 2 positions and
8.5 ms at 4 (``docs/bench/h100-s33``), and the jump was attention: MLX's CUDA backend runs its
one-query ("vector") kernel only for 1 to 3 queries (``query_sequence_length < 4`` in
``mlx/backend/cuda/scaled_dot_product_attention.cu``) and every wider pass through its tiled
kernel made for long prefills, 0.08-0.13 ms a layer against 0.007 ms. Slicing a pass into
one-query calls was slower still (4 positions: 10.0 ms). So on the GPU a draft of 3 or more
tokens started 2.3 ms behind, about 40% of a plain step, and on prose, where drafts seldom
land, the gate could not make drafting pay.

What: ``attend(q, k, v, scale, causal)`` in one kernel launch, a thread block per (batch, head,
query): the block's threads take one key each for the scores (kept in shared memory), reduce
them to the maximum and the sum of the exponentials, and then sum the value rows, a quarter of
the keys per group of 64 threads. Grouped-query heads share a key/value head as MLX's does. It
reads the cache's views in place (their strides are passed), so nothing is copied first.

Where: ``scaled_dot_product_attention`` uses it for passes of ``MIN_POSITIONS`` to
``MAX_POSITIONS`` queries with the causal mask or none, head size ``HEAD_DIM``, no attention
sinks, a float cache (not quantized), at most ``MAX_SCORES`` queries x keys; everything else,
plain one-position steps included, keeps MLX's kernels, so plain decoding is unchanged. So do
passes without a cache: those are training's (``warmspec forge`` trains a head through its
attention), and the kernel has no gradient. A wide pass's logits differ from one-position
passes' by float rounding, as they did with MLX's tiled kernel (greedy output differs only at
near ties; ``warmspec bench`` reports each).

Measured on the lent H100 (``docs/bench/gpu-s44``): one attention call 0.013-0.023 ms for 4-16
queries at 256 keys and 0.025 ms for 4 at 1024 (MLX's: 0.060-0.069); a pass of the default model
at 256 tokens of context, 4-16 positions, 7.4-7.6 -> 5.8-5.9 ms in float32 (one position: 3.3)
and 7.1-7.3 -> 5.1-6.6 ms in 4-bit. Our 36 prose prompts, float32, plain and n-gram in one
process each way, medians of 3 and a recheck: 1.28x plain with it against 1.21x without, prompts
under 0.97x (paired) 1 against 5, the per-prompt ratio up 6.7% (geomean).

``attention.install(model)`` rebinds ``scaled_dot_product_attention`` in the mlx-lm modules the
model is built from to this one on a CUDA device, unless ``WARMSPEC_FEW_QUERIES=0``.
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx
from mlx_lm.models import base

from warmspec.rows import on_cuda

# Part of the key of the cost tables kept on disk (``core.engine.default_cost_cache``).
VERSION = "fewq-1"
# MLX's own vector kernel serves 1 to 3 queries.
MIN_POSITIONS = 4
MAX_POSITIONS = 64
HEAD_DIM = 64
# The scores of one query live in shared memory: 8192 floats are 32 KiB of the 48 a block may hold
# without opting in to more.
MAX_KEYS = 8192
THREADS = 256
# A block re-reads its key/value head for each query, so the kernel's time grows with queries x
# keys while MLX's stays near 0.06-0.09 ms: on the H100 (``docs/bench/gpu-s44``) it won up to
# 32 queries at 256 keys and 8 at 1024, and tied at 4 x 4096.
MAX_SCORES = 8192

SOURCE = """
    constexpr int NW = THREADS / 32;
    constexpr int GROUPS = THREADS / D;
    __shared__ float sc[MAX_KEYS];
    __shared__ float qs[D];
    __shared__ float red[NW];
    __shared__ float part[GROUPS][D];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int L = q_shape[2], H = q_shape[1], KV = k_shape[1], S = k_shape[2];
    const int blk = blockIdx.x;
    const int l = blk % L, h = (blk / L) % H, b = blk / (L * H);
    const int g = h / (H / KV);
    const int n = CAUSAL ? S - L + l + 1 : S;
    const T* qp = q + b * q_strides[0] + h * q_strides[1] + l * q_strides[2];
    const T* kp = k + b * k_strides[0] + g * k_strides[1];
    const T* vp = v + b * v_strides[0] + g * v_strides[1];
    const int64_t ks = k_strides[2], vs = v_strides[2], ke = k_strides[3], ve = v_strides[3];
    if (tid < D) qs[tid] = static_cast<float>(qp[tid * q_strides[3]]) * scale[0];
    __syncthreads();
    float m = __int_as_float(0xff800000);  // -inf
    for (int j = tid; j < n; j += THREADS) {
        const T* kr = kp + j * ks;
        float d = 0.f;
        #pragma unroll
        for (int e = 0; e < D; ++e) d += qs[e] * static_cast<float>(kr[e * ke]);
        sc[j] = d;
        m = fmaxf(m, d);
    }
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = red[0];
    #pragma unroll
    for (int w = 1; w < NW; ++w) m = fmaxf(m, red[w]);
    __syncthreads();
    float s = 0.f;
    for (int j = tid; j < n; j += THREADS) {
        const float p = expf(sc[j] - m);
        sc[j] = p;
        s += p;
    }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
    if (lane == 0) red[warp] = s;
    __syncthreads();
    float total = 0.f;
    #pragma unroll
    for (int w = 0; w < NW; ++w) total += red[w];
    const int dim = tid % D, grp = tid / D;
    float acc0 = 0.f, acc1 = 0.f;
    int j = grp;
    for (; j + GROUPS < n; j += 2 * GROUPS) {
        acc0 += sc[j] * static_cast<float>(vp[j * vs + dim * ve]);
        acc1 += sc[j + GROUPS] * static_cast<float>(vp[(j + GROUPS) * vs + dim * ve]);
    }
    if (j < n) acc0 += sc[j] * static_cast<float>(vp[j * vs + dim * ve]);
    part[grp][dim] = acc0 + acc1;
    __syncthreads();
    if (tid < D) {
        float o = 0.f;
        #pragma unroll
        for (int r = 0; r < GROUPS; ++r) o += part[r][tid];
        out[((b * H + h) * L + l) * D + tid] = static_cast<T>(o / total);
    }
"""


@functools.cache
def _kernel():
    return mx.fast.cuda_kernel(name="warmspec_few_queries", input_names=["q", "k", "v", "scale"],
                               output_names=["out"], source=SOURCE, ensure_row_contiguous=False)


@functools.lru_cache(maxsize=8)
def _scale(scale: float) -> mx.array:
    """The scale as the kernel's input, made once: a new array per call is a host-to-device copy
    in each of a pass's 30 layers."""
    return mx.array([scale], dtype=mx.float32)


def attend(queries: mx.array, keys: mx.array, values: mx.array, scale: float, causal: bool) -> mx.array:
    """softmax(q k^T * scale [+ causal mask]) v for queries (B, H, L, D) and keys and values
    (B, KV, S, D), of any strides; the causal mask puts the L queries at the last L of the S
    positions."""
    B, H, L, D = queries.shape
    return _kernel()(
        inputs=[queries, keys, values, _scale(scale)],
        template=[("T", queries.dtype), ("D", D), ("CAUSAL", causal), ("THREADS", THREADS),
                  ("MAX_KEYS", MAX_KEYS)],
        grid=(B * H * L * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, H, L, D)], output_dtypes=[queries.dtype])[0]


def usable(queries: mx.array, keys: mx.array, values: mx.array, cache, mask, sinks) -> bool:
    """Whether ``attend`` serves this call (see the module's docstring)."""
    B, H, L, D = queries.shape
    causal_or_none = mask is None or isinstance(mask, str) and mask == "causal"
    return (MIN_POSITIONS <= L <= MAX_POSITIONS and D == HEAD_DIM and sinks is None and causal_or_none
            and cache is not None and not hasattr(cache, "bits")
            and L * keys.shape[2] <= MAX_SCORES and L <= keys.shape[2] <= MAX_KEYS
            and H % keys.shape[1] == 0
            and keys.dtype == queries.dtype == values.dtype
            and queries.dtype in (mx.float32, mx.float16, mx.bfloat16))


def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask, sinks=None):
    """mlx-lm's ``base.scaled_dot_product_attention``, with ``attend`` for passes of a few
    positions (see the module's docstring)."""
    if usable(queries, keys, values, cache, mask, sinks):
        return attend(queries, keys, values, scale, mask is not None)
    return base.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale,
                                             mask=mask, sinks=sinks)


def warm(model) -> None:
    """Compile the kernel now for each float dtype among ``model``'s parameters, not in a
    request's first wide pass: MLX compiles a custom kernel on first use (NVRTC), and that stalled
    a first pass for seconds (``rows.py``'s buckets, ``docs/bench/h100-s33``)."""
    from mlx.utils import tree_flatten

    floats = {v.dtype for _, v in tree_flatten(model.parameters())} & {mx.float32, mx.float16, mx.bfloat16}
    for dtype in floats:
        q = mx.zeros((1, 1, MIN_POSITIONS, HEAD_DIM), dtype)
        mx.eval(attend(q, q, q, 1.0, True))


def wanted() -> bool:
    return on_cuda() and os.environ.get("WARMSPEC_FEW_QUERIES", "1") != "0"
