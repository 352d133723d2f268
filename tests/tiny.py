"""Tiny random-weight models of every cache kind, for exactness tests that run in seconds.

mlx-lm builds these architectures from a small config with random weights on CPU: ``llama`` and
``qwen3`` (attention KV), ``gemma3_text`` (sliding-window layers on ``RotatingKVCache``) and
``qwen3_5`` (GatedDeltaNet layers on ``ArraysCache`` between attention layers), and ``llama4``
(chunked local attention on ``ChunkedKVCache``, which drops positions before the current chunk,
every fourth layer global; a small mixture of experts).
"""

from __future__ import annotations

import importlib

import mlx.core as mx
from mlx.utils import tree_map

from warmspec.model import LoadedModel
from warmspec.tokenizer import byte_tokenizer

VOCAB = 256

CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
                  tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                  vocab_size=VOCAB, rope_theta=10000.0, max_position_embeddings=4096,
                  tie_word_embeddings=True),
    "gemma3_text": dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=4,
                        intermediate_size=128, num_attention_heads=4, num_key_value_heads=1,
                        head_dim=16, vocab_size=VOCAB, sliding_window=8, sliding_window_pattern=2,
                        query_pre_attn_scalar=16, max_position_embeddings=4096),
    "qwen3_5": dict(model_type="qwen3_5", text_config=dict(
        model_type="qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
        tie_word_embeddings=True, max_position_embeddings=4096,
        rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    "llama4": dict(model_type="llama4", text_config=dict(
        model_type="llama4_text", hidden_size=64, intermediate_size=64, intermediate_size_mlp=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
        attention_chunk_size=16, attention_bias=False, interleave_moe_layer_step=2, num_experts_per_tok=1,
        num_local_experts=2, rms_norm_eps=1e-5, rope_scaling=None, rope_theta=10000.0, use_qk_norm=True,
        max_position_embeddings=4096)),
}


def build(arch: str, seed: int = 0, scale: float = 4.0, vocab: int = VOCAB) -> LoadedModel:
    """A random model in float32; ``scale`` multiplies every weight matrix (sharper logits)."""
    cfg = dict(CONFIGS[arch])
    if vocab != VOCAB:
        if "text_config" in cfg:
            cfg["text_config"] = dict(cfg["text_config"], vocab_size=vocab)
        else:
            cfg["vocab_size"] = vocab
    mod = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(seed)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    model.set_dtype(mx.float32)
    model.update(tree_map(lambda p: p * scale if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    return LoadedModel(model=model, tokenizer=byte_tokenizer(), name=f"tiny-{arch}",
                       source="random", context_length=4096)
