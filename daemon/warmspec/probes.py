"""Bench probes: the machine and mechanisms the prompt benchmark does not show on its own.

``blas``: matmul and plain decode speed in this process and in a child on each other BLAS the
machine has (MLX's bundled one, OpenBLAS, BLIS), side by side -- the re-exec on an optimized BLAS
(``blas.py``) is a claim to verify, not to assume, and which library is fastest depends on the
machine.

``rollback``: on a hybrid model (Qwen3.5-style GatedDeltaNet layers, random weights, ~130M
parameters), speculative decoding with per-position state capture against snapshot + replay,
under drafts rejected at controlled rates. Each run decodes the same tokens (checked), so the
decode-time ratio is the price of one rollback strategy over the other.

Like ``bench.py`` this module imports MLX only inside functions (the CLI imports it before it
re-executes itself on an optimized BLAS).
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

import msgspec

from .core import GenerationStats, SamplingParams

from . import blas
from .core.drafter import Proposal

PROBES = ("blas", "rollback", "typing")
DECODE_TOKENS = 64
REPEATS = 3


class BlasSide(msgspec.Struct):
    blas: str
    matmul_1024_s: float
    decode_tok_s: float  # median of REPEATS plain greedy runs


class BlasProbe(msgspec.Struct):
    optimized: BlasSide  # this process's
    bundled: BlasSide | None  # None where no child could run (macOS: Accelerate either way)
    others: list[BlasSide] = []  # the other optimized libraries installed (blas.LIBRARIES)


class RollbackRun(msgspec.Struct):
    wrong_every: int
    mode: str  # "capture" | "replay" | "plain"
    decode_s: float
    passes: int
    replays: int
    accepted: int
    drafted: int
    identical: bool


class ScriptedDrafter:
    """Guesses a known continuation, corrupting every ``wrong_every``-th guess, so passes end in
    every way: all accepted, none, partial. Deterministic, for measurements and tests."""

    def __init__(self, prompt: Sequence[int], reference: Sequence[int], *, wrong_every: int,
                 k: int = 8, vocab: int = 256):
        self.text = list(prompt) + list(reference)
        self.pos = len(prompt)
        self.wrong_every = wrong_every
        self.k = k
        self.vocab = vocab
        self.calls = 0

    wants_hidden = False

    def commit(self, tokens: Sequence[int], hidden=None) -> None:
        self.pos += len(tokens)

    def propose(self, k: int) -> Proposal | None:
        self.calls += 1
        guess = self.text[self.pos : self.pos + min(k, self.k + self.calls % 3)]
        if guess and self.calls % self.wrong_every == 0:
            i = self.calls % len(guess)
            guess[i] = (guess[i] + 1) % self.vocab
        return Proposal(tokens=guess, confidence=0.98, source="script") if guess else None


def _matmul_s() -> float:
    import mlx.core as mx

    a = mx.random.normal((1024, 1024))
    mx.eval(a)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        mx.eval(a @ a)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _decode_tok_s(lm) -> float:
    from .core.engine import Engine, Run

    tok = lm.tokenizer
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]))
    engine = Engine(lm, speculate=False)
    rates = []
    for _ in range(REPEATS + 1):  # the first run warms up
        engine.reset()
        engine.store.clear()
        stats = GenerationStats()
        for _ in engine.generate_tokens(prompt, Run(SamplingParams(), DECODE_TOKENS, stats)):
            pass
        rates.append(stats.completion_tokens / stats.decode_s)
    return statistics.median(rates[1:])


def blas_side(lm) -> BlasSide:
    return BlasSide(blas=blas.describe(), matmul_1024_s=_matmul_s(), decode_tok_s=_decode_tok_s(lm))


def _blas_child(name: str, model: str | None) -> BlasSide:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "WARMSPEC_BLAS_CHECKED")}
    env["WARMSPEC_BLAS"] = name
    cmd = [sys.executable, "-m", "warmspec.probes", "blas-child"] + ([model] if model else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return msgspec.json.decode(out.strip().splitlines()[-1], type=BlasSide)


def probe_blas(lm, model: str | None) -> BlasProbe:
    here = blas_side(lm)
    if not sys.platform.startswith("linux"):
        return BlasProbe(optimized=here, bundled=None)
    mine = blas.preloaded()
    found = {name: blas.find(name) for name in blas.LIBRARIES}
    others = [_blas_child(name, model) for name, path in found.items() if path and path != mine]
    return BlasProbe(optimized=here, bundled=_blas_child("bundled", model), others=others)


def hybrid_model():
    """A Qwen3.5-shaped hybrid with random weights (12 layers, 3 of 4 recurrent), float32."""
    import mlx.core as mx

    from .model import LoadedModel
    from .tokenizer import byte_tokenizer

    mod = importlib.import_module("mlx_lm.models.qwen3_5")
    cfg = dict(model_type="qwen3_5", text_config=dict(
        model_type="qwen3_5_text", hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=8192,
        linear_num_value_heads=16, linear_num_key_heads=8, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=4,
        tie_word_embeddings=True, max_position_embeddings=4096,
        rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}))
    mx.random.seed(0)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return LoadedModel(model=model, tokenizer=byte_tokenizer(), name="random qwen3_5 1024x12",
                       source="random", context_length=4096)


def probe_rollback(wrongs: Sequence[int] = (2, 4, 8, 16), tokens: int = 128) -> list[RollbackRun]:
    import numpy as np

    from .core.engine import Engine, Run
    from .core.gate import CostTable

    lm = hybrid_model()
    prompt = np.random.default_rng(0).integers(0, 256, 200).tolist()
    flat = CostTable({0: {1: 1.0, 33: 1.0}})

    def decode(mode: str, drafter) -> tuple[list[int], GenerationStats, int]:
        engine = Engine(lm, speculate=drafter is not None, costs=flat, gated=False, observe_costs=False,
                        recurrent_rollback="replay" if mode == "replay" else "capture")
        stats = GenerationStats()
        out = [t for new in engine.generate_tokens(prompt, Run(SamplingParams(), tokens, stats),
                                                   drafter=drafter, speculate=drafter is not None)
               for t in new]
        return out, stats, engine.replays

    reference, _, _ = decode("plain", None)
    runs = []
    for wrong in wrongs:
        for mode in ("plain", "capture", "replay"):
            samples = []
            for _ in range(REPEATS):
                drafter = None if mode == "plain" else ScriptedDrafter(prompt, reference, wrong_every=wrong)
                out, stats, replays = decode(mode, drafter)
                samples.append(RollbackRun(wrong_every=wrong, mode=mode, decode_s=stats.decode_s,
                                           passes=stats.passes, replays=replays, accepted=stats.accepted,
                                           drafted=stats.drafted, identical=out == reference))
            runs.append(sorted(samples, key=lambda r: r.decode_s)[len(samples) // 2])
    return runs


def report(blas_probe: BlasProbe | None, rollback: list[RollbackRun] | None) -> str:
    lines = []
    if blas_probe is not None:
        lines += ["## BLAS", "", "| BLAS | 1024² matmul | plain decode |", "|---|---|---|"]
        for side in (blas_probe.optimized, *blas_probe.others, blas_probe.bundled):
            if side is not None:
                lines.append(f"| {side.blas} | {side.matmul_1024_s * 1000:.1f} ms | {side.decode_tok_s:.1f} tok/s |")
        lines.append("")
    if rollback:
        lines += ["## Hybrid rollback (random Qwen3.5-shaped model, 3 of 4 layers recurrent)", "",
                  "| a draft corrupted every | mode | decode s | x plain | passes | replays | accepted/drafted | identical |",
                  "|---|---|---|---|---|---|---|---|"]
        plain = {r.wrong_every: r.decode_s for r in rollback if r.mode == "plain"}
        for r in rollback:
            lines.append(f"| {r.wrong_every} proposals | {r.mode} | {r.decode_s:.2f} | "
                         f"{plain[r.wrong_every] / r.decode_s:.2f}x | {r.passes} | {r.replays} | "
                         f"{r.accepted}/{r.drafted} | {'yes' if r.identical else 'NO'} |")
    return "\n".join(lines) + "\n"


def run(names: Sequence[str], out: Path, lm, model: str | None) -> str:
    blas_probe = probe_blas(lm, model) if "blas" in names else None
    rollback = probe_rollback() if "rollback" in names else None
    out.mkdir(parents=True, exist_ok=True)
    (out / "probes.json").write_bytes(msgspec.json.format(msgspec.json.encode(
        {"blas": blas_probe, "rollback": rollback})))
    text = report(blas_probe, rollback)
    if "typing" in names:  # ghost text over a scripted typing session: replay.py (typing.md / .json)
        from . import replay

        text += "\n## Typing session\n\n" + replay.run(lm, out)
    (out / "probes.md").write_text(text)
    return text


def _child() -> None:
    """``python -m warmspec.probes blas-child [MODEL]``: one BlasSide as JSON on stdout."""
    from .model import load

    lm = load(sys.argv[2] if len(sys.argv) > 2 else None)
    print(json.dumps(msgspec.to_builtins(blas_side(lm))))


if __name__ == "__main__" and sys.argv[1:2] == ["blas-child"]:
    blas.reexec_with_blas(["-m", "warmspec.probes", *sys.argv[1:]])
    _child()
