"""Build an mlx-lm ``llama`` model and its tokenizer from a GGUF file.

``mx.load`` reads GGUF natively and hands quantized tensors back in MLX's own layout (uint32
``weight`` + ``scales`` + ``biases``, group size 32), so no re-quantization is needed: on a GPU the
weights stay quantized, on a CPU they are dequantized to float32 once at load (MLX's CPU quantized
matmul decodes the default model at 10 tok/s against 24 tok/s in float32, measured with OpenBLAS).

llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` so that its interleaved rope
reproduces Hugging Face's half-split rope. Running the attention with MLX's interleaved
("traditional") rope consumes the permuted weights as they are -- no row shuffling, and it works
on quantized weights too.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

from .tokenizer import Tokenizer, TokenizerError

GROUP_SIZE = 32

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_REQUIRED = (
    "llama.embedding_length",
    "llama.block_count",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.layer_norm_rms_epsilon",
)


class GGUFError(ValueError):
    """A GGUF file that cannot be used; the message names the file and the reason."""


def _mlx_name(gguf_name: str) -> str:
    base, _, leaf = gguf_name.rpartition(".")
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)", base):
        layer, part = m.groups()
        if part not in _LAYER_NAMES:
            raise GGUFError(f"unexpected tensor {gguf_name}")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{leaf}"
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{leaf}"
    raise GGUFError(f"unexpected tensor {gguf_name}")


def _scalar(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    v = meta.get(key, default)
    return v.item() if isinstance(v, mx.array) else v


def read(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    try:
        tensors, meta = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as e:
        raise GGUFError(f"{path}: not a readable GGUF file ({e})") from None
    if _scalar(meta, "general.architecture") != "llama":
        raise GGUFError(
            f"{path}: architecture {_scalar(meta, 'general.architecture')!r} is not supported "
            "from GGUF (only 'llama'); pass an MLX model directory instead"
        )
    missing = [k for k in _REQUIRED if k not in meta]
    if missing:
        raise GGUFError(f"{path}: GGUF metadata lacks {', '.join(missing)}")
    return tensors, meta


def model_args(meta: dict[str, Any], tensors: dict[str, mx.array]) -> llama.ModelArgs:
    heads = int(_scalar(meta, "llama.attention.head_count"))
    hidden = int(_scalar(meta, "llama.embedding_length"))
    if _scalar(meta, "llama.rope.scaling.type", "none") not in ("none", None) or (
        "rope_freqs.weight" in tensors
    ):
        raise GGUFError("GGUF models with rope scaling are not supported")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=int(_scalar(meta, "llama.block_count")),
        intermediate_size=int(_scalar(meta, "llama.feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=int(_scalar(meta, "llama.attention.head_count_kv", heads)),
        head_dim=int(_scalar(meta, "llama.attention.key_length", hidden // heads)),
        rms_norm_eps=float(_scalar(meta, "llama.attention.layer_norm_rms_epsilon")),
        vocab_size=int(_scalar(meta, "llama.vocab_size", len(tokens))),
        rope_theta=float(_scalar(meta, "llama.rope.freq_base", 10000.0)),
        rope_traditional=True,
        max_position_embeddings=int(_scalar(meta, "llama.context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
    )


def _bits(tensors: dict[str, mx.array], prefix: str) -> int:
    packed = tensors[f"{prefix}.weight"].shape[-1]
    groups = tensors[f"{prefix}.scales"].shape[-1]
    return packed * 32 // (groups * GROUP_SIZE)


def load(path: Path, *, dequantize: bool) -> tuple[nn.Module, Tokenizer, dict[str, Any]]:
    """Return ``(model, tokenizer, metadata)`` for a llama-architecture GGUF file."""
    tensors, meta = read(path)
    try:
        tokenizer = Tokenizer.from_gguf_metadata(meta)
    except (KeyError, TokenizerError) as e:
        raise GGUFError(f"{path}: tokenizer metadata unusable ({e})") from None
    args = model_args(meta, tensors)
    model = llama.Model(args)

    quantized = {k[: -len(".scales")] for k in tensors if k.endswith(".scales")}
    weights: dict[str, mx.array] = {}
    if dequantize:
        for name, t in tensors.items():
            stem = name.rsplit(".", 1)[0]
            if stem in quantized:
                if name.endswith(".weight"):
                    weights[_mlx_name(name)] = mx.dequantize(
                        t, tensors[f"{stem}.scales"], tensors[f"{stem}.biases"],
                        group_size=GROUP_SIZE, bits=_bits(tensors, stem),
                    ).astype(mx.float32)
            else:
                weights[_mlx_name(name)] = t.astype(mx.float32)
    else:
        bits = {_mlx_name(f"{stem}.weight").rsplit(".", 1)[0]: _bits(tensors, stem) for stem in quantized}
        nn.quantize(
            model,
            group_size=GROUP_SIZE,
            class_predicate=lambda p, m: {"group_size": GROUP_SIZE, "bits": bits[p]} if p in bits else False,
        )
        weights = {_mlx_name(k): v for k, v in tensors.items()}
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise GGUFError(f"{path}: tensors do not match a llama model ({e})") from None
    mx.eval(model.parameters())
    return model, tokenizer, meta
