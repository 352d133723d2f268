"""The daemon process: ``warmspec serve``, ``warmspec lsp --in-process``, ``warmspec stop``, and
starting a daemon in the background for ``warmspec ask`` and ``warmspec lsp`` (see proxy.py).

Its files live in a per-user runtime directory, mode 0700: ``$WARMSPEC_RUNTIME_DIR``, else
``$XDG_RUNTIME_DIR/warmspec``, else ``/tmp/warmspec-$UID``. Next to the socket ``warmspec.sock``
(mode 0600) are ``warmspec.pid`` -- flock()ed by the live daemon for its whole life, so whether a
daemon runs is never guessed from a stale pid -- and ``warmspec.log``, a background daemon's
output. ``--socket PATH`` moves all three (``PATH`` with suffixes ``.pid`` and ``.log``).

Ports: the Unix socket always serves JSON-RPC; ``--rpc-port`` adds JSON-RPC over TCP (the same
protocol, for clients that cannot reach the socket) and ``--port`` the HTTP API (OpenAI and
Anthropic compatible). Both bind ``--host`` (127.0.0.1); any other address needs an api key:
``--api-key-file PATH`` or ``$WARMSPEC_API_KEY`` (or ``--api-key``, which every user of the machine
can read in ``/proc/PID/cmdline``; a daemon started in the background gets its key in the
environment, which only its owner can read).

This module imports no MLX at the top: ``warmspec ask`` uses it to find or start a daemon and
should start as fast as Python does.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import fcntl
import ipaddress
import logging
import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

log = logging.getLogger("warmspec.daemon")

LOG_ROTATE_BYTES = 16 << 20
STOP_TIMEOUT_S = 60.0  # room to write the prefix caches to disk on the way out


class DaemonError(RuntimeError):
    """Something the user must fix; ``str()`` is the message to print."""


# -- files -------------------------------------------------------------------------------------------


def runtime_dir() -> Path:
    """The per-user directory for the socket, pid and log files, created 0700 and checked: a
    directory in /tmp made by someone else would let them replace our socket."""
    override = os.environ.get("WARMSPEC_RUNTIME_DIR")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if override:
        path = Path(override)
    elif xdg and Path(xdg).is_dir():
        path = Path(xdg) / "warmspec"
    else:
        path = Path("/tmp") / f"warmspec-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise DaemonError(f"{path} is not a directory owned by you; set WARMSPEC_RUNTIME_DIR")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


@dataclass(frozen=True)
class RuntimePaths:
    socket: Path

    @classmethod
    def resolve(cls, socket: Path | str | None = None) -> "RuntimePaths":
        return cls(Path(socket).expanduser().absolute() if socket else runtime_dir() / "warmspec.sock")

    @property
    def pid(self) -> Path:
        return self.socket.with_suffix(".pid")

    @property
    def log(self) -> Path:
        return self.socket.with_suffix(".log")


def model_key(spec: str | None) -> str | None:
    """``--model`` as compared between ``ask`` and a running daemon: local paths absolute."""
    if spec is None:
        return None
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


class PidLock:
    """The pid file, held with flock() by the live daemon. The lock, not the file's existence,
    says whether a daemon runs: the kernel drops it when the process dies, however it dies."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None

    def acquire(self) -> bool:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return True

    def release(self) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None


