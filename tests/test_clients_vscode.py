"""The VS Code extension (clients/vscode): type-checked against @types/vscode, and its JSON-RPC
session module (src/session.ts, no ``vscode`` import) run in Node against a real ``warmspec lsp``
by clients/vscode/test/session.test.ts. Needs Node (20+) and npm; ``npm ci`` runs once, when
clients/vscode/node_modules is missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXT = ROOT / "clients" / "vscode"


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: the VS Code client tests need Node.js 20+ and npm")
    return path


@pytest.fixture(scope="module")
def node_modules() -> Path:
    tool("node")
    if not (EXT / "node_modules" / ".bin" / "tsc").exists():
        proc = subprocess.run([tool("npm"), "ci", "--no-audit", "--no-fund"], cwd=EXT, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, f"npm ci failed:\n{proc.stdout}\n{proc.stderr}"
    return EXT / "node_modules"


def tsc(node_modules: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(node_modules / ".bin" / "tsc"), "-p", str(EXT), *args], cwd=EXT,
                          capture_output=True, text=True, timeout=300)


def test_extension_type_checks_against_the_vscode_api(node_modules):
    proc = tsc(node_modules, "--noEmit")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_manifest_declares_the_commands_and_settings():
    manifest = json.loads((EXT / "package.json").read_text())
    commands = {c["command"] for c in manifest["contributes"]["commands"]}
    assert {"warmspec.ask", "warmspec.status"} <= commands
    settings = manifest["contributes"]["configuration"]["properties"]
    assert settings["warmspec.server.command"]["default"] == "warmspec"
    assert settings["warmspec.server.args"]["default"] == ["lsp"]
    assert manifest["main"] == "./out/src/extension.js"
    assert (EXT / "package-lock.json").exists()


def test_session_against_a_real_server(node_modules, tmp_path):
    proc = tsc(node_modules)  # emits out/ (ignored by git), which the test runner loads
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env = dict(os.environ,
               WARMSPEC_TEST_CMD=json.dumps([sys.executable, "-m", "warmspec", "lsp", "--workspace", str(tmp_path)]),
               WARMSPEC_TEST_WORKSPACE=str(tmp_path),
               WARMSPEC_RUNTIME_DIR=str(tmp_path / "rt"))  # the daemon `warmspec lsp` starts is the test's own
    try:
        proc = subprocess.run([tool("node"), "--test", "--test-reporter=tap", "out/test/"], cwd=EXT, env=env,
                              capture_output=True, text=True, timeout=300)
    finally:  # it outlives the session
        subprocess.run([sys.executable, "-m", "warmspec", "stop"], env=env, capture_output=True, timeout=60)
    out = proc.stdout + proc.stderr
    counts = dict(re.findall(r"^# (pass|fail) (\d+)$", out, re.M))
    assert proc.returncode == 0 and counts.get("fail") == "0", out[-6000:]
    assert int(counts["pass"]) >= 11, out[-3000:]
