"""Why a pass of 2-4 positions costs 1.7-2.4x a one-position pass on the GPU (float32), where the
model's weights are read once either way: time the model's pieces at 1, 2, 4 and 16 positions.

    python3 docs/bench/gpu-s42/widths.py [--weights float32|quantized]

Per width, medians of 30 synchronized runs (after 5 warm-ups) of: the whole model on a warm
cache of 256 tokens (undone after each run); one layer's seven projections; one
``scaled_dot_product_attention`` over 256 keys with the causal mask and without a mask; one
layer whole.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from warmspec.model import load


def timed(f, n=30, warm=5) -> float:
    for _ in range(warm):
        mx.eval(f())
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        mx.eval(f())
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def one_pass(model, cache, width: int):
    """A function running the model over ``width`` positions on ``cache``, undone afterwards."""
    ids = mx.array([[2] * width])

    def run():
        out = model(ids, cache=cache)
        for c in cache:
            c.trim(width)
        return out
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default="float32", choices=("float32", "quantized"))
    a = ap.parse_args()
    lm = load(None, dequantize=a.weights == "float32")
    model = lm.model
    layers = model.layers if hasattr(model, "layers") else model.model.layers
    layer = layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    d = model.args.hidden_size
    from mlx_lm.models.cache import make_prompt_cache
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1] * 256]), cache=cache))
    print(f"device {mx.default_device()} weights {a.weights} hidden {d} layers {len(layers)}"
          f" cuda_kernel {hasattr(mx.fast, 'cuda_kernel')} mlx {mx.__version__}")
    n_heads, n_kv = attn.n_heads, attn.n_kv_heads
    hd = d // n_heads
    for w in (1, 2, 4, 16):
        x = mx.random.normal((1, w, d)).astype(layer.input_layernorm.weight.dtype)
        whole = one_pass(model, cache, w)
        projections = lambda: [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), attn.o_proj(x),  # noqa: E731
                               mlp.gate_proj(x), mlp.up_proj(x)]
        q = mx.random.normal((1, n_heads, w, hd)).astype(x.dtype)
        k = mx.random.normal((1, n_kv, 256 + w, hd)).astype(x.dtype)
        v = mx.random.normal((1, n_kv, 256 + w, hd)).astype(x.dtype)
        sd_mask = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=hd ** -0.5,  # noqa: E731
                                                               mask="causal" if w > 1 else None)
        sd_none = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=hd ** -0.5)  # noqa: E731
        W = mlp.up_proj.weight if not hasattr(mlp.up_proj, "scales") else None
        extra = ""
        if W is not None:
            flat = x.reshape(w, d)
            plain_mm = lambda: flat @ W.T  # noqa: E731
            rows = lambda: mx.concatenate([flat[i:i + 1] @ W.T for i in range(w)])  # noqa: E731
            batched = lambda: x.reshape(w, 1, d) @ W.T  # noqa: E731

            cols = lambda: (W @ flat.T).T  # noqa: E731
            extra = (f" | up_proj mm {timed(plain_mm):6.3f} rows {timed(rows):6.3f} batched {timed(batched):6.3f}"
                     f" W@x.T {timed(cols):6.3f} ms")
        print(f"width {w:2d}: model {timed(whole):6.2f} ms | 6 projections {timed(projections):6.3f} ms"
              f" | sdpa causal {timed(sd_mask):6.3f} none {timed(sd_none):6.3f} ms" + extra, flush=True)


if __name__ == "__main__":
    main()
