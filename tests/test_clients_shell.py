"""The shell client (clients/shell): bash completion read from the installed warmspec's --help,
and warmspec-edit.

The completion runs in a real bash against the real ``warmspec`` and is compared with the CLI's
argparse parser, so it is checked to follow the CLI as options are added. warmspec-edit runs with
``$WARMSPEC`` naming a stand-in that records its arguments and prints a fixed answer (the model's
answers are not predictable enough to test an edit with); the recorded arguments are then parsed
by the real ``warmspec ask`` parser.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from warmspec.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
SHELL = ROOT / "clients" / "shell"
EDIT = SHELL / "warmspec-edit"


def env_with_warmspec() -> dict:
    """PATH with the directory of this Python's ``warmspec`` script first."""
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")


def complete(line: str, cwd: Path) -> list[str]:
    """COMPREPLY for ``line`` (the cursor at its end), from the completion script in bash."""
    words = shlex.split(line) + ([""] if line.endswith(" ") else [])
    func = "_warmspec_edit" if words[0] == "warmspec-edit" else "_warmspec"
    script = (f"source {shlex.quote(str(SHELL / 'warmspec.bash'))}\n"
              f"COMP_WORDS=({' '.join(shlex.quote(w) for w in words)}); COMP_CWORD={len(words) - 1}\n"
              f"{func}\nprintf '%s\\n' \"${{COMPREPLY[@]}}\"\n")
    proc = subprocess.run(["bash", "--norc", "--noprofile", "-c", script], cwd=cwd, env=env_with_warmspec(),
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return sorted(w for w in proc.stdout.split("\n") if w)


def parser_options(command: str | None) -> set[str]:
    parser = build_parser()
    if command is not None:
        parser = parser._subparsers._group_actions[0].choices[command]
    return {o for action in parser._actions for o in action.option_strings}


def test_completes_the_subcommands(tmp_path):
    choices = build_parser()._subparsers._group_actions[0].choices
    assert complete("warmspec ", tmp_path) == sorted(choices)
    assert complete("warmspec -v s", tmp_path) == sorted(c for c in choices if c.startswith("s"))
    assert complete("warmspec -", tmp_path) == sorted(parser_options(None))


@pytest.mark.parametrize("command", sorted(build_parser()._subparsers._group_actions[0].choices))
def test_completes_every_option_of_every_subcommand(command, tmp_path):
    assert complete(f"warmspec {command} -", tmp_path) == sorted(parser_options(command))


def test_completes_option_values(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    assert complete("warmspec ask -f no", tmp_path) == ["notes.txt"]
    assert complete("warmspec serve --workspace ", tmp_path) == ["src"]  # directories only
    assert complete("warmspec ask --max-tokens ", tmp_path) == []  # a number: nothing to offer
    assert complete("warmspec-edit no", tmp_path) == ["notes.txt"]
    assert complete("warmspec-edit notes.txt 'fix it' -- --so", tmp_path) == ["--socket"]
    assert complete("warmspec-edit notes.txt 'fix it' -- --wr", tmp_path) == ["--write"]  # edit's options


STUB = """#!/usr/bin/env bash
# Stands in for warmspec: records its arguments, prints $STUB_ANSWER as the new file, exits $STUB_RC.
printf '%s\\0' "$@" > "$STUB_ARGS"
printf '%s' "$STUB_ANSWER"
exit "${STUB_RC:-0}"
"""

ORIGINAL = "def add(a, b):\n    return a + b\n"
RENAMED = "def plus(a, b):\n    return a + b\n"


def run_edit(tmp_path: Path, answer: str, *args: str, rc: int = 0) -> tuple[subprocess.CompletedProcess, list[str]]:
    stub = tmp_path / "warmspec-stub"
    stub.write_text(STUB)
    stub.chmod(0o755)
    env = dict(os.environ, WARMSPEC=str(stub), STUB_ANSWER=answer, STUB_ARGS=str(tmp_path / "args"),
               STUB_RC=str(rc))
    proc = subprocess.run([str(EDIT), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
    recorded = (tmp_path / "args").read_text().split("\0")[:-1] if (tmp_path / "args").exists() else []
    return proc, recorded


@pytest.fixture
def source(tmp_path) -> Path:
    path = tmp_path / "m.py"
    path.write_text(ORIGINAL)
    return path


def test_edit_shows_the_change_as_a_diff(tmp_path, source):
    proc, argv = run_edit(tmp_path, RENAMED, "m.py", "rename add to plus", "--", "--temp", "0")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[:2] == ["--- a/m.py", "+++ b/m.py"]
    assert "-def add(a, b):" in proc.stdout and "+def plus(a, b):" in proc.stdout
    assert source.read_text() == ORIGINAL  # not written without -w
    # What reached `warmspec edit` is a valid command line for it, with the file and the options
    # (the file and the instruction after "--": a name or an instruction may start with "-").
    assert argv[0] == "edit" and argv[-3] == "--"
    args = build_parser().parse_args(argv)
    assert args.file == Path("m.py") and args.instruction == "rename add to plus" and args.temp == 0.0
    assert not args.write  # warmspec-edit writes itself, after the diff


def test_edit_write_keeps_the_original(tmp_path, source):
    proc, _ = run_edit(tmp_path, RENAMED, "-w", "m.py", "rename add to plus")
    assert proc.returncode == 0, proc.stderr
    assert source.read_text() == RENAMED
    assert (tmp_path / "m.py.orig").read_text() == ORIGINAL
    assert "wrote m.py" in proc.stderr


def test_edit_without_a_code_block_or_a_change(tmp_path, source):
    proc, _ = run_edit(tmp_path, "", "-w", "m.py", "do something", rc=1)  # warmspec edit found no block
    assert proc.returncode == 1 and proc.stdout == ""
    proc, _ = run_edit(tmp_path, "", "-w", "m.py", "do nothing", rc=3)  # warmspec edit: no change
    assert proc.returncode == 3
    proc, _ = run_edit(tmp_path, ORIGINAL, "-w", "m.py", "do nothing")
    assert proc.returncode == 3 and "changed nothing" in proc.stderr
    assert source.read_text() == ORIGINAL and not (tmp_path / "m.py.orig").exists()


def test_edit_usage_errors(tmp_path):
    proc, argv = run_edit(tmp_path, "", "missing.py", "x")
    assert proc.returncode == 1 and "no such file" in proc.stderr and argv == []
    proc, _ = run_edit(tmp_path, "", "only-one-argument")
    assert proc.returncode == 2 and proc.stderr.startswith("usage: warmspec-edit")
    proc = subprocess.run([str(EDIT), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: warmspec-edit")


def test_edit_passes_the_instruction_as_one_argument(tmp_path, source):
    """Quotes, newlines, $ and backquotes reach warmspec unchanged, never through a shell."""
    instruction = 'say "hi"\nand $HOME `x`'
    _, argv = run_edit(tmp_path, RENAMED, "m.py", instruction)
    assert argv[-2:] == ["m.py", instruction]
