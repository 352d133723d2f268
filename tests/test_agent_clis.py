"""Claude Code and Codex CLI as clients: each runs its agent loop through warmspec's HTTP API.

Opt-in: the two CLIs are npm packages of ~660 MB together, so CI does not install them. Run with

    npm install --prefix .agents @anthropic-ai/claude-code @openai/codex
    WARMSPEC_AGENT_BIN=.agents/node_modules/.bin .venv/bin/python -m pytest tests/test_agent_clis.py

(``claude`` and ``codex`` on PATH serve as well). The default model's chat template has no tools,
so the server holds the default model's tokenizer behind a Hermes-style template and a scripted
engine (``test_http``'s): the first answer is a tool call for the CLI's own file-writing tool, the
answer after its result a sentence. What is tested is the wire: each CLI's real requests (Claude
Code's system turns inside ``messages``, Codex's ``namespace`` tools in the Responses API) are
accepted, the tool call reaches the CLI, it runs the tool, and its result comes back to the model.
Tried with Claude Code 2.1.197 and Codex CLI 0.171.0.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from test_http import HERMES_TEMPLATE, ScriptedEngine, Server, with_template
from warmspec.model import LoadedModel
from warmspec.server.app import App


def cli(name: str) -> str | None:
    where = os.environ.get("WARMSPEC_AGENT_BIN")
    found = shutil.which(name, path=where) if where else shutil.which(name)
    return found


class AgentEngine(ScriptedEngine):
    """Calls the tool until the prompt holds the call's target (the call is then in the history),
    then answers in words."""

    def __init__(self, call: str, target: str, tokenizer) -> None:
        super().__init__()
        self.call, self.target, self.tokenizer = call, target, tokenizer

    def generate(self, prompt, params, **kw):
        self.reply = "I wrote hello.txt." if self.target in self.tokenizer.decode(prompt) else self.call
        yield from super().generate(prompt, params, **kw)


def serve(default_lm, call: str, target: Path) -> tuple[Server, AgentEngine]:
    tok = with_template(default_lm.tokenizer, HERMES_TEMPLATE)
    lm = LoadedModel(model=default_lm.model, tokenizer=tok, name="hermes-scripted", source="test",
                     context_length=32768)
    engine = AgentEngine(call, str(target), tok)
    app = App(lm, engine)
    app.api_key = None
    return Server(app), engine


def quiet_env(tmp_path: Path) -> dict[str, str]:
    home = tmp_path / "home"
    home.mkdir()
    return dict(os.environ, HOME=str(home), DISABLE_TELEMETRY="1", DISABLE_AUTOUPDATER="1",
                CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")


@pytest.mark.skipif(cli("claude") is None, reason="Claude Code not installed (see the module docstring)")
def test_claude_code_writes_a_file_through_the_anthropic_api(default_lm, tmp_path):
    target = tmp_path / "work" / "hello.txt"
    target.parent.mkdir()
    call = ('<tool_call>\n{"name": "Write", "arguments": {"file_path": "%s", "content": "hello from warmspec\\n"}}'
            '\n</tool_call>' % target)
    srv, engine = serve(default_lm, call, target)
    try:
        env = dict(quiet_env(tmp_path), ANTHROPIC_BASE_URL=srv.url, ANTHROPIC_API_KEY="sk-local")
        run = subprocess.run([cli("claude"), "-p", "Write hello.txt", "--model", "hermes-scripted",
                              "--output-format", "json", "--allowedTools", "Write"],
                             cwd=target.parent, env=env, capture_output=True, text=True, timeout=300)
    finally:
        srv.close()
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads(run.stdout)
    assert not result["is_error"] and result["result"] == "I wrote hello.txt."
    assert target.read_text() == "hello from warmspec\n"
    assert len(engine.prompts) == 2  # the call, then the answer after its result


@pytest.mark.skipif(cli("codex") is None, reason="Codex CLI not installed (see the module docstring)")
def test_codex_runs_a_command_through_the_responses_api(default_lm, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    target = work / "hello.txt"
    call = ('<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "echo hello from warmspec > %s"}}'
            '\n</tool_call>' % target)
    srv, engine = serve(default_lm, call, target)
    provider = f'model_providers.ws={{name="warmspec", base_url="{srv.url}/v1", wire_api="responses", ' \
               'env_key="OPENAI_API_KEY"}'
    try:
        run = subprocess.run([cli("codex"), "exec", "--skip-git-repo-check", "-c", 'model_provider="ws"',
                              "-c", provider, "-m", "hermes-scripted",
                              "--dangerously-bypass-approvals-and-sandbox", "Write hello.txt"],
                             cwd=work, env=dict(quiet_env(tmp_path), OPENAI_API_KEY="sk-local"),
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    finally:
        srv.close()
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "I wrote hello.txt." in run.stdout
    assert target.read_text() == "hello from warmspec\n"
    assert len(engine.prompts) == 2
