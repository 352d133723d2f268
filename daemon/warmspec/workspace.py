"""Workspace: which files the agent or editor has read, kept tokenized as n-gram sources.

An agent editing a file copies most of the file it just read; the drafter finds those tokens here.
A file enters the index when a client reports reading it (``warmspec/didRead``, ``didOpen`` /
``didChange``, ``ask -f``, file contents seen in a chat's tool results). Paths must resolve inside
a workspace root (symlinks included); binary files, files over ``max_file_bytes`` and ``.gitignore``d
paths are refused (``Workspace.ignored`` says how git's rules are read). Indexes are dropped
least-recently-read first beyond ``budget_bytes``.

Roots are the daemon's ``--workspace`` directories, plus the projects editors name when they connect
over the socket or stdio (``add_root``). A watcher (watchdog) keeps read files current when they
change on disk -- unless the editor has the file open, whose buffer wins.

Open documents are counted per owner (an editor connection's name): two editors may have the same
file open, the newest text of either is the one indexed, one editor's close leaves the other's
buffer open, and ``release`` closes everything an owner had open when its connection ends. How
many documents may be open is bounded where the buffers are stored, per connection (rpc.py).

Indexes are published immutable: ``sources()`` hands them to the engine thread, whose drafter
reads them for a whole request without a lock, so once handed out an index never changes. A
changed file is re-tokenized and ``NgramIndex.derive`` builds its successor, sharing the key table
up to the first changed token; the entry's reference is swapped under the lock (copy-on-write).
Measured on this CPU (SmolLM2's tokenizer, best of 3, index work only): a one-line edit in the
middle of a 4 KB file (1.6k tokens) re-indexes in ~1 ms, as before; in a 1 MB file (500k tokens)
an edit near its end takes 11 ms (53 ms before, in place and racing the drafter: the old
common-prefix scan ran in Python), in the middle 390 ms (520 ms), near its start 1.0 s (0.9 s).
Tokenizing that 1 MB file takes ~2.5 s, more than any of them.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Iterable
from urllib.parse import unquote, urlparse

from .core import DEFAULT_MIN_N, NgramIndex, Source
from .tokenizer import Tokenizer

log = logging.getLogger("warmspec.workspace")

MAX_FILE_BYTES = 1 << 20
DEFAULT_BUDGET_BYTES = 256 << 20

# Source priorities: the request's own tokens rank above all of these (see drafting.py).
PRIORITY_CONVERSATION = 3  # read in this conversation
PRIORITY_OPEN = 2  # open in the editor
PRIORITY_READ = 1  # read earlier, by anyone


class WorkspaceError(ValueError):
    """A path the daemon refuses: outside the roots, ignored, missing, binary or too large."""


class UnreadableFile(WorkspaceError):
    """A file that is there but cannot be read (permissions, I/O errors): worth a warning, where
    the other refusals are routine. Never fatal to the request or thread that met it -- a chat
    naming it in a tool call (agents resend every turn) or the watcher's thread."""


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


class _Entry:
    """One indexed file. ``index`` is replaced, never changed (see the module docstring); the
    other fields change under ``Workspace._lock``."""

    def __init__(self, path: Path, index: NgramIndex, conversations: set[str]):
        self.mtime = _mtime(path)
        self.path = path
        self.index = index
        self.conversations = conversations
        self.last_read = time.monotonic()


def path_from_uri(path_or_uri: str) -> str:
    if path_or_uri.startswith("file:"):
        return unquote(urlparse(path_or_uri).path)
    return path_or_uri


def _gitignore_patterns(f: Path) -> list[str]:
    try:
        text = f.read_text(errors="replace")
    except OSError as e:  # fail closed: what it would ignore might be secret
        raise UnreadableFile(f"{f} cannot be read ({e.strerror}): paths under it are refused") from None
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "!")):
            out.append(line)
    return out


def _ignored(rel: str, patterns: Iterable[str]) -> bool:
    parts = rel.split("/")
    for pat in patterns:
        anchored = pat.startswith("/")
        pat = pat.strip("/")
        if anchored:
            if fnmatch.fnmatch(rel, pat) or any(fnmatch.fnmatch("/".join(parts[: i + 1]), pat)
                                                 for i in range(len(parts))):
                return True
        elif "/" in pat:
            if fnmatch.fnmatch(rel, pat) or fnmatch.fnmatch(rel, pat + "/*") or rel.startswith(pat + "/"):
                return True
        elif any(fnmatch.fnmatch(p, pat) for p in parts):
            return True
    return False