def running_pid(paths: RuntimePaths) -> int | None:
    """The pid of the daemon holding ``paths``, or None when none does."""
    try:
        fd = os.open(paths.pid, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
        else:
            return None  # nobody holds it: a leftover
        for _ in range(50):  # the daemon writes its pid right after locking
            text = os.pread(fd, 32, 0).decode().strip()
            if text.isdigit():
                return int(text)
            time.sleep(0.01)
        return None
    finally:
        os.close(fd)


# -- serve ---------------------------------------------------------------------------------------------


def api_key_from(args: argparse.Namespace) -> str | None:
    """The api key a command was given: ``--api-key``, else the first line of ``--api-key-file``,
    else ``$WARMSPEC_API_KEY``; None when there is none."""
    key = getattr(args, "api_key", None)
    path = getattr(args, "api_key_file", None)
    if key and path:
        raise DaemonError("give --api-key or --api-key-file, not both")
    if path:
        try:
            key = Path(path).expanduser().read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise DaemonError(f"--api-key-file {path}: cannot read it ({e})") from None
        if not key:
            raise DaemonError(f"--api-key-file {path} is empty")
    return key or os.environ.get("WARMSPEC_API_KEY") or None


def engine_for(lm, args: argparse.Namespace, **kw):
    """The engine the command line asks for: speculation on or off, the draft ceiling, and the
    guess source -- an MTP head (``--mtp PATH``: a checkpoint directory with ``mtp.*`` tensors, a
    standalone head file, or ``shipped``: the head shipped for the default model in
    ``warmspec/heads``, checked against this very file), a draft model (``--draft-model M``), else
    n-gram lookup. Raises ``ModelError`` for a drafter that cannot be loaded or does not fit.

    With the default model and nothing else asked for, the shipped head drafts beside n-gram
    lookup where it was measured to pay (``heads.head_by_default``: on a CPU, not on a GPU);
    ``--mtp shipped`` turns it on anywhere, ``--mtp off`` off."""
    from ..core import MAX_DRAFT, Engine, default_cost_cache
    from ..core.draft_model import DraftModel
    from ..core.mtp import MTPError
    from ..heads import head_by_default, resolve_head
    from ..model import ModelError

    max_draft = args.max_draft or MAX_DRAFT
    mtp = draft = None
    spec = getattr(args, "mtp", None)
    try:
        if spec is not None and str(spec) != "off":
            mtp = resolve_head(spec, lm)
        elif (spec is None and getattr(args, "model", None) is None and not args.no_speculate
              and not getattr(args, "draft_model", None)):
            mtp = head_by_default(lm)
        if getattr(args, "draft_model", None):
            draft = DraftModel.load(args.draft_model, lm)
    except MTPError as e:
        raise ModelError(f"--mtp {args.mtp}: {e}") from None
    return Engine(lm, speculate=not args.no_speculate, max_draft=max_draft, mtp=mtp, draft_model=draft,
                  cost_cache=default_cost_cache(lm, max_draft), **kw)


def load_app(args: argparse.Namespace, *, roots: list[Path], api_key: str | None):
    """Load the model and start the scheduler; measure verify costs now, not during a request.
    Attach the prefix cache's disk tier and the keep-alive (idle unload) the options ask for."""
    from .. import roofline
    from ..model import load
    from ..core.prefix_disk import DiskTier
    from ..memory import tune_malloc
    from .app import App
    from .keepalive import DEFAULT_KEEP_ALIVE_S, KeepAlive

    if tune_malloc():
        log.info("malloc: large blocks mapped on their own (1 MiB threshold), 2 arenas")
    log.info("loading %s", args.model or "the default model (SmolLM2-135M-Instruct)")
    t = time.perf_counter()
    lm = load(args.model)
    engine = engine_for(lm, args, prefix_budget_bytes=getattr(args, "prefix_budget", None))  # serve's
    if engine.speculate:
        log.info("verify costs: measured once per machine and model (a few seconds), then kept")
        engine.costs
    budget = getattr(args, "prefix_disk", None)
    if budget != 0:
        tier = DiskTier.for_model(lm, getattr(args, "prefix_disk_dir", None), budget)
        tier.attach(engine)
        log.info("prefix cache on disk: %s (%d states, budget %.1f GiB)", tier.dir, len(tier.entries),
                 tier.budget_bytes / (1 << 30))
    app = App(lm, engine, workspace_roots=roots, api_key=api_key)
    keep_alive = getattr(args, "keep_alive", None)
    app.scheduler.keepalive = KeepAlive(engine, lambda: load(args.model),
                                        DEFAULT_KEEP_ALIVE_S if keep_alive is None else keep_alive.seconds)
    app.bandwidth = roofline.measure_bandwidth()
    log.info("memory bandwidth (matrix-vector product): %.1f GB/s", app.bandwidth / 1e9)
    app.start()
    if app.workspace.roots:
        log.info("workspace: %s", ", ".join(str(r) for r in app.workspace.roots))
    log.info("loaded %s in %.1f s", lm.name, time.perf_counter() - t)
    return app


def cmd_serve(args: argparse.Namespace) -> int:
    from ..model import ModelError

    api_key = api_key_from(args)
    tcp = args.port is not None or args.rpc_port is not None
    if tcp and not is_loopback(args.host) and not api_key:
        raise DaemonError(f"refusing to listen on {args.host} without an api key (--api-key-file, "
                          "WARMSPEC_API_KEY or --api-key): "
                          "anyone who can reach it could use the model and read workspace files")
    for w in args.workspace:
        if not Path(w).is_dir():
            raise DaemonError(f"--workspace {w}: not a directory")
    paths = RuntimePaths.resolve(args.socket)
    paths.socket.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # `warmspec stop` during the model load: end through the finally below, not mid-air.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    lock = PidLock(paths.pid)
    if not lock.acquire():
        raise DaemonError(f"a daemon is already running (pid {running_pid(paths)}, socket {paths.socket})")
    app = None
    try:
        try:
            app = load_app(args, roots=[Path(w) for w in args.workspace], api_key=api_key)
        except ModelError as e:
            raise DaemonError(str(e)) from None
        return asyncio.run(_serve(app, paths, args))
    finally:
        if app is not None:
            app.stop()
        paths.socket.unlink(missing_ok=True)
        lock.release()


async def _serve(app, paths: RuntimePaths, args: argparse.Namespace) -> int:
    from .rpc import RpcService

    service = RpcService(app, model_spec=model_key(args.model))
    if paths.socket.exists() or paths.socket.is_symlink():
        if not stat.S_ISSOCK(paths.socket.lstat().st_mode):
            raise DaemonError(f"{paths.socket} exists and is not a socket")
        paths.socket.unlink()  # we hold the lock: whoever made it is gone
    where = [f"JSON-RPC on {paths.socket}"]
    runner = None
    try:
        await service.serve_unix(paths.socket)
        if args.rpc_port is not None:
            port = await service.serve_tcp(args.host, args.rpc_port)
            where.append(f"JSON-RPC on tcp {args.host}:{port}")
        if args.port is not None:
            try:
                from .http import start_http
            except ImportError as e:
                raise DaemonError(f"the HTTP transport is not available: {e}") from None
            runner = await start_http(app, args.host, args.port, allow_origins=args.allow_origin)
            where.append(f"HTTP on http://{args.host}:{runner.addresses[0][1]}")
    except OSError as e:
        raise DaemonError(f"cannot listen: {e}") from None
    log.info("ready: %s%s", ", ".join(where), " (api key required)" if app.api_key else "")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping")
    await service.close()
    if runner is not None:
        await runner.cleanup()
    return 0


def default_lsp_roots(workspace: list[str]) -> list[Path]:
    """``lsp``'s roots: ``--workspace``, else the current directory -- an editor spawns its
    language server in the project -- but not a home directory or /, which the workspace watcher
    would walk directory by directory."""
    cwd = Path.cwd()
    return [Path(w) for w in workspace] or ([cwd] if cwd not in (Path.home(), Path("/")) else [])


def claim_stdout() -> BinaryIO:
    """Stdout for the protocol alone: anything else printing there (a library, a stray print)
    would corrupt the stream, so fd 1 becomes stderr and the protocol writes to a private copy."""
    protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return protocol_out


def cmd_lsp_in_process(args: argparse.Namespace) -> int:
    """An LSP server on stdio with a model of its own, for an editor that spawns it (the editor is
    trusted: no api key). Isolated from the daemon; ``warmspec lsp`` without ``--in-process``
    relays to it instead."""
    from ..model import ModelError
    from .rpc import RpcService

    protocol_out = claim_stdout()
    try:
        app = load_app(args, roots=default_lsp_roots(args.workspace), api_key=None)
    except ModelError as e:
        raise DaemonError(str(e)) from None
    try:
        return asyncio.run(RpcService(app, model_spec=model_key(args.model)).serve_stdio(sys.stdin.buffer,
                                                                                        protocol_out))
    finally:
        app.stop()


# -- stop ------------------------------------------------------------------------------------------------


def cmd_stop(args: argparse.Namespace) -> int:
    paths = RuntimePaths.resolve(args.socket)
    pid = running_pid(paths)
    if pid is None:
        print(f"warmspec: no daemon is running at {paths.socket}", file=sys.stderr)
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while running_pid(paths) is not None:
        if time.monotonic() > deadline:
            raise DaemonError(f"the daemon (pid {pid}) did not stop within {STOP_TIMEOUT_S:.0f} s")
        time.sleep(0.05)
    print(f"warmspec: stopped the daemon (pid {pid})", file=sys.stderr)
    return 0


# -- background start, for ask -------------------------------------------------------------------------------


def start_background(paths: RuntimePaths, serve_args: list[str], *, api_key: str | None = None) -> subprocess.Popen:
    """Start ``warmspec serve`` detached (own session: the terminal's Ctrl-C is not for it),
    logging to ``paths.log``. ``api_key`` goes to it as ``$WARMSPEC_API_KEY``, never in its
    arguments: /proc/PID/cmdline is readable by every user, /proc/PID/environ by the owner only."""
    if paths.log.exists() and paths.log.stat().st_size > LOG_ROTATE_BYTES:
        paths.log.replace(paths.log.with_suffix(".log.1"))
    fd = os.open(paths.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        cmd = [sys.executable, "-m", "warmspec", "serve", "--socket", str(paths.socket), *serve_args]
        env = dict(os.environ, WARMSPEC_API_KEY=api_key) if api_key else None
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, env=env,
                                start_new_session=True, close_fds=True)
    finally:
        os.close(fd)


def wait_until_ready(paths: RuntimePaths, proc: subprocess.Popen, log_offset: int,
                     progress: Callable[[str], None], timeout: float = 900.0):
    """Wait for the socket to answer, passing the daemon's latest log line to ``progress``;
    returns a connected ``Client``."""
    from ..client import Client

    deadline = time.monotonic() + timeout
    while True:
        try:
            return Client.unix(paths.socket, timeout=2.0)
        except OSError:
            pass
        if proc.poll() is not None and running_pid(paths) is None:
            raise DaemonError(_start_failure(paths, proc.returncode, _log_lines(paths.log, log_offset)))
        if time.monotonic() > deadline:
            raise DaemonError(f"the daemon did not answer within {timeout:.0f} s; see {paths.log}")
        lines = _log_lines(paths.log, log_offset)
        if lines:
            progress(lines[-1].split(" INFO ", 1)[-1])
        time.sleep(0.1)


def _start_failure(paths: RuntimePaths, status: int, lines: list[str]) -> str:
    """Why a background daemon did not start: its own last error first (the one line an editor
    shows), then the end of its log."""
    said = [line.removeprefix("warmspec: ") for line in lines if line.startswith("warmspec: ")]
    first = said[-1] if said else f"the daemon exited (status {status})"
    return (f"{first}\n(the daemon did not start: status {status}; from {paths.log}:)\n"
            + "\n".join(lines[-8:]))


def _log_lines(path: Path, offset: int) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace").splitlines()
    except FileNotFoundError:
        return []
