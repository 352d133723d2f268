"""Workspace read-tracking on a temporary directory: indexing, live updates, ignore rules,
symlink escapes, memory budget, and drafting from a read file."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

from warmspec.core.ngram import NgramDrafter, NgramIndex
from warmspec.workspace import Workspace, WorkspaceError

from tiny import byte_tokenizer


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "repo"
    (root / "src").mkdir(parents=True)
    (root / "build").mkdir()
    (root / "src" / "app.py").write_text("def main():\n    print('hello world')\n")
    (root / "src" / "util.py").write_text("def helper(x):\n    return x * 2\n")
    (root / "build" / "out.py").write_text("generated = True\n")
    (root / "notes.log").write_text("log line\n")
    (root / ".gitignore").write_text("build/\n*.log\n")
    (root / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    outside = tmp_path / "secret.txt"
    outside.write_text("top secret\n")
    (root / "escape.txt").symlink_to(outside)
    return root


def make(root, **kw):
    return Workspace([root], byte_tokenizer(), **kw)


def tokens_of(text):
    return list(text.encode())


def test_read_tracking_and_priorities(tree):
    ws = make(tree)
    ws.did_read("src/app.py", conversation="conv-1")
    ws.did_read(str(tree / "src" / "util.py"))
    ws.did_open((tree / "src" / "new.py").as_uri(), "class Fresh:\n    pass\n")
    assert [p.name for p in ws.files] == ["app.py", "util.py", "new.py"]
    prio = {idx.name.rsplit("/", 1)[-1]: p for idx, p in ws.sources("conv-1")}
    assert prio["app.py"] > prio["new.py"] > prio["util.py"]
    assert ws.document_text((tree / "src" / "new.py").as_uri()).startswith("class Fresh")


@pytest.mark.parametrize("path, reason", [
    ("build/out.py", "ignored"),
    ("notes.log", "ignored"),
    ("blob.bin", "binary"),
    ("escape.txt", "outside"),
    ("../secret.txt", "outside"),
    ("/etc/passwd", "outside"),
    (".git/config", "ignored"),
])
def test_refused_paths(tree, path, reason):
    ws = make(tree)
    with pytest.raises(WorkspaceError, match=reason):
        ws.did_read(path)
    assert not ws.files


def test_nested_gitignore_files_apply_below_their_directory(tree):
    """Each .gitignore's patterns are relative to its own directory, as git reads them: unanchored
    ones match at any depth below it, anchored ones (a leading or inner slash) only there, and
    nothing outside it. A change to one applies to the next path resolved."""
    src = tree / "src"
    (src / ".gitignore").write_text("# generated code\ngenerated/\nsecret_*.py\n/local.py\ncache/*.py\n"
                                    "!keep.py\n")
    files = ["src/generated/x.py", "src/secret_key.py", "src/sub/secret_b.py", "src/local.py",
             "src/cache/c.py", "src/sub/local.py", "src/sub/cache/c.py", "other/secret_key.py",
             "other/local.py", "src/keep.py"]
    for rel in files:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(f"# {rel}\n")
    ws = make(tree)
    refused = []
    for rel in files:
        try:
            ws.did_read(rel)
        except WorkspaceError as e:
            assert "ignored" in str(e)
            refused.append(rel)
    assert refused == ["src/generated/x.py", "src/secret_key.py", "src/sub/secret_b.py", "src/local.py",
                       "src/cache/c.py"]
    with pytest.raises(WorkspaceError, match="ignored"):
        ws.did_read("build/out.py")  # the root's still applies
    (src / "sub" / ".gitignore").write_text("*.py\n")
    with pytest.raises(WorkspaceError, match="ignored"):
        ws.did_read("src/sub/local.py")
    (src / ".gitignore").write_text("keep.py\n")  # changed: the old patterns are gone
    ws.did_read("src/secret_key.py")
    with pytest.raises(WorkspaceError, match="ignored"):
        ws.did_read("src/keep.py")


def test_size_limit(tree):
    ws = make(tree, max_file_bytes=10)
    with pytest.raises(WorkspaceError, match="larger"):
        ws.did_read("src/app.py")


def test_memory_budget_drops_least_recently_read(tree):
    for i in range(6):
        (tree / "src" / f"m{i}.py").write_text(f"# module {i}\n" + "x = 1\n" * 200)
    one = NgramIndex(tokens_of((tree / "src" / "m0.py").read_text())).nbytes
    ws = make(tree, budget_bytes=int(one * 3.5))
    for i in range(6):
        ws.did_read(f"src/m{i}.py")
    assert [p.name for p in ws.files] == ["m3.py", "m4.py", "m5.py"]
    assert ws.nbytes <= ws.budget_bytes
    ws.did_read("src/m3.py")  # reading again makes it the most recent
    ws.did_read("src/m0.py")
    assert [p.name for p in ws.files] == ["m5.py", "m3.py", "m0.py"]


def test_live_update_on_disk_change(tree):
    ws = make(tree)
    ws.did_read("src/util.py")
    ws.watch()
    try:
        new = "def helper(x):\n    return x * 3  # tripled\n"
        (tree / "src" / "util.py").write_text(new)
        # a write may show up as several events (truncate, then data): wait for the last state
        deadline = time.time() + 10
        while bytes(ws.sources()[0][0].tokens).decode() != new and time.time() < deadline:
            time.sleep(0.05)
        assert bytes(ws.sources()[0][0].tokens).decode() == new
        assert ws.reindexed >= 1
    finally:
        ws.stop()


def unreadable(monkeypatch, path: Path) -> None:
    """Make reading ``path`` fail as a file without read permission does. Tests run as root here,
    which reads a chmod 000 file anyway, so ``Path.read_bytes`` is patched to raise the
    PermissionError an ordinary user gets."""
    real_read, locked = Path.read_bytes, path.resolve()

    def read_bytes(self):
        if self == locked:
            raise PermissionError(13, "Permission denied", str(self))
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)


def test_the_watcher_survives_an_unreadable_file(tree, monkeypatch, caplog):
    """An unreadable read file, changed on disk, is dropped with a warning; the watcher's thread
    lives on and re-indexes the next change (before, the error killed it, silently)."""
    ws = make(tree)
    ws.did_read("src/app.py")
    ws.did_read("src/util.py")
    unreadable(monkeypatch, tree / "src" / "app.py")
    ws.watch()
    try:
        (tree / "src" / "app.py").write_text("def main():\n    pass\n")
        new = "def helper(x):\n    return x * 5\n"
        (tree / "src" / "util.py").write_text(new)

        def util_text():
            return next(bytes(i.tokens).decode() for i, _ in ws.sources() if i.name.endswith("util.py"))

        deadline = time.time() + 15
        while util_text() != new and time.time() < deadline:
            time.sleep(0.05)
        assert util_text() == new
        assert (tree / "src" / "app.py").resolve() not in ws.files
        assert any(r.levelname == "WARNING" and "app.py cannot be read" in r.getMessage()
                   for r in caplog.records)
    finally:
        ws.stop()


def test_add_root_while_watching(tree):
    """A root added at runtime (an editor's project) has its .gitignore and is watched."""
    other = tree.parent / "elsewhere"
    other.mkdir()
    ws = make(other)
    ws.watch()
    try:
        with pytest.raises(WorkspaceError, match="outside"):
            ws.did_read(str(tree / "src" / "util.py"))
        assert ws.add_root(tree.as_uri()) is True
        assert tree in ws.roots
        with pytest.raises(WorkspaceError, match="ignored"):
            ws.did_read(str(tree / "build" / "out.py"))
        ws.did_read(str(tree / "src" / "util.py"))
        assert ws.add_root(tree) is False  # already there
        assert ws.add_root(tree / "src") is False  # covered
        new = "def helper(x):\n    return x * 4\n"
        (tree / "src" / "util.py").write_text(new)
        deadline = time.time() + 10
        while bytes(ws.sources()[0][0].tokens).decode() != new and time.time() < deadline:
            time.sleep(0.05)
        assert bytes(ws.sources()[0][0].tokens).decode() == new
    finally:
        ws.stop()


def test_add_root_refuses_home_and_above(tree, tmp_path):
    ws = make(tree)
    home = Path.home()
    (tmp_path / "to-home").symlink_to(home)
    for path in (home, tmp_path / "to-home", Path("/")) + tuple(home.parents):
        with pytest.raises(WorkspaceError, match="home directory"):
            ws.add_root(path)
    for path, reason in (("relative/dir", "absolute"), (tmp_path / "missing", "not a directory"),
                         (tree / "notes.log", "not a directory")):
        with pytest.raises(WorkspaceError, match=reason):
            ws.add_root(path)
    assert ws.roots == [tree]


def test_open_buffer_wins_over_disk(tree):
    ws = make(tree)
    uri = (tree / "src" / "app.py").as_uri()
    ws.did_open(uri, "edited in the editor\n")
    ws.on_disk_change(tree / "src" / "app.py")
    assert bytes(ws.sources()[0][0].tokens).decode() == "edited in the editor\n"


def table(index: NgramIndex) -> dict:
    return {k: list(v) for k, v in index.ends.items()}


def test_derived_index_matches_fresh_index_and_leaves_the_old_one_alone():
    a = tokens_of("def f(x):\n    return x + 1\n\ndef g(y):\n    return y * 2\n" * 3)
    b = a[:50] + tokens_of("# changed\n") + a[50:]
    idx = NgramIndex(a)
    before = table(idx)
    derived = idx.derive(b)
    fresh = NgramIndex(b)
    assert derived.tokens == fresh.tokens
    assert table(derived) == table(fresh)
    assert idx.tokens == a and table(idx) == before
    assert idx.derive(list(a)) is idx  # nothing changed: nothing built
    shorter = derived.derive(b[:40])  # cut back before the earlier change, then grown again
    assert table(shorter.derive(a)) == table(idx)

    rng = random.Random(0)  # random edits: each derived index equals a fresh one
    tokens = [rng.randrange(256) for _ in range(2000)]
    current = NgramIndex(tokens)
    for _ in range(50):
        at, cut = rng.randrange(len(tokens)), rng.randrange(20)
        tokens = tokens[:at] + [rng.randrange(256) for _ in range(rng.randrange(20))] + tokens[at + cut:]
        current = current.derive(tokens)
        assert table(current) == table(NgramIndex(tokens))


def test_editing_an_open_document_while_drafting_from_it(tree):
    """Typing into an open buffer (didChange, on the indexer thread) while a request drafts from
    it (on the engine thread) must not disturb the drafter: published indexes never change.
    Before copy-on-write the drafter met ``deque mutated during iteration`` and IndexError (83
    errors in these 300 changes)."""
    ws = make(tree)
    body = "".join(f"    value_{i} = compute(value_{i - 1}, {i})\n" for i in range(100))
    texts = ["def a():\n" + body, "def b():\n" + body.replace("compute", "combine")]
    uri = (tree / "src" / "typed.py").as_uri()
    ws.did_open(uri, texts[0])
    context = tokens_of(texts[0][:200])
    done = threading.Event()
    errors: list[BaseException] = []

    def type_away():
        try:
            for i in range(300):
                ws.did_change(uri, texts[i % 2])
        finally:
            done.set()

    writer = threading.Thread(target=type_away)
    writer.start()
    drafted = 0
    while not done.is_set():
        try:
            drafter = NgramDrafter(context, ws.sources())
            for _ in range(20):
                if proposal := drafter.propose(8):
                    drafter.commit(proposal.tokens[:1])
                    drafted += 1
        except Exception as e:  # counted, and the test fails below
            errors.append(e)
    writer.join()
    assert drafted and not errors, f"{len(errors)} errors, first: {errors[:1]!r}"
    assert bytes(ws.sources()[0][0].tokens).decode() == texts[299 % 2]


def test_drafter_finds_the_read_file_among_many(tree):
    """The file being copied wins over files sharing its short n-grams."""
    target = "def compute(a, b):\n    total = a + b\n    return total * scale(a)\n"
    decoys = ["def other(a, b):\n    total = 0\n", "    total = a - b\n    return total\n"]
    sources = [(NgramIndex(tokens_of(d), name=f"decoy{i}"), 1) for i, d in enumerate(decoys)]
    sources.append((NgramIndex(tokens_of(target), name="target"), 1))
    context = tokens_of("Here is the new version:\ndef compute(a, b):\n    total = a ")
    drafter = NgramDrafter(context, sources)
    proposal = drafter.propose(12)
    assert proposal.source == "workspace" and drafter.follow.src.name == "target"
    assert bytes(proposal.tokens).decode() == "+ b\n    retu"  # 12 byte tokens


def test_tool_calls_index_the_files_they_read(tree):
    """An agent's read_file tool call marks the file as read in that conversation."""
    import msgspec
    import tiny
    from warmspec.core.engine import Engine
    from warmspec_protocol import Message
    from warmspec.core.gate import CostTable
    from warmspec.server.app import App

    lm = tiny.build("llama")
    app = App(lm, Engine(lm, costs=CostTable({0: {1: 1.0}})), workspace_roots=[tree])
    messages = msgspec.convert([
        {"role": "user", "content": "Double the helper."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "read_file", "arguments": '{"path": "src/util.py"}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "read_file", "arguments": {"file_path": "../secret.txt"}}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "1: def helper(x):\n2:     return x * 2\n"},
    ], list[Message])
    conv = app.conversation_of(messages)
    assert conv == app.conversation_of(messages + [Message(role="user", content="more")])
    assert app.note_tool_reads(messages, conv) == 1  # the escaping path is refused
    assert [p.name for p in app.workspace.files] == ["util.py"]
    (index, priority), = app.workspace.sources(conv)
    assert bytes(index.tokens).decode() == (tree / "src" / "util.py").read_text()  # from disk
    assert priority == max(p for _, p in app.workspace.sources(conv))


@pytest.mark.parametrize("shape", ["unique", "repeated", "zipf"])
def test_index_size_estimate_is_what_the_index_holds(shape):
    """The workspace budget is enforced with ``NgramIndex.nbytes``: it must be near what the index
    really allocates (tracemalloc), not a seventh of it as it was with a deque per key."""
    import tracemalloc

    import numpy as np

    rng = np.random.default_rng(0)
    toks = {"unique": lambda: rng.integers(0, 49152, 20000),
            "repeated": lambda: np.tile(rng.integers(0, 49152, 4000), 5),
            "zipf": lambda: rng.zipf(1.3, 20000).clip(0, 49151)}[shape]()
    toks = [int(str(t)) for t in toks.tolist()]  # fresh ints, as a tokenizer returns them
    tracemalloc.start()
    try:
        index = NgramIndex(toks)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert 0.8 * held <= index.nbytes <= 1.6 * held, (index.nbytes, held)