class Workspace:
    def __init__(self, roots: Iterable[Path], tokenizer: Tokenizer, *,
                 budget_bytes: int = DEFAULT_BUDGET_BYTES, max_file_bytes: int = MAX_FILE_BYTES,
                 min_n: int = DEFAULT_MIN_N):
        self.roots = [Path(r).resolve() for r in roots]
        self.tokenizer = tokenizer
        self.budget_bytes = budget_bytes
        self.max_file_bytes = max_file_bytes
        self.min_n = min_n
        self._entries: OrderedDict[Path, _Entry] = OrderedDict()  # least recently read first
        # open editor buffers (may differ from disk): path -> {owner: text}, newest text last
        self._documents: dict[Path, dict[str, str]] = {}
        # directory -> (its .gitignore's stat, patterns): re-read when the file changes
        self._gitignores: dict[Path, tuple[tuple[int, int, int], list[str]]] = {}
        self._lock = threading.RLock()  # the entry table: held for lookups and swaps only
        # Serializes index changes, so each derives from the newest index of its file; held while
        # deriving (never while tokenizing), never by the engine thread.
        self._write_lock = threading.Lock()
        self._watch_lock = threading.Lock()  # the observer, and whether roots should be watched
        self._watching = False
        self._observer = None
        self.reindexed = 0  # files re-indexed after a change on disk (for status and tests)

    # -- paths ------------------------------------------------------------------------------------

    def add_root(self, path_or_uri: str | Path) -> bool:
        """Add a root while running: an editor's project, named when it connects. Its .gitignore
        applies and, once the workspace is watched, so does the watcher. False when a root already
        covers it. The home directory and the directories above it (``/`` included) are refused:
        every file of the user would become readable for drafting, and the watcher would walk all
        of it."""
        raw = path_from_uri(str(path_or_uri))
        if not raw or "\x00" in raw or not Path(raw).is_absolute():
            raise WorkspaceError(f"workspace root {raw!r} is not an absolute path")
        real = Path(os.path.realpath(raw))
        if not real.is_dir():
            raise WorkspaceError(f"workspace root {raw} is not a directory")
        home = Path(os.path.realpath(Path.home()))
        if real == home or real in home.parents or real == Path(real.anchor):
            raise WorkspaceError(f"{real} is refused as a workspace root: it is the home directory "
                                 "or above it")
        with self._lock:
            if any(real == r or r in real.parents for r in self.roots):
                return False
            self.roots = [*self.roots, real]  # a new list: resolve() reads it without the lock
        log.info("workspace: added root %s", real)
        with self._watch_lock:
            if self._watching:
                try:
                    self._schedule(real)
                except OSError as e:  # e.g. the user's inotify watches are used up
                    log.warning("workspace: cannot watch %s (%s): files read under it are not "
                                "re-indexed when they change on disk", real, e)
        return True

    def resolve(self, path_or_uri: str) -> Path:
        """The real path of a file inside a root; ``WorkspaceError`` otherwise."""
        raw = path_from_uri(path_or_uri)
        if not raw or "\x00" in raw:
            raise WorkspaceError("empty or invalid path")
        p = Path(raw)
        if not p.is_absolute():
            if len(self.roots) != 1:
                raise WorkspaceError(f"relative path {raw!r} needs exactly one workspace root")
            p = self.roots[0] / p
        real = Path(os.path.realpath(p))
        for root in self.roots:
            if real == root or root in real.parents:
                if self.ignored(root, real):
                    raise WorkspaceError(f"{raw} is ignored (.gitignore)")
                return real
        raise WorkspaceError(f"{raw} is outside the workspace roots")

    def ignored(self, root: Path, real: Path) -> bool:
        """Whether git would ignore ``real`` (a path under ``root``): anything in ``.git``, and the
        patterns of every ``.gitignore`` from the root down to the file's directory, each relative
        to the directory it is in, as git reads them (a slash at the start or in the middle
        anchors a pattern there; one without matches a name at any depth below). Not supported:
        negation (``!`` lines are skipped, so what they would re-include stays ignored -- the
        safe side), telling ``dir/`` from a file of that name, ``.git/info/exclude`` and the
        global excludes file."""
        parts = real.relative_to(root).parts
        if ".git" in parts:
            return True
        for i in range(len(parts)):  # the root, then each directory down to the file's
            directory = root.joinpath(*parts[:i])
            if _ignored("/".join(parts[i:]), self._gitignore(directory)):
                return True
        return False

    def _gitignore(self, directory: Path) -> list[str]:
        """The patterns of ``directory/.gitignore`` (none if there is none), cached until the file
        changes (its mtime, size or inode)."""
        f = directory / ".gitignore"
        try:
            st = f.stat()
        except (FileNotFoundError, NotADirectoryError):  # e.g. a directory not yet created
            return []
        except OSError as e:
            raise UnreadableFile(f"{f}: {e.strerror}: paths under it are refused") from None
        if not f.is_file():
            return []
        key = (st.st_mtime_ns, st.st_size, st.st_ino)
        with self._lock:
            cached = self._gitignores.get(directory)
        if cached is not None and cached[0] == key:
            return cached[1]
        patterns = _gitignore_patterns(f)
        with self._lock:
            self._gitignores[directory] = (key, patterns)
        return patterns

    # -- reads and documents ----------------------------------------------------------------------

    def did_read(self, path_or_uri: str, text: str | None = None, conversation: str | None = None) -> Path:
        """Record that a client read a file (its text given, or read from disk) and index it."""
        path = self.resolve(path_or_uri)
        if text is None:
            with self._lock:
                entry = self._entries.get(path)
                if entry is not None and entry.mtime == _mtime(path):
                    # unchanged since indexed (agents resend every tool call each turn)
                    self._entries.move_to_end(path)
                    entry.last_read = time.monotonic()
                    if conversation:
                        entry.conversations.add(conversation)
                    return path
            text = self._read_disk(path)
        self._index(path, text, conversation=conversation)
        return path

    def did_open(self, uri: str, text: str, owner: str = "") -> Path:
        """An editor (``owner``) opened or changed a buffer: its text becomes the file's drafting
        text, and the watcher leaves the file alone while any owner has it open. A buffer over
        ``max_file_bytes`` is refused before anything is stored."""
        path = self.resolve(uri)
        self._check_size(path, text)
        with self._lock:
            texts = self._documents.setdefault(path, {})
            texts.pop(owner, None)
            texts[owner] = text  # the newest last
        self._index(path, text)
        return path

    def did_change(self, uri: str, text: str, owner: str = "") -> Path:
        return self.did_open(uri, text, owner)

    def did_close(self, uri: str, owner: str = "") -> None:
        self._close(self.resolve(uri), owner)

    def release(self, owner: str) -> int:
        """Close every document ``owner`` has open (its connection ended); how many."""
        with self._lock:
            paths = [p for p, texts in self._documents.items() if owner in texts]
        for path in paths:
            self._close(path, owner)
        return len(paths)

    def _close(self, path: Path, owner: str) -> None:
        with self._lock:
            texts = self._documents.get(path)
            if texts is None or owner not in texts:
                return
            was_newest = next(reversed(texts)) == owner
            del texts[owner]
            if not texts:
                del self._documents[path]
                return
            if not was_newest:
                return
            text = next(reversed(texts.values()))
        self._index(path, text)  # another editor's buffer, now the newest open text

    def document_text(self, uri: str) -> str | None:
        """The newest open editor buffer for ``uri``, else None."""
        with self._lock:
            texts = self._documents.get(self.resolve(uri))
            return next(reversed(texts.values())) if texts else None

    def _read_disk(self, path: Path) -> str:
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise WorkspaceError(f"{path}: no such file") from None
        except OSError as e:
            raise UnreadableFile(f"{path}: {e.strerror}") from None
        if not path.is_file():
            raise WorkspaceError(f"{path} is not a file")
        if size > self.max_file_bytes:
            raise WorkspaceError(f"{path} is larger than {self.max_file_bytes} bytes")
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise WorkspaceError(f"{path}: no such file") from None
        except OSError as e:  # e.g. no permission, or replaced by a directory since the stat
            raise UnreadableFile(f"{path} cannot be read: {e.strerror}") from None
        if b"\x00" in data[:8192]:
            raise WorkspaceError(f"{path} is binary")
        return data.decode("utf-8", errors="replace")

    def _check_size(self, path: Path, text: str) -> None:
        if len(text.encode("utf-8", errors="replace")) > self.max_file_bytes:
            raise WorkspaceError(f"{path} is larger than {self.max_file_bytes} bytes")

    def _index(self, path: Path, text: str, *, conversation: str | None = None) -> None:
        self._check_size(path, text)
        tokens = self.tokenizer.encode(text)
        with self._write_lock:
            with self._lock:
                entry = self._entries.get(path)
            index = (entry.index.derive(tokens) if entry is not None
                     else NgramIndex(tokens, name=str(path), min_n=self.min_n))
            with self._lock:
                entry = self._entries.pop(path, None)
                if entry is None:
                    entry = _Entry(path, index, set())
                entry.index = index
                entry.last_read = time.monotonic()
                entry.mtime = _mtime(path)
                if conversation:
                    entry.conversations.add(conversation)
                self._entries[path] = entry  # most recently read last
                self._evict()

    def _evict(self) -> None:
        total = sum(e.index.nbytes for e in self._entries.values())
        while total > self.budget_bytes and len(self._entries) > 1:
            _, e = self._entries.popitem(last=False)
            total -= e.index.nbytes
            log.info("workspace: dropped %s from the index (budget %d bytes)", e.path, self.budget_bytes)

    # -- watching the disk -------------------------------------------------------------------------

    def watch(self) -> None:
        """Watch the roots, and those added later; read files changed on disk are re-indexed."""
        with self._watch_lock:
            self._watching = True
            for root in self.roots:
                self._schedule(root)

    def _schedule(self, root: Path) -> None:
        """Watch ``root`` (the observer thread starts with the first root). Under ``_watch_lock``."""
        from watchdog.events import FileSystemEventHandler
        from watchdog.observers import Observer

        ws = self

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event):
                if event.is_directory:
                    return
                for raw in (event.src_path, getattr(event, "dest_path", "")):
                    if raw:
                        ws.on_disk_change(Path(os.fsdecode(raw)))

        if self._observer is None:
            self._observer = Observer()
            self._observer.daemon = True
            self._observer.start()
        self._observer.schedule(Handler(), str(root), recursive=True)

    def stop(self) -> None:
        with self._watch_lock:
            self._watching = False
            observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()
            observer.join(timeout=5)

    def on_disk_change(self, path: Path) -> None:
        """Re-index ``path`` if it was read and is not open in the editor; drop it if gone."""
        real = Path(os.path.realpath(path))
        with self._lock:
            if real not in self._entries or real in self._documents:
                return
        try:
            text = self._read_disk(real)
        except WorkspaceError as e:  # on the watcher's thread: it must live on
            with self._lock:
                self._entries.pop(real, None)
            log.log(logging.WARNING if isinstance(e, UnreadableFile) else logging.INFO,
                    "workspace: dropped %s from the index: %s", real, e)
            return
        tokens = self.tokenizer.encode(text)
        with self._write_lock:
            with self._lock:
                entry = self._entries.get(real)
            if entry is None or entry.index.tokens == tokens:
                return
            index = entry.index.derive(tokens)
            with self._lock:
                if self._entries.get(real) is entry and real not in self._documents:
                    entry.index = index
                    entry.mtime = _mtime(real)
                    self.reindexed += 1

    # -- drafting -----------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.index.nbytes for e in self._entries.values())

    @property
    def files(self) -> list[Path]:
        with self._lock:
            return list(self._entries)

    def sources(self, conversation: str | None = None) -> list[Source]:
        """Indexes to draft from, each with its priority for this conversation. They never change
        (a change to a file replaces its index), so the caller reads them without a lock."""
        out = []
        with self._lock:
            for e in self._entries.values():
                if conversation and conversation in e.conversations:
                    priority = PRIORITY_CONVERSATION
                elif e.path in self._documents:
                    priority = PRIORITY_OPEN
                else:
                    priority = PRIORITY_READ
                out.append((e.index, priority))
        return out
