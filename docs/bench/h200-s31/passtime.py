"""Timing helpers shared by this folder's probes (run on the device, see README.md)."""
import statistics, time
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache


def timed(fn, n=20, warm=3):
    """Median milliseconds of ``fn()`` over ``n`` calls after ``warm`` untimed ones."""
    for _ in range(warm): fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def pass_times(model, label, widths=(1, 2, 4, 8, 16), ctx=256):
    """Print the model's pass time by width at ``ctx`` tokens of context (each pass trimmed off
    again); return each width's logits."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[5] * ctx]), cache=cache))
    out, logits = [], {}
    for p in widths:
        x = mx.array([[7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67][:p]])
        def one():
            y = model(x, cache=cache); mx.eval(y)
            for c in cache: c.trim(p)
            return y
        logits[p] = one()
        out.append(f"{p}:{timed(one, n=12):.2f}")
    print(f"{label}: " + " ".join(out), flush=True)
    return logits
