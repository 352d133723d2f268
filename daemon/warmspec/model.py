"""Load a model once: the embedded default, a GGUF file, an MLX model directory or a Hugging Face id.

Whatever the source, the result is one ``LoadedModel``: an mlx-lm module, a ``Tokenizer`` and the
model's recommended sampling settings. The daemon loads one per process and hands the same object
to every engine, so weights are never resident twice (OptiQ's first MTP wiring loaded the base
model twice: 6.5 GB became 16.7 GB on Qwen3.5-9B).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from warmspec_protocol import SamplingParams

from . import attention, fetch, gguf, memory, rows
from .tokenizer import Tokenizer, TokenizerError


class ModelError(RuntimeError):
    """A model that cannot be found or loaded; ``str()`` is one line for the user."""


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Tokenizer
    name: str
    source: str
    defaults: SamplingParams = field(default_factory=SamplingParams)
    context_length: int | None = None
    quantized: bool = False
    # Kernels ``load`` put in MLX's place (``attention.VERSION``, ``attention_cuda.VERSION``,
    # ``rows.VERSION``); they change what passes cost, so the gate's cost tables are keyed by them.
    kernels: tuple[str, ...] = ()
    # What ``rows.install`` measured at load, a line per layer shape (empty off CUDA).
    kernel_notes: tuple[str, ...] = ()

    @property
    def device(self) -> str:
        return str(mx.default_device())

    @property
    def nbytes(self) -> int:
        from mlx.utils import tree_flatten

        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))


def on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def load(spec: str | None = None, *, dequantize: bool | None = None) -> LoadedModel:
    """Load ``spec`` (None: the embedded default). ``dequantize`` defaults to True on CPU. On a
    CPU, wide passes' attention is routed around MLX's slow ``exp``, on a CUDA GPU passes of a
    few positions get a kernel of their own (``attention.install``); there too, with
    ``WARMSPEC_ROWS=1``, their float linear layers go through a kernel for a few rows
    (``rows.install``)."""
    lm = _load(spec, dequantize=on_cpu() if dequantize is None else dequantize)
    version = attention.install(lm.model)
    kernels = [version] if version else []
    notes = rows.install(lm.model)
    lm.kernels = tuple(kernels + ([rows.VERSION] if notes else []))
    lm.kernel_notes = tuple(notes)
    return lm


def _load(spec: str | None, *, dequantize: bool) -> LoadedModel:
    if spec is None:
        try:
            path = fetch.pull()
        except fetch.FetchError as e:
            raise ModelError(f"default model unavailable: {e}") from None
        fits(path, dequantize, fetch.DEFAULT_MODEL_NAME)
        return load_gguf(path, dequantize=dequantize, name=fetch.DEFAULT_MODEL_NAME)
    path = Path(spec).expanduser()
    if path.is_file():
        fits(path, dequantize, path.name)
        return load_gguf(path, dequantize=dequantize)
    if path.is_dir():
        fits(path, dequantize, path.name)
        return load_mlx_dir(path, dequantize=dequantize, name=path.name)
    resolved = _resolve_hub_id(spec)
    fits(resolved, dequantize, spec)
    return load_mlx_dir(resolved, dequantize=dequantize, name=spec)


def fits(path: Path, dequantize: bool, name: str) -> None:
    """Refuse a model larger than available memory before reading its weights (memory.py)."""
    try:
        memory.check_model(path, dequantize=dequantize, name=name)
    except memory.NotEnoughMemory as e:
        raise ModelError(str(e)) from None


def load_gguf(path: Path, *, dequantize: bool, name: str | None = None) -> LoadedModel:
    try:
        model, tokenizer, meta = gguf.load(path, dequantize=dequantize)
    except gguf.GGUFError as e:
        raise ModelError(str(e)) from None
    ctx = meta.get("llama.context_length")
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name or path.stem,
        source=str(path),
        context_length=int(ctx.item()) if ctx is not None else None,
        quantized=not dequantize,
    )


def _resolve_hub_id(spec: str) -> Path:
    looked = f"model {spec!r} not found: not a file or directory"
    if spec.count("/") != 1 or spec.startswith((".", "/", "~")):
        raise ModelError(f"{looked}, and not a Hugging Face id (owner/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(spec, local_files_only=True, allow_patterns=patterns))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        pass
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    if not offline:
        try:
            return Path(snapshot_download(spec, allow_patterns=patterns))
        except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelError(f"{looked}; downloading it from Hugging Face failed: {reason}") from None
    raise ModelError(f"{looked}, and not in the Hugging Face cache (offline)")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}: invalid JSON ({e})") from None


def generation_defaults(config: dict[str, Any]) -> SamplingParams:
    """Sampling settings from a model's ``generation_config.json``; greedy where it says nothing."""
    if not config.get("do_sample", True) or "temperature" not in config:
        return SamplingParams()
    return SamplingParams(
        temperature=float(config.get("temperature") or 0.0),
        top_p=float(config.get("top_p") or 1.0),
        top_k=int(config.get("top_k") or 0),
        min_p=float(config.get("min_p") or 0.0),
    )


def context_length(config: dict[str, Any]) -> int | None:
    """The context the model was trained for; multimodal configs (Qwen3.5/3.6) keep it in
    ``text_config``."""
    for c in (config, config.get("text_config") or {}):
        if isinstance(c, dict) and isinstance(n := c.get("max_position_embeddings"), int) and n > 0:
            return n
    return None


def load_mlx_dir(path: Path, *, dequantize: bool, name: str) -> LoadedModel:
    from mlx_lm.utils import dequantize_model, load_model

    config = _read_json(path / "config.json")
    if not config:
        raise ModelError(f"{path} has no config.json: not a model directory")
    try:
        model, config = load_model(path)
    except (FileNotFoundError, ValueError) as e:
        raise ModelError(f"{path}: {e}") from None
    quantized = "quantization" in config or "quantization_config" in config
    if dequantize:
        if quantized:
            model = dequantize_model(model)
            quantized = False
        model.set_dtype(mx.float32)
        mx.eval(model.parameters())
    gen = _read_json(path / "generation_config.json")
    eos = gen.get("eos_token_id", config.get("eos_token_id"))
    eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    try:
        tokenizer = Tokenizer.from_dir(path, extra_eos_ids=eos_ids)
    except TokenizerError as e:
        raise ModelError(str(e)) from None
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        source=str(path),
        defaults=generation_defaults(gen),
        context_length=context_length(config),
        quantized=quantized,
    )
