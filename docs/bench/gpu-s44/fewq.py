"""Check and time ``warmspec.attention_cuda`` (attention for passes of a few positions) on CUDA.

    python3 docs/bench/gpu-s44/fewq.py [--weights float32|quantized]

1. Agreement with ``mx.fast.scaled_dot_product_attention``: largest absolute difference over
   queries, keys and values of the default model's shape (9 heads, 3 key/value heads, 64 wide),
   read through strided views as a cache holds them, causal and unmasked, per dtype.
2. One attention call, per width and context: the kernel against MLX's, each the time of 30
   independent calls in one evaluation (a pass's 30 layers) divided by 30.
3. The whole model, per width, at 256 and 1024 tokens of context, with MLX's attention and with
   the kernel; and a 16-position pass's logits against 16 one-position passes' (largest
   difference, whether every argmax agrees), with either.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import base
from mlx_lm.models.cache import make_prompt_cache

from warmspec import attention_cuda
from warmspec.model import load
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpu-s42"))
from widths import one_pass, timed  # noqa: E402  (gpu-s42's: the same pass and timing)


def agreement() -> None:
    for dtype in (mx.float32, mx.float16):
        worst = 0.0
        for L in (4, 8, 16, 64):
            for S in (L, 100, 1000, 5000):
                q = mx.random.normal((1, L, 9, 64)).astype(dtype).transpose(0, 2, 1, 3)
                kb = mx.random.normal((1, 3, S + 37, 64)).astype(dtype)
                vb = mx.random.normal((1, 3, S + 37, 64)).astype(dtype)
                k, v = kb[:, :, :S], vb[:, :, :S]
                for causal in (True, False):
                    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125,
                                                               mask="causal" if causal else None)
                    got = attention_cuda.attend(q, k, v, 0.125, causal)
                    d = mx.abs(ref.astype(mx.float32) - got.astype(mx.float32)).max().item()
                    worst = max(worst, d)
                    if d > (1e-4 if dtype == mx.float32 else 5e-3):
                        print(f"  MISMATCH {dtype} L={L} S={S} causal={causal}: {d:.3g}")
        print(f"agreement {dtype}: largest difference {worst:.3g}", flush=True)


def one_call() -> None:
    for S in (256, 1024, 4096):
        for L in (1, 2, 3, 4, 8, 16, 32, 64):
            qs = [mx.random.normal((1, 9, L, 64)) for _ in range(30)]
            k = mx.random.normal((1, 3, S, 64))
            v = mx.random.normal((1, 3, S, 64))
            mask = "causal" if L > 1 else None
            mlx_ms = timed(lambda: [mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
                                    for q in qs]) / 30
            line = f"context {S:5d} queries {L:2d}: MLX {mlx_ms:.4f} ms"
            if L >= attention_cuda.MIN_POSITIONS:
                ours = timed(lambda: [attention_cuda.attend(q, k, v, 0.125, True) for q in qs]) / 30
                line += f" kernel {ours:.4f} ms"
            print(line, flush=True)


def set_attention(modules, fn) -> None:
    for m in modules:
        m.scaled_dot_product_attention = fn


def whole_model(weights: str) -> None:
    lm = load(None, dequantize=weights == "float32")
    model = lm.model
    modules = [sys.modules[n] for n in {type(m).__module__ for m in model.modules()}
               if hasattr(sys.modules[n], "scaled_dot_product_attention")]
    print(f"weights {weights} kernels at load {lm.kernels}", flush=True)
    for context in (256, 1024):
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([[1] * context]), cache=cache))
        for w in (1, 2, 3, 4, 8, 16, 32):
            set_attention(modules, base.scaled_dot_product_attention)
            plain = timed(one_pass(model, cache, w))
            set_attention(modules, attention_cuda.scaled_dot_product_attention)
            ours = timed(one_pass(model, cache, w))
            print(f"context {context} width {w:2d}: MLX {plain:6.2f} ms kernel {ours:6.2f} ms", flush=True)
        ids = mx.random.randint(0, 1000, (1, 16))
        singles = []
        set_attention(modules, base.scaled_dot_product_attention)
        for i in range(16):
            singles.append(model(ids[:, i:i + 1], cache=cache))
        singles = mx.concatenate(singles, axis=1)
        for c in cache:
            c.trim(16)
        for name, fn in (("MLX", base.scaled_dot_product_attention),
                         ("kernel", attention_cuda.scaled_dot_product_attention)):
            set_attention(modules, fn)
            wide = model(ids, cache=cache)
            for c in cache:
                c.trim(16)
            d = mx.abs(wide.astype(mx.float32) - singles.astype(mx.float32)).max().item()
            same = bool(mx.all(wide.argmax(-1) == singles.argmax(-1)).item())
            print(f"context {context} 16 wide vs 16 single ({name}): largest logit difference {d:.3g},"
                  f" argmax same {same}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default="float32", choices=("float32", "quantized"))
    ap.add_argument("--skip-kernel-checks", action="store_true")
    ap.add_argument("--no-model", action="store_true", help="only parts 1 and 2 (no model needed)")
    a = ap.parse_args()
    print(f"device {mx.default_device()} mlx {mx.__version__}", flush=True)
    if not a.skip_kernel_checks:
        agreement()
        one_call()
    if not a.no_model:
        whole_model(a.weights)


if __name__ == "__main__":
    main()
