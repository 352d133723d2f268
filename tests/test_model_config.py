"""What ``load`` reads from a model directory's config: tiny random models saved as MLX dirs."""

from __future__ import annotations

import json

import pytest
from mlx_lm.utils import save_model

from warmspec.model import load
from warmspec.tokenizer import byte_tokenizer

import tiny


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_context_length_read_from_flat_or_nested_config(arch, tmp_path):
    """Qwen3.5/3.6 configs nest ``max_position_embeddings`` under ``text_config``; without it the
    prompt-length check was off."""
    lm = tiny.build(arch)
    save_model(tmp_path, lm.model)
    (tmp_path / "config.json").write_text(json.dumps(tiny.CONFIGS[arch]))
    byte_tokenizer().backend.save(str(tmp_path / "tokenizer.json"))
    assert load(str(tmp_path)).context_length == 4096
