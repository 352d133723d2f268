"""``warmspec soak``: one daemon under a mixed, seeded, bounded load, over its real transports.

The harness is a client like any other: it starts ``warmspec serve`` as a subprocess (a runtime
directory of its own, an HTTP port, a small prefix-cache budget) and talks to it over the Unix
socket, ``warmspec lsp`` stdio relays and HTTP. Nothing of the daemon is imported. For
``--seconds`` it runs, at once:

- editors: an open buffer of a real Python file (stdlib modules copied into a workspace), typed
  into in bursts at 100-300 ms a keystroke with full-sync ``didChange`` (2-8 s of reading between
  bursts), ``textDocument/inlineCompletion`` at the cursor on some keystrokes and after each
  burst; a newer request supersedes the older one (the daemon answers it -32801, or -32800 when
  the editor also sent ``$/cancelRequest``). Now and then an editor switches files, moves its
  cursor, or drops its connection with a request in flight and reconnects;
- agents: multi-turn conversations over HTTP (OpenAI chat completions, Anthropic messages) or
  ``warmspec/chat`` on the socket, streamed and not, whose history carries ``read_file`` tool calls
  naming workspace files (indexed through the tool-call path, or ``warmspec/didRead``) and their
  results; each turn resends the history plus a new step. Each agent alternates two
  conversations and they all share a small prefix-cache budget: eviction pressure. Agents also
  rewrite workspace files on disk (the watcher re-indexes them);
- chaos: requests cancelled during prefill (a long prompt, then ``$/cancelRequest`` or a closed
  connection, once the worker has taken the job) and during decoding, HTTP and socket clients that
  leave mid-stream; the cancel latency (``$/cancelRequest`` to the reply) shows whether prefill
  stops for a cancel;
- fuzz: malformed frames and bad requests on fresh connections, each of which must get an error
  while the connection (when the frame allows it) and the daemon keep serving;
- a sampler: the daemon's resident memory (``/proc/PID/status`` VmRSS) and ``warmspec/status``.

Determinism: every actor draws from its own ``random.Random(f"{seed}/{actor}")`` and never from
what the daemon answers (assistant turns in histories are scripted, buffers evolve from a
snapshot of the files taken at start), so the same seed gives the same requests with the same
texts in the same order per actor; how far each actor gets, and which ghost texts are superseded,
depends on timing. Sizes are bounded: a fixed set of actors, each with at most a few requests in
flight, small ``max_tokens``, prompts of bounded characters.

Afterwards every distinct greedy request that got its answer is replayed alone, one at a time, on
a fresh daemon started the same way, and every answer it got under load must be the same text
(and token count). A fresh daemon, not the load's: the load's would serve ghost text from its
completion cache and resume prompts from prefix states built under load, comparing a corrupted
state with itself.

Verdict (exit status 1 when any fails): no request failed that was not cancelled or malformed on
purpose (and the daemon counted no failed job), no engine resets, every replayed answer equal,
resident memory flat after warm-up -- the first ``warmup_fraction`` (20%) of the run: the model,
caches and allocator pools fill up there -- meaning the peaks of the minute-long windows after it
span at most 10% of their minimum (``window_peaks`` says why peaks), and a daemon log without errors that exits 0 on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import math
import os
import platform
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Sequence

import msgspec

from warmspec_protocol import FunctionCall, Message, Status, ToolCall
from warmspec_protocol import rpc as wire
from warmspec_protocol.bench import Machine
from warmspec_protocol.rpc import ErrorCode
from warmspec_protocol.soak import (
    Criterion,
    DaemonRun,
    KindSummary,
    MemorySample,
    ReplayRecord,
    RequestRecord,
    SoakResults,
    SoakSettings,
)

READY_TIMEOUT_S = 900.0  # a first start on a cold cache downloads the model
STOP_TIMEOUT_S = 60.0
RSS_TOLERANCE = 0.10
RSS_WINDOW_S = 60.0  # resident memory is judged by each window's peak (see ``window_peaks``)
TAKEN_S = 20.0  # how long a prefill cancel waits for its job to leave the queue
FRAME_LIMIT = 1 << 24
FIRST_FUZZ_ID = 1_000_000  # ids of hand-made frames: never one of the connection's own
TRIGGER_AUTOMATIC = 2  # LSP InlineCompletionTriggerKind.Automatic: as the user types
SYSTEM = ("You are a coding agent working in the repository at {root}. Read files with the "
          "read_file tool before you change them, and answer briefly.")
TASKS = ("Explain what `{func}` in {file} does.", "Is there a bug in `{func}` in {file}?",
         "Add type hints to `{func}` in {file}.", "Write a docstring for `{func}` in {file}.",
         "How would you test `{func}` in {file}?")
FOLLOW_UPS = ("Make it shorter.", "Now show only the changed lines.", "Why?", "Are you sure?",
              "Apply the same change to the rest of the file.", "What about error handling?")
SCRIPTED = ("I read {file}. `{func}` is the entry point; the rest are helpers.",
            "Here is the change to {file}:\n```python\ndef {func}(*args):\n    ...\n```")
CHAOS = ("cancel_prefill_rpc", "cancel_decode_rpc", "drop_prefill_rpc", "drop_stream_rpc",
         "drop_prefill_http", "drop_stream_http", "drop_whole_http")


class SoakError(RuntimeError):
    """The soak could not run (the daemon did not start); ``str()`` says why."""


# -- the workspace ---------------------------------------------------------------------------------


def pick_files(n: int, seed: int, dest: Path) -> list[Path]:
    """Copy ``n`` stdlib modules of 2-16 KB, chosen by ``seed`` from a sorted list (so the same
    files on the same Python), flat into ``dest``: real Python for buffers and tool reads."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "idlelib", "site-packages", "lib2to3", "turtledemo", "tkinter")
    candidates = []
    for p in sorted([*stdlib.glob("*.py"), *stdlib.glob("*/*.py")]):
        rel = p.relative_to(stdlib)
        if rel.parts[0].startswith(skip) or not 2_000 <= p.stat().st_size <= 16_000:
            continue
        try:
            p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        candidates.append(p)
    if len(candidates) < n:
        raise SoakError(f"found {len(candidates)} stdlib modules of 2-16 KB in {stdlib}, need {n}")
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    out = []
    for p in random.Random(f"{seed}/files").sample(candidates, n):
        target = dest / "__".join(p.relative_to(stdlib).parts)
        shutil.copyfile(p, target)
        out.append(target)
    return sorted(out)


# -- the daemon ------------------------------------------------------------------------------------


@dataclass
class Daemon:
    role: str
    proc: subprocess.Popen
    runtime: Path  # its runtime directory, removed when it has stopped
    socket: Path
    http: str  # base URL
    log: Path
    ready_s: float

    @property
    def pid(self) -> int:
        return self.proc.pid  # ``warmspec serve`` re-executes itself (OpenBLAS): same pid

    def alive(self) -> bool:
        return self.proc.poll() is None


def start_daemon(role: str, out: Path, settings: SoakSettings, workspace: Path) -> Daemon:
    """``warmspec serve`` with a runtime directory of its own, the HTTP API on a free port and
    the soak's prefix budget; returns once it says it is ready."""
    rt = out / f"rt-{role}"
    if len(str(rt / "warmspec.sock")) > 100:  # AF_UNIX paths are limited to 108 bytes
        rt = Path(tempfile.mkdtemp(prefix=f"warmspec-soak-{role}-"))
    rt.mkdir(mode=0o700, parents=True, exist_ok=True)
    sock = rt / "warmspec.sock"
    log = out / f"daemon-{role}.log"
    cmd = [sys.executable, "-m", "warmspec", "serve", "--socket", str(sock), "--port", "0",
           "--workspace", str(workspace), "--prefix-budget", str(settings.prefix_budget_bytes),
           # a disk tier of its own: states other runs left in the user's cache are not this run's
           "--prefix-disk-dir", str(rt / "prefix"),
           *(["--model", settings.model] if settings.model else []), *settings.daemon_args]
    env = dict(os.environ, WARMSPEC_RUNTIME_DIR=str(rt))
    env.pop("WARMSPEC_API_KEY", None)
    t = time.monotonic()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=f, env=env,
                                start_new_session=True)
    while True:
        text = log.read_text(errors="replace")
        ready = re.search(r"ready: .*HTTP on (http://\S+?:\d+)", text)
        if ready:
            return Daemon(role, proc, rt, sock, ready.group(1), log, time.monotonic() - t)
        if proc.poll() is not None:
            raise SoakError(f"the {role} daemon exited ({proc.returncode}) before it was ready; "
                            f"the end of {log}:\n" + "\n".join(text.splitlines()[-12:]))
        if time.monotonic() - t > READY_TIMEOUT_S:
            proc.kill()
            raise SoakError(f"the {role} daemon was not ready after {READY_TIMEOUT_S:.0f} s; see {log}")
        time.sleep(0.2)


def stop_daemon(d: Daemon, status: Status | None) -> DaemonRun:
    """SIGTERM, as ``warmspec stop`` sends; a daemon that does not stop in time is killed."""
    alive = d.alive()
    exit_code, stop_s = d.proc.returncode, None
    if alive:
        t = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        try:
            exit_code = d.proc.wait(STOP_TIMEOUT_S)
            stop_s = time.monotonic() - t
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait()
            exit_code = None
    shutil.rmtree(d.runtime)  # a daemon that died leaves its socket and pid file
    return DaemonRun(role=d.role, pid=d.pid, log=str(d.log), ready_s=round(d.ready_s, 2), alive=alive,
                     exit_code=exit_code, stop_s=None if stop_s is None else round(stop_s, 2),
                     log_errors=log_errors(d.log.read_text(errors="replace")), status=status)


def log_errors(text: str, limit: int = 40) -> list[str]:
    """ERROR/CRITICAL lines and the last line of each traceback in a daemon log."""
    out: list[str] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if " ERROR " in line or " CRITICAL " in line:
            out.append(line[:400])
        elif line.startswith("Traceback"):
            j = i + 1
            while j < len(lines) and (lines[j].startswith((" ", "\t")) or not lines[j].strip()
                                      or lines[j].startswith(("Traceback", "During handling", "The above"))):
                j += 1
            out.append("traceback: " + (lines[j][:400] if j < len(lines) else "(cut off)"))
    return out[:limit] + ([f"... and {len(out) - limit} more"] if len(out) > limit else [])


def rss_bytes(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) * 1024 if m else None


# -- JSON-RPC over the socket or a relay ------------------------------------------------------------


class Closed(ConnectionError):
    """The connection ended before the reply."""


class RpcFailure(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def frame(body: bytes) -> bytes:
    return b"Content-Length: %d\r\n\r\n%s" % (len(body), body)


class Rpc:
    """A JSON-RPC connection: replies are matched to requests by id, ``warmspec/delta``s go to the
    request's callback, errors without an id (bad frames) to ``anonymous``."""

    def __init__(self, reader: asyncio.StreamReader, writer: Any, name: str,
                 proc: asyncio.subprocess.Process | None = None):
        self.reader = reader
        self.writer = writer
        self.name = name
        self.proc = proc  # a ``warmspec lsp`` relay
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future] = {}
        self.deltas: dict[int, Callable[[wire.DeltaParams], None]] = {}
        self.anonymous: asyncio.Queue[wire.Envelope] = asyncio.Queue()
        self.gone: str | None = None
        self.closed = asyncio.Event()
        self.task = asyncio.create_task(self._read(), name=f"read {name}")

    @classmethod
    async def unix(cls, path: Path, name: str) -> "Rpc":
        reader, writer = await asyncio.open_unix_connection(str(path), limit=FRAME_LIMIT)
        return cls(reader, writer, name)

    @classmethod
    async def relay(cls, sock: Path, workspace: Path, name: str, log: Path) -> "Rpc":
        """An editor's language server as editors spawn it: ``warmspec lsp`` on stdio."""
        with open(log, "ab") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "warmspec", "lsp", "--socket", str(sock), "--workspace", str(workspace),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, limit=FRAME_LIMIT)
        return cls(proc.stdout, proc.stdin, name, proc)

    async def _read(self) -> None:
        try:
            while True:
                header = await self.reader.readuntil(b"\r\n\r\n")
                m = re.search(rb"content-length:\s*(\d+)", header, re.I)
                if m is None:
                    raise msgspec.DecodeError(f"a frame without Content-Length: {header[:80]!r}")
                env = msgspec.json.decode(await self.reader.readexactly(int(m.group(1))), type=wire.Envelope)
                self._dispatch(env)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError) as e:
            self.gone = f"the connection ended ({type(e).__name__})"
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.gone = f"the daemon sent a bad frame: {e}"
        finally:
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(Closed(self.gone or "closed"))
                    fut.exception()  # whoever waits still gets it; a request we hung up on has nobody
            self.closed.set()

    def _dispatch(self, env: wire.Envelope) -> None:
        if env.method is not msgspec.UNSET:
            if env.method == "warmspec/delta":
                delta = msgspec.convert(env.params, wire.DeltaParams)
                if (callback := self.deltas.get(delta.id)) is not None:
                    callback(delta)
            return  # log messages and the like
        if env.id is msgspec.UNSET or env.id is None:
            self.anonymous.put_nowait(env)
        else:
            self.deltas.pop(env.id, None)
            if (fut := self.pending.pop(env.id, None)) is not None and not fut.done():
                fut.set_result(env)

    async def write(self, data: bytes) -> None:
        if self.closed.is_set():
            raise Closed(self.gone or "closed")
        self.writer.write(data)
        try:
            await self.writer.drain()
        except (ConnectionError, BrokenPipeError) as e:
            raise Closed(f"writing failed: {e}") from None

    async def send(self, message: msgspec.Struct) -> None:
        await self.write(frame(msgspec.json.encode(message)))

    def expect(self, msg_id: int) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        if self.closed.is_set():
            fut.set_exception(Closed(self.gone or "closed"))
        else:
            self.pending[msg_id] = fut
        return fut

    async def start(self, method: str, params: Any,
                    on_delta: Callable[[wire.DeltaParams], None] | None = None) -> tuple[int, asyncio.Future]:
        msg_id = next(self.ids)
        fut = self.expect(msg_id)
        if on_delta is not None:
            self.deltas[msg_id] = on_delta
        await self.send(wire.Request(id=msg_id, method=method, params=msgspec.UNSET if params is None else params))
        return msg_id, fut

    async def call(self, method: str, params: Any, timeout: float) -> Any:
        _, fut = await self.start(method, params)
        return result_of(await asyncio.wait_for(fut, timeout))

    async def notify(self, method: str, params: Any) -> None:
        await self.send(wire.Notification(method=method, params=params))

    async def cancel(self, msg_id: int) -> None:
        await self.notify("$/cancelRequest", wire.CancelParams(id=msg_id))

    async def initialize(self, name: str, timeout: float, roots: Sequence[Path] = (),
                         inline: wire.InlineCompletionSettings | None = None) -> None:
        folders = [wire.WorkspaceFolder(uri=r.as_uri(), name=r.name) for r in roots] or None
        options = wire.InitializationOptions(inline_completion=inline) if inline else None
        await self.call("initialize", wire.InitializeParams(
            process_id=os.getpid(), client_info=wire.ClientInfo(name=name), workspace_folders=folders,
            initialization_options=options), timeout)
        await self.notify("initialized", {})

    def abort(self) -> None:
        """Hang up at once, as a crashing editor or a killed agent does."""
        if self.proc is not None:
            self.proc.kill()
        else:
            self.writer.transport.abort()

    async def close(self, timeout: float) -> int | None:
        """LSP's orderly end (shutdown, exit); a relay's exit status (0 after shutdown and exit)."""
        said = False
        try:
            await self.call("shutdown", None, timeout)
            await self.notify("exit", None)
            said = True
        finally:
            self.writer.close()
            if not said:
                self.abort()
        if self.proc is None:
            return None
        try:
            return await asyncio.wait_for(self.proc.wait(), timeout)
        except asyncio.TimeoutError:
            self.proc.kill()
            raise


async def reply(conn: Rpc, source: Any, timeout: float) -> wire.Envelope:
    """The reply from ``source`` (a pending request, or ``conn.anonymous.get()``); ``Closed`` when
    the connection ends first, ``TimeoutError`` after ``timeout``."""
    getter = asyncio.ensure_future(source)
    closed = asyncio.ensure_future(conn.closed.wait())
    try:
        await asyncio.wait([getter, closed], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        closed.cancel()
    if getter.done():
        return getter.result()
    getter.cancel()
    if conn.closed.is_set():
        raise Closed(conn.gone or "closed")
    raise asyncio.TimeoutError()


def result_of(env: wire.Envelope) -> Any:
    if env.error is not msgspec.UNSET:
        raise RpcFailure(env.error.code, env.error.message)
    return env.result


# -- requests and what they got --------------------------------------------------------------------


@dataclass
class Answer:
    text: str | None = None
    tokens: int | None = None
    error: str | None = None
    first_s: float | None = None  # monotonic time of the first streamed text


@dataclass(frozen=True)
class HttpSpec:
    """An HTTP generation request, to send again alone."""

    path: str
    body: bytes
    stream: bool
    api: str  # openai | anthropic


@dataclass(frozen=True)
class RpcSpec:
    method: str
    params: msgspec.Struct


@dataclass(frozen=True)
class InlineSpec:
    uri: str
    text: str
    line: int
    character: int


Spec = HttpSpec | RpcSpec | InlineSpec


def spec_key(spec: Spec, settings: wire.InlineCompletionSettings) -> str:
    """What was sent, hashed: two requests with the same key must get the same greedy answer."""
    if isinstance(spec, HttpSpec):
        parts: list[Any] = ["http", spec.path, spec.stream, spec.body.decode()]
    elif isinstance(spec, RpcSpec):
        parts = ["rpc", spec.method, msgspec.to_builtins(spec.params)]
    else:
        parts = ["inline", msgspec.to_builtins(settings), spec.text, spec.line, spec.character]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


@dataclass
class Ctx:
    settings: SoakSettings
    out: Path
    workspace: Path
    files: list[Path]
    texts: dict[Path, str]  # the files as they were at the start: buffers and tool reads use these
    daemon: Daemon
    inline: wire.InlineCompletionSettings
    t0: float = field(default_factory=time.monotonic)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    records: list[RequestRecord] = field(default_factory=list)
    specs: dict[str, Spec] = field(default_factory=dict)
    memory: list[MemorySample] = field(default_factory=list)
    open: set["Req"] = field(default_factory=set)  # made, not yet recorded
    keystrokes: int = 0
    daemon_died: bool = False

    def now(self) -> float:
        return time.monotonic() - self.t0

    def running(self) -> bool:
        return not self.stop.is_set()

    def lines(self, path: Path) -> list[str]:
        return [line for line in self.texts[path].splitlines() if 8 <= len(line.strip()) <= 90]


class Req:
    """One request being made: its timing, then its record."""

    def __init__(self, ctx: Ctx, actor: str, n: int, kind: str, transport: str, *, greedy: bool = False,
                 intent: str = "normal"):
        self.ctx = ctx
        self.id = f"{actor}#{n}"
        self.actor = actor
        self.kind = kind
        self.transport = transport
        self.greedy = greedy
        self.intent = intent
        self.t = time.monotonic()
        self.first: float | None = None
        self.cancel_at: float | None = None
        self.recorded = False
        ctx.open.add(self)

    def text_arrived(self) -> None:
        if self.first is None:
            self.first = time.monotonic()

    def done(self, outcome: str, *, answer: Answer | None = None, error: str | None = None,
             spec: Spec | None = None, intent: str | None = None) -> RequestRecord:
        now = time.monotonic()
        answer = answer or Answer()
        first = answer.first_s or self.first
        keep = outcome == "ok" and self.greedy and spec is not None and answer.text is not None
        key = spec_key(spec, self.ctx.inline) if keep else None
        if key is not None:
            self.ctx.specs.setdefault(key, spec)
        rec = RequestRecord(
            id=self.id, actor=self.actor, kind=self.kind, transport=self.transport,
            intent=intent or self.intent, outcome=outcome, started_s=round(self.t - self.ctx.t0, 3),
            latency_s=round(now - self.t, 3), ttft_s=None if first is None else round(first - self.t, 3),
            cancel_latency_s=(round(now - self.cancel_at, 3) if self.cancel_at is not None and outcome == "cancelled"
                              else None),
            greedy=self.greedy, key=key, text=answer.text if keep else None,
            tokens=answer.tokens if keep else None, error=error or answer.error)
        if not self.recorded:
            self.recorded = True
            self.ctx.records.append(rec)
            self.ctx.open.discard(self)
        return rec


def failure(e: BaseException) -> str:
    if isinstance(e, RpcFailure):
        return f"error {e.code}: {e.message}"
    if isinstance(e, asyncio.TimeoutError):
        return "no answer in time"
    return f"{type(e).__name__}: {e}"


# -- HTTP ------------------------------------------------------------------------------------------


async def http_generate(session: Any, base: str, spec: HttpSpec, timeout: float,
                        on_text: Callable[[], None] | None = None) -> Answer:
    """Send one generation request and read its answer: the body, or the SSE stream to its end."""
    import aiohttp

    ans = Answer()
    parts: list[str] = []
    try:
        async with session.post(base + spec.path, data=spec.body, headers={"Content-Type": "application/json"},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                ans.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return ans
            if not spec.stream:
                body = await resp.json()
                if spec.api == "openai":
                    ans.text = body["choices"][0]["message"]["content"] or ""
                    ans.tokens = body["usage"]["completion_tokens"]
                else:
                    ans.text = "".join(b.get("text", "") for b in body["content"] if b["type"] == "text")
                    ans.tokens = body["usage"]["output_tokens"]
                return ans
            ended = False
            async for raw in resp.content:
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    ended = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    ans.error = f"error in the stream: {json.dumps(obj['error'])[:300]}"
                    return ans
                text = ""
                if spec.api == "openai":
                    if obj.get("choices"):
                        text = obj["choices"][0]["delta"].get("content") or ""
                    if obj.get("usage"):
                        ans.tokens = obj["usage"]["completion_tokens"]
                elif obj.get("type") == "content_block_delta":
                    text = obj["delta"].get("text") or ""
                elif obj.get("type") == "message_delta":
                    ans.tokens = obj["usage"]["output_tokens"]
                elif obj.get("type") == "message_stop":
                    ended = True
                    break
                if text:
                    parts.append(text)
                    if ans.first_s is None:
                        ans.first_s = time.monotonic()
                        if on_text is not None:
                            on_text()
            if not ended:
                ans.error = "the stream ended without its last event"
                return ans
            ans.text = "".join(parts)
            return ans
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, KeyError, IndexError,
            TypeError) as e:
        ans.error = failure(e)
        return ans


def chat_body(api: str, history: list["Turn"], *, stream: bool, max_tokens: int, temperature: float,
              seed: int | None, stop: list[str] | None) -> HttpSpec:
    """An agent's request in the API's own shape; the same history renders the same bytes."""
    body: dict[str, Any] = {"model": "warmspec", "max_tokens": max_tokens, "temperature": temperature,
                            "stream": stream}
    if seed is not None:
        body["seed"] = seed
    if api == "openai":
        body["messages"] = [t.openai() for t in history]
        if stop:
            body["stop"] = stop
        if stream:
            body["stream_options"] = {"include_usage": True}
        return HttpSpec("/v1/chat/completions", json.dumps(body).encode(), stream, api)
    body["system"] = history[0].text
    messages: list[dict] = []
    for t in history[1:]:
        role, blocks = t.anthropic()
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += blocks
        else:
            messages.append({"role": role, "content": list(blocks)})
    body["messages"] = messages
    if stop:
        body["stop_sequences"] = stop
    return HttpSpec("/v1/messages", json.dumps(body).encode(), stream, api)


# -- agents ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Turn:
    """One message of an agent's history, in no API's shape yet."""

    role: str  # system | user | assistant | tool
    text: str = ""
    calls: tuple[tuple[str, str], ...] = ()  # (call id, path) of read_file calls
    call_id: str | None = None

    def openai(self) -> dict:
        if self.role == "assistant" and self.calls:
            return {"role": "assistant", "content": self.text or None, "tool_calls": [
                {"id": cid, "type": "function",
                 "function": {"name": "read_file", "arguments": json.dumps({"path": path})}}
                for cid, path in self.calls]}
        if self.role == "tool":
            return {"role": "tool", "tool_call_id": self.call_id, "content": self.text}
        return {"role": self.role, "content": self.text}

    def anthropic(self) -> tuple[str, list[dict]]:
        if self.role == "tool":
            return "user", [{"type": "tool_result", "tool_use_id": self.call_id, "content": self.text}]
        blocks = [{"type": "text", "text": self.text}] if self.text else []
        blocks += [{"type": "tool_use", "id": cid, "name": "read_file", "input": {"path": path}}
                   for cid, path in self.calls]
        return self.role, blocks

    def message(self) -> Message:
        calls = [ToolCall(id=cid, function=FunctionCall(name="read_file", arguments={"path": path}))
                 for cid, path in self.calls] or None
        return Message(role=self.role, content=self.text, tool_calls=calls, tool_call_id=self.call_id)


@dataclass
class Conversation:
    name: str
    history: list[Turn]
    turns_left: int
    reads: list[Path]  # files its tool calls named, for warmspec/didRead
    calls: int = 0


def new_conversation(ctx: Ctx, rng: random.Random, name: str) -> Conversation:
    f = rng.choice(ctx.files)
    funcs = re.findall(r"^def (\w+)", ctx.texts[f], re.M) or ["main"]
    func = rng.choice(funcs)
    conv = Conversation(name, [Turn("system", SYSTEM.format(root=ctx.workspace)),
                               Turn("user", rng.choice(TASKS).format(func=func, file=f.name))],
                        rng.randint(2, 4), [])
    read(ctx, rng, conv, f)
    return conv


def read(ctx: Ctx, rng: random.Random, conv: Conversation, f: Path) -> None:
    """A read_file call and its result; one in ten names a file that is not there."""
    cid = f"{conv.name}-call{conv.calls}"
    conv.calls += 1
    if rng.random() < 0.1:
        missing = ctx.workspace / f"missing_{rng.randrange(1000)}.py"
        conv.history += [Turn("assistant", calls=((cid, str(missing)),)),
                         Turn("tool", f"Error: {missing}: no such file", call_id=cid)]
        return
    head = ctx.texts[f][: ctx.settings.tool_chars]
    conv.history += [Turn("assistant", calls=((cid, str(f)),)), Turn("tool", head, call_id=cid)]
    conv.reads.append(f)


def next_step(ctx: Ctx, rng: random.Random, conv: Conversation) -> None:
    """The history for the next turn: a scripted answer and a follow-up, or another read."""
    f = rng.choice(ctx.files)
    if rng.random() < 0.5 or conv.calls >= 3:
        func = rng.choice(re.findall(r"^def (\w+)", ctx.texts[f], re.M) or ["main"])
        conv.history += [Turn("assistant", rng.choice(SCRIPTED).format(file=f.name, func=func)),
                         Turn("user", rng.choice(FOLLOW_UPS))]
    else:
        read(ctx, rng, conv, f)
    conv.turns_left -= 1


async def agent(ctx: Ctx, j: int) -> None:
    """Turns of two alternating conversations, one request at a time, with a pause between."""
    import aiohttp

    s = ctx.settings
    name = f"agent-{j}"
    api = ("openai", "anthropic", "rpc")[j % 3]
    rng = random.Random(f"{s.seed}/{name}")
    numbers = itertools.count()
    convs = [new_conversation(ctx, rng, f"{name}-c{k}") for k in range(2)]
    made = itertools.count(2)
    rpc: Rpc | None = None
    async with aiohttp.ClientSession() as session:
        for turn in itertools.count():
            if not ctx.running():
                break
            k = turn % 2
            conv = convs[k]
            stream = rng.random() < 0.5
            greedy = rng.random() < 0.8
            seed = None if greedy else rng.randrange(1 << 30)
            stop = ["\n\n"] if rng.random() < 0.3 else None
            temperature = 0.0 if greedy else 0.8
            if api == "rpc":
                if rpc is None or rpc.closed.is_set():
                    rpc = await connect(ctx, name, numbers)
                if rpc is not None:
                    await rpc_turn(ctx, rpc, name, numbers, conv, greedy, temperature, seed, stop)
            else:
                spec = chat_body(api, conv.history, stream=stream, max_tokens=s.max_tokens,
                                 temperature=temperature, seed=seed, stop=stop)
                req = Req(ctx, name, next(numbers), f"{'chat' if api == 'openai' else 'messages'}_http"
                          f"{'_stream' if stream else ''}", "http", greedy=greedy)
                ans = await http_generate(session, ctx.daemon.http, spec, s.request_timeout_s, req.text_arrived)
                req.done("failed" if ans.error else "ok", answer=ans, spec=spec)
            if rng.random() < 0.15:  # the agent edits a file: the daemon's watcher re-indexes it
                f = rng.choice(ctx.files)
                with open(f, "a") as out:
                    out.write(f"# {name} turn {turn}: edited\n")
            next_step(ctx, rng, conv)
            if conv.turns_left <= 0:
                convs[k] = new_conversation(ctx, rng, f"{name}-c{next(made)}")
            await pause(ctx, rng.uniform(0.2, 1.5))
    if rpc is not None and not rpc.closed.is_set():
        await rpc.close(s.request_timeout_s)


async def connect(ctx: Ctx, actor: str, numbers: Any, inline: wire.InlineCompletionSettings | None = None,
                  relay: bool = False, roots: Sequence[Path] = ()) -> Rpc | None:
    """A new initialized connection; a failure to connect is a failed request (``connect``)."""
    req = Req(ctx, actor, next(numbers), "connect", "relay" if relay else "unix")
    try:
        if relay:
            conn = await Rpc.relay(ctx.daemon.socket, ctx.workspace, actor, ctx.out / f"{actor}-lsp.log")
        else:
            conn = await Rpc.unix(ctx.daemon.socket, actor)
        await conn.initialize(actor, ctx.settings.request_timeout_s, roots=roots, inline=inline)
    except (OSError, Closed, RpcFailure, asyncio.TimeoutError) as e:
        req.done("failed", error=failure(e))
        await pause(ctx, 1.0)
        return None
    req.done("ok")
    return conn


async def rpc_turn(ctx: Ctx, conn: Rpc, actor: str, numbers: Any, conv: Conversation, greedy: bool,
                   temperature: float, seed: int | None, stop: list[str] | None) -> None:
    """A turn over the socket: ``warmspec/didRead`` for files not reported yet, then the chat."""
    s = ctx.settings
    while conv.reads:
        f = conv.reads.pop(0)
        req = Req(ctx, actor, next(numbers), "did_read", "unix")
        try:
            await conn.call("warmspec/didRead", wire.DidReadParams(path=str(f)), s.request_timeout_s)
            req.done("ok")
        except (Closed, RpcFailure, asyncio.TimeoutError) as e:
            req.done("failed", error=failure(e))
    params = wire.ChatParams(messages=[t.message() for t in conv.history], max_tokens=s.max_tokens,
                             temperature=temperature, seed=seed, stop=stop)
    req = Req(ctx, actor, next(numbers), "chat_rpc", "unix", greedy=greedy)
    ans = await rpc_generate(conn, RpcSpec("warmspec/chat", params), s.request_timeout_s, req)
    req.done("failed" if ans.error else "ok", answer=ans, spec=RpcSpec("warmspec/chat", params))


async def rpc_generate(conn: Rpc, spec: RpcSpec, timeout: float, req: Req | None = None) -> Answer:
    def on_delta(_: wire.DeltaParams) -> None:
        if req is not None:
            req.text_arrived()

    ans = Answer()
    try:
        _, fut = await conn.start(spec.method, spec.params, on_delta=on_delta)
        result = msgspec.convert(result_of(await asyncio.wait_for(fut, timeout)), wire.GenerateResult)
        ans.text, ans.tokens = result.text, result.stats.completion_tokens
    except (Closed, RpcFailure, asyncio.TimeoutError, msgspec.ValidationError) as e:
        ans.error = failure(e)
    return ans


async def pause(ctx: Ctx, seconds: float) -> None:
    """Sleep, but wake when the load ends."""
    try:
        await asyncio.wait_for(ctx.stop.wait(), seconds)
    except asyncio.TimeoutError:
        pass


# -- editors ---------------------------------------------------------------------------------------


def lsp_position(text: str, offset: int) -> tuple[int, int]:
    """LSP's (line, UTF-16 character) of ``offset``."""
    line = text.count("\n", 0, offset)
    start = text.rfind("\n", 0, offset) + 1
    return line, len(text[start:offset].encode("utf-16-le")) // 2


@dataclass
class Pending:
    req: Req
    msg_id: int
    fut: asyncio.Future
    expected_end: str | None = None  # why the editor expects it to end without an answer


class Editor:
    """One editor window: a buffer typed into, ghost text requested at the cursor."""

    def __init__(self, ctx: Ctx, i: int):
        s = ctx.settings
        self.ctx = ctx
        self.name = f"editor-{i}"
        self.relay = i < s.relay_editors
        self.transport = "relay" if self.relay else "unix"
        self.rng = random.Random(f"{s.seed}/{self.name}")
        self.numbers = itertools.count()
        self.conn: Rpc | None = None
        self.opened_on: Rpc | None = None  # the connection the buffer was opened on
        self.dropped: Rpc | None = None  # a connection we hung up on ourselves
        self.path = ctx.files[0]
        self.text = ""
        self.cur = 0
        self.version = 0
        self.pending: list[Pending] = []
        self.tasks: set[asyncio.Task] = set()

    @property
    def uri(self) -> str:
        return self.path.as_uri()

    async def run(self) -> None:
        rng = self.rng
        self.open(rng.choice(self.ctx.files))
        while self.ctx.running():
            await self.burst()
            await self.request()  # the pause after typing: what editors ask ghost text for
            await pause(self.ctx, rng.uniform(2.0, 8.0))  # reading, thinking
            r = rng.random()
            if r < 0.1 or len(self.text) > 2 * len(self.ctx.texts[self.path]) + 2000:
                await self.close_document()
                self.open(rng.choice(self.ctx.files))
            elif r < 0.25:
                self.move()
            elif r < 0.32 and not self.relay:
                await self.drop()
        await self.finish()

    def open(self, path: Path) -> None:
        """A buffer of ``path`` as it was at the start, the cursor at the end of a line; the
        ``didOpen`` goes out with the next change or request."""
        self.path = path
        self.text = self.ctx.texts[path]
        self.opened_on = None
        self.move()

    def move(self) -> None:
        lines = self.text.split("\n")
        li = self.rng.randrange(len(lines))
        self.cur = sum(len(x) + 1 for x in lines[:li]) + len(lines[li])

    async def sync(self) -> bool:
        """Connected, with the buffer open there: reconnect after a hang-up (a failure when the
        daemon hung up, not we), reopen the buffer on a new connection."""
        if self.conn is not None and self.conn.closed.is_set():
            if self.conn is not self.dropped:
                Req(self.ctx, self.name, next(self.numbers), "connection", self.transport).done(
                    "failed", error=f"the daemon hung up: {self.conn.gone}")
            self.conn = None
        if self.conn is None:
            self.conn = await connect(self.ctx, self.name, self.numbers, inline=self.ctx.inline,
                                      relay=self.relay, roots=[self.ctx.workspace])
            if self.conn is None:
                return False
        if self.opened_on is not self.conn:
            self.version += 1
            self.opened_on = self.conn
            await self.notify("textDocument/didOpen", {"textDocument": {
                "uri": self.uri, "languageId": "python", "version": self.version, "text": self.text}})
        return True

    async def notify(self, method: str, params: dict) -> None:
        try:
            await self.conn.notify(method, params)
        except Closed:
            pass  # the next sync() sees it

    async def change(self) -> None:
        self.ctx.keystrokes += 1
        for p in self.pending:  # the daemon cancels a document's running suggestion when it changes
            if not p.fut.done() and p.expected_end is None:
                p.expected_end = "edited"
        if await self.sync():
            self.version += 1
            await self.notify("textDocument/didChange", {"textDocument": {"uri": self.uri, "version": self.version},
                                                         "contentChanges": [{"text": self.text}]})

    async def burst(self) -> None:
        """Type part of a line from another file, a keystroke every 100-300 ms."""
        rng = self.rng
        donor = self.ctx.lines(rng.choice(self.ctx.files)) or ["pass"]
        start = self.text.rfind("\n", 0, self.cur) + 1
        indent = re.match(r"[ \t]*", self.text[start:]).group(0)
        typed = "\n" + indent + rng.choice(donor).strip()
        for ch in typed[: rng.randint(3, len(typed))]:
            if not self.ctx.running():
                return
            self.text = self.text[: self.cur] + ch + self.text[self.cur:]
            self.cur += 1
            await self.change()
            if rng.random() < 0.05:  # a typo, taken back
                self.text = self.text[: self.cur - 1] + self.text[self.cur:]
                self.cur -= 1
                await self.change()
            if rng.random() < 0.2:
                await self.request()
            await pause(self.ctx, rng.uniform(0.1, 0.3))

    async def request(self) -> None:
        """Ghost text at the cursor. Half the time the editor also cancels the one before, as
        VS Code does; the daemon supersedes it either way."""
        explicit = self.rng.random() < 0.5
        if not await self.sync():
            return
        for p in self.pending:
            if not p.fut.done() and p.expected_end is None:
                p.expected_end = "superseded"
                if explicit:
                    p.req.cancel_at = time.monotonic()
                    try:
                        await self.conn.cancel(p.msg_id)
                    except Closed:
                        pass
        line, character = lsp_position(self.text, self.cur)
        spec = InlineSpec(self.uri, self.text, line, character)
        req = Req(self.ctx, self.name, next(self.numbers), "inline", self.transport, greedy=True)
        try:
            msg_id, fut = await self.conn.start("textDocument/inlineCompletion", {
                "textDocument": {"uri": self.uri}, "position": {"line": line, "character": character},
                "context": {"triggerKind": TRIGGER_AUTOMATIC}})
        except Closed as e:
            req.done("failed", error=failure(e))
            return
        p = Pending(req, msg_id, fut)
        self.pending.append(p)
        task = asyncio.create_task(self.answer(p, spec))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def answer(self, p: Pending, spec: InlineSpec) -> None:
        """Its outcome: an answer; -32801/-32800 when the editor superseded or cancelled it (a
        failure when it did not); the connection's end when the editor hung up or closed."""
        try:
            result = result_of(await asyncio.wait_for(p.fut, self.ctx.settings.request_timeout_s))
            items = (result or {}).get("items") or []
            p.req.done("ok", answer=Answer(text=items[0]["insertText"] if items else ""), spec=spec)
        except RpcFailure as e:
            routine = e.code in (ErrorCode.CONTENT_MODIFIED, ErrorCode.REQUEST_CANCELLED)
            if routine and p.expected_end is not None:
                p.req.done("cancelled", error=failure(e), intent="cancel")
            else:
                p.req.done("failed", error=failure(e) + (" (the editor had not superseded it)" if routine else ""))
        except Closed as e:
            if p.expected_end in ("disconnect", "closed"):
                p.req.done("cancelled", error=failure(e), intent="disconnect")
            else:
                p.req.done("failed", error=failure(e))
        except asyncio.TimeoutError as e:
            p.req.done("failed", error=failure(e))
        finally:
            self.pending.remove(p)

    async def close_document(self) -> None:
        for p in self.pending:
            if p.expected_end is None:
                p.expected_end = "closed"  # the daemon may cancel it with the document
        if self.conn is not None and self.opened_on is self.conn:
            await self.notify("textDocument/didClose", {"textDocument": {"uri": self.uri}})

    async def drop(self) -> None:
        """Hang up with a ghost text in flight, then (at the next keystroke) come back and
        reopen the buffer."""
        await self.request()
        await pause(self.ctx, self.rng.uniform(0.05, 0.5))
        if self.conn is None:
            return
        for p in self.pending:
            p.expected_end = "disconnect"
        req = Req(self.ctx, self.name, next(self.numbers), "disconnect", "unix", intent="disconnect")
        self.dropped = self.conn
        self.conn.abort()
        await self.conn.closed.wait()
        req.done("cancelled")

    async def finish(self) -> None:
        """Let ghost texts in flight answer (the drain), then shut down as an editor does."""
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=self.ctx.settings.drain_s)
        if self.conn is None or self.conn.closed.is_set():
            return
        for p in self.pending:
            p.expected_end = "closed"
        req = Req(self.ctx, self.name, next(self.numbers), "shutdown", self.transport)
        try:
            code = await self.conn.close(self.ctx.settings.request_timeout_s)
        except (Closed, RpcFailure, asyncio.TimeoutError) as e:
            req.done("failed", error=failure(e))
            return
        if code not in (None, 0):
            req.done("failed", error=f"warmspec lsp exited with status {code} after shutdown and exit")
        else:
            req.done("ok")


# -- chaos: cancellations and clients that leave ---------------------------------------------------


def long_prompt(ctx: Ctx, rng: random.Random) -> str:
    f = rng.choice(ctx.files)
    text = ctx.texts[f]
    start = rng.randrange(max(1, len(text) - ctx.settings.long_prompt_chars))
    return (f"Here is part of {f.name}:\n```python\n{text[start:start + ctx.settings.long_prompt_chars]}\n```\n"
            "Summarize what it does in one sentence.")


async def chaos(ctx: Ctx) -> None:
    import aiohttp

    s = ctx.settings
    rng = random.Random(f"{s.seed}/chaos")
    numbers = itertools.count()
    order = list(CHAOS)
    rng.shuffle(order)
    connector = aiohttp.TCPConnector(force_close=True)  # a dropped request closes its connection
    poll: Rpc | None = None  # for warmspec/status: when has the worker taken our job?
    async with aiohttp.ClientSession(connector=connector) as session:
        for n in itertools.count():
            if not ctx.running():
                break
            if poll is None or poll.closed.is_set():
                poll = await connect(ctx, "chaos", numbers)
            scenario = order[n % len(order)]
            early = scenario in ("cancel_prefill_rpc", "drop_prefill_rpc", "drop_prefill_http", "drop_whole_http")
            prompt = long_prompt(ctx, rng) if early else rng.choice(TASKS).format(
                func="main", file=rng.choice(ctx.files).name) + " Explain at length."
            max_tokens = s.max_tokens if early else 2 * s.max_tokens
            delay = rng.uniform(0.2, 1.0)
            if scenario.endswith("_rpc"):
                await chaos_rpc(ctx, poll, scenario, numbers, prompt, max_tokens, delay)
            else:
                await chaos_http(ctx, poll, session, scenario, numbers, prompt, max_tokens, delay)
            await pause(ctx, rng.uniform(0.5, 2.0))
    if poll is not None:
        poll.abort()


async def taken(ctx: Ctx, poll: Rpc | None, answer: asyncio.Future) -> None:
    """Until the worker has most likely taken our job: a moment after sending it, the queue is
    empty while a job runs. Best effort (another client's job may be the one running), so that a
    cancel lands in its prefill rather than in the queue, where any job is dropped at once. A
    daemon whose queue never empties (more load than it serves) gets the cancel after TAKEN_S."""
    start = time.monotonic()
    while poll is not None and not answer.done() and time.monotonic() - start < TAKEN_S:
        try:
            st = await poll.call("warmspec/status", None, ctx.settings.request_timeout_s)
        except (Closed, RpcFailure, asyncio.TimeoutError):
            return
        if time.monotonic() - start >= 0.2 and st["queue"] == 0 and st["active"]:
            return
        await asyncio.wait([answer], timeout=0.1)


async def chaos_rpc(ctx: Ctx, poll: Rpc | None, kind: str, numbers: Any, prompt: str, max_tokens: int,
                    delay: float) -> None:
    """``$/cancelRequest`` (the reply, -32800, must come) or a hang-up, during prefill
    (``*_prefill``: ``delay`` after the job was taken) or after the first token (``*_decode``,
    ``*_stream``). The cancel latency shows whether prefill stops for it."""
    conn = await connect(ctx, "chaos", numbers)
    if conn is None:
        return
    s = ctx.settings
    spec = RpcSpec("warmspec/chat", wire.ChatParams(messages=[Message(role="user", content=prompt)],
                                                    max_tokens=max_tokens, temperature=0.0))
    req = Req(ctx, "chaos", next(numbers), kind, "unix", greedy=True,
              intent="cancel" if kind.startswith("cancel") else "disconnect")
    first = asyncio.Event()

    def on_delta(_: wire.DeltaParams) -> None:
        req.text_arrived()
        first.set()

    try:
        msg_id, fut = await conn.start(spec.method, spec.params, on_delta=on_delta)
        if kind.endswith("prefill_rpc"):
            await taken(ctx, poll, fut)
            await asyncio.wait([fut], timeout=delay)
        else:
            await first_of(fut, first, s.request_timeout_s)
        if fut.done():  # it finished before we could cancel it: an ordinary answer
            result = msgspec.convert(result_of(fut.result()), wire.GenerateResult)
            req.done("ok", answer=Answer(result.text, result.stats.completion_tokens), spec=spec, intent="normal")
        elif kind.startswith("cancel"):
            req.cancel_at = time.monotonic()
            await conn.cancel(msg_id)
            try:
                env = await asyncio.wait_for(fut, s.request_timeout_s)
                result = msgspec.convert(result_of(env), wire.GenerateResult)
                req.done("ok", answer=Answer(result.text, result.stats.completion_tokens), spec=spec, intent="normal")
            except RpcFailure as e:
                req.done("cancelled" if e.code == ErrorCode.REQUEST_CANCELLED else "failed", error=failure(e))
        else:
            conn.abort()
            req.done("cancelled")
    except (Closed, RpcFailure, asyncio.TimeoutError, msgspec.ValidationError) as e:
        req.done("failed", error=failure(e))
    finally:
        if not conn.closed.is_set():
            conn.abort()


async def first_of(fut: asyncio.Future, event: asyncio.Event, timeout: float) -> None:
    """Until ``fut`` is done or ``event`` is set (or ``timeout``)."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait([fut, waiter], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()


async def chaos_http(ctx: Ctx, poll: Rpc | None, session: Any, kind: str, numbers: Any, prompt: str,
                     max_tokens: int, delay: float) -> None:
    """A client that leaves: during prefill (``delay`` after its job was taken), or after the
    first text (``drop_stream_http``)."""
    s = ctx.settings
    stream = kind != "drop_whole_http"
    spec = chat_body("openai", [Turn("system", "You are terse."), Turn("user", prompt)], stream=stream,
                     max_tokens=max_tokens, temperature=0.0, seed=None, stop=None)
    req = Req(ctx, "chaos", next(numbers), kind, "http", greedy=True, intent="disconnect")
    first = asyncio.Event()

    def on_text() -> None:
        req.text_arrived()
        first.set()

    call = asyncio.create_task(http_generate(session, ctx.daemon.http, spec, s.request_timeout_s, on_text))
    try:
        if kind == "drop_stream_http":
            await first_of(call, first, s.request_timeout_s)
        else:
            await taken(ctx, poll, call)
            await asyncio.wait([call], timeout=delay)
        if call.done():
            ans = call.result()
            req.done("failed" if ans.error else "ok", answer=ans, spec=spec, intent="normal")
            return
        call.cancel()  # aiohttp closes the connection of a request cancelled mid-way
        await asyncio.gather(call, return_exceptions=True)
        req.done("cancelled")
    finally:
        call.cancel()


# -- fuzz: malformed frames and bad requests ---------------------------------------------------------


@dataclass(frozen=True)
class BadFrame:
    data: bytes
    codes: tuple[int, ...] | None  # the error codes that answer it right (None: any error)
    msg_id: int | None = None  # the reply's id (None: an error without id)
    initialize: bool = False  # sent after initialize
    fatal: bool = False  # the stream cannot be followed after it: the daemon may hang up


def _j(obj: Any) -> bytes:
    return frame(json.dumps(obj).encode())


E = ErrorCode
BAD_FRAMES: dict[str, BadFrame] = {
    "bad_json": BadFrame(frame(b'{"jsonrpc": "2.0", "id": 1, "method": '), (E.PARSE_ERROR,)),
    "batch": BadFrame(_j([{"jsonrpc": "2.0", "id": 1, "method": "warmspec/status"}]), (E.INVALID_REQUEST,)),
    "not_an_object": BadFrame(_j("hello"), (E.INVALID_REQUEST,)),
    "no_content_length": BadFrame(b"Content-Type: application/json\r\n\r\n", None),
    "bad_content_length": BadFrame(b"Content-Length: 12abc\r\n\r\n", None),
    "content_length_of_3000_digits": BadFrame(b"Content-Length: " + b"9" * 3000 + b"\r\n\r\n", None),
    "huge_content_length": BadFrame(b"Content-Length: 999999999999\r\n\r\n", None, fatal=True),
    "header_line_too_long": BadFrame(b"X-Junk: " + b"a" * (70 << 10) + b"\r\n\r\n", None, fatal=True),
    "bad_envelope": BadFrame(_j({"jsonrpc": "1.0", "id": FIRST_FUZZ_ID, "method": "warmspec/status"}),
                             (E.INVALID_REQUEST,), FIRST_FUZZ_ID),
    "before_initialize": BadFrame(_j({"jsonrpc": "2.0", "id": FIRST_FUZZ_ID, "method": "warmspec/status"}),
                                  (E.SERVER_NOT_INITIALIZED,), FIRST_FUZZ_ID),
    "unknown_method": BadFrame(_j({"jsonrpc": "2.0", "id": FIRST_FUZZ_ID, "method": "warmspec/nope"}),
                               (E.METHOD_NOT_FOUND,), FIRST_FUZZ_ID, initialize=True),
    "invalid_params": BadFrame(_j({"jsonrpc": "2.0", "id": FIRST_FUZZ_ID, "method": "warmspec/chat",
                                   "params": {"messages": "hi"}}), (E.INVALID_PARAMS,), FIRST_FUZZ_ID, True),
    "zero_max_tokens": BadFrame(_j({"jsonrpc": "2.0", "id": FIRST_FUZZ_ID, "method": "warmspec/chat", "params": {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}}), (E.INVALID_PARAMS,), FIRST_FUZZ_ID, True),
    "notification_with_id": BadFrame(_j({"jsonrpc": "2.0", "id": FIRST_FUZZ_ID, "method": "initialized",
                                         "params": {}}), (E.INVALID_REQUEST,), FIRST_FUZZ_ID, True),
    "inline_for_unopened_document": BadFrame(_j({
        "jsonrpc": "2.0", "id": FIRST_FUZZ_ID, "method": "textDocument/inlineCompletion", "params": {
            "textDocument": {"uri": "file:///nowhere/never_opened.py"}, "position": {"line": 0, "character": 0},
            "context": {"triggerKind": TRIGGER_AUTOMATIC}}}), (E.INVALID_PARAMS,), FIRST_FUZZ_ID, True),
}

_CHAT = {"model": "warmspec", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
# (method, path, body, headers, statuses that answer it right)
BAD_HTTP: dict[str, tuple[str, str, bytes, dict[str, str], tuple[int, ...]]] = {
    "http_bad_json": ("POST", "/v1/chat/completions", b'{"model": "x", "messages": [', {}, (400,)),
    "http_no_messages": ("POST", "/v1/chat/completions", b'{"model": "x"}', {}, (400,)),
    "http_zero_max_tokens": ("POST", "/v1/chat/completions", json.dumps(dict(_CHAT, max_tokens=0)).encode(), {},
                             (400,)),
    "http_two_choices": ("POST", "/v1/chat/completions", json.dumps(dict(_CHAT, n=2)).encode(), {}, (400,)),
    "http_messages_without_max_tokens": ("POST", "/v1/messages",
                                         json.dumps({"model": "x", "messages": _CHAT["messages"]}).encode(), {},
                                         (400,)),
    "http_unknown_route": ("POST", "/v1/nope", b"{}", {}, (404,)),
    "http_wrong_method": ("GET", "/v1/chat/completions", b"", {}, (405,)),
    # issue 9, item 7: what a web page can send without a CORS preflight, and DNS rebinding
    "http_text_plain": ("POST", "/v1/chat/completions", json.dumps(_CHAT).encode(),
                        {"Content-Type": "text/plain"}, tuple(range(400, 500))),
    "http_foreign_host": ("POST", "/v1/chat/completions", json.dumps(_CHAT).encode(),
                          {"Host": "rebound.example.com"}, tuple(range(400, 500))),
}


async def fuzz(ctx: Ctx) -> None:
    """One bad frame or request every couple of seconds, each kind in turn (seeded order)."""
    import aiohttp

    rng = random.Random(f"{ctx.settings.seed}/fuzz")
    numbers = itertools.count()
    kinds = [*BAD_FRAMES, *BAD_HTTP]
    rng.shuffle(kinds)
    async with aiohttp.ClientSession() as session:
        for n in itertools.count():
            if not ctx.running():
                break
            kind = kinds[n % len(kinds)]
            if kind in BAD_FRAMES:
                await bad_frame(ctx, kind, BAD_FRAMES[kind], numbers)
            else:
                await bad_http(ctx, session, kind, BAD_HTTP[kind], numbers)
            await pause(ctx, rng.uniform(1.0, 3.0))


async def bad_frame(ctx: Ctx, kind: str, bad: BadFrame, numbers: Any) -> None:
    """On a fresh connection: the bad frame must get an error; then, unless it was fatal, the
    same connection must still answer ``warmspec/status``."""
    s = ctx.settings
    req = Req(ctx, "fuzz", next(numbers), "malformed_rpc", "unix", intent="malformed")
    try:
        conn = await Rpc.unix(ctx.daemon.socket, "fuzz")
    except OSError as e:
        req.done("failed", error=f"{kind}: cannot connect: {e}")
        return
    try:
        if bad.initialize:
            await conn.initialize("soak-fuzz", s.request_timeout_s)
        fut = conn.expect(bad.msg_id) if bad.msg_id is not None else None
        try:
            await conn.write(bad.data)
        except Closed:
            if not bad.fatal:  # a fatal frame may be refused before it is all written
                raise
        env = await reply(conn, fut if fut is not None else conn.anonymous.get(), s.request_timeout_s)
        if env.error is msgspec.UNSET:
            req.done("failed", error=f"{kind}: answered with a result, not an error")
            return
        if bad.codes is not None and env.error.code not in bad.codes:
            req.done("failed", error=f"{kind}: error {env.error.code} ({env.error.message}), expected "
                                     f"{' or '.join(map(str, bad.codes))}")
            return
        if not bad.fatal:
            if not bad.initialize:
                await conn.initialize("soak-fuzz", s.request_timeout_s)
            await conn.call("warmspec/status", None, s.request_timeout_s)
        req.done("malformed", error=f"{kind}: {env.error.code} {env.error.message[:120]}")
    except (Closed, RpcFailure, asyncio.TimeoutError) as e:
        req.done("failed", error=f"{kind}: {failure(e)}")
    finally:
        conn.abort()


async def bad_http(ctx: Ctx, session: Any, kind: str, bad: tuple, numbers: Any) -> None:
    """The bad request must get a 4xx in the API's error format, and ``/health`` still answer."""
    import aiohttp

    method, path, body, headers, statuses = bad
    req = Req(ctx, "fuzz", next(numbers), "malformed_http", "http", intent="malformed")
    timeout = aiohttp.ClientTimeout(total=ctx.settings.request_timeout_s)
    try:
        async with session.request(method, ctx.daemon.http + path, data=body or None,
                                   headers={"Content-Type": "application/json", **headers}, timeout=timeout) as resp:
            text = await resp.text()
            if resp.status not in statuses:
                req.done("failed", error=f"{kind}: HTTP {resp.status} ({text[:160]}), expected "
                                         f"{statuses[0]}{'-' + str(statuses[-1]) if len(statuses) > 1 else ''}")
                return
            body = json.loads(text)
            if not isinstance(body, dict) or "error" not in body:
                req.done("failed", error=f"{kind}: HTTP {resp.status} without an error body: {text[:160]}")
                return
        async with session.get(ctx.daemon.http + "/health", timeout=timeout) as health:
            if health.status != 200:
                req.done("failed", error=f"{kind}: /health answered {health.status} afterwards")
                return
        req.done("malformed", error=f"{kind}: HTTP {resp.status}")
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        req.done("failed", error=f"{kind}: {failure(e)}")


# -- the sampler -----------------------------------------------------------------------------------


async def sample(ctx: Ctx, conn: Rpc | None) -> Status | None:
    s = ctx.settings
    rss = rss_bytes(ctx.daemon.pid)
    if rss is None or not ctx.daemon.alive():
        ctx.daemon_died = True
        ctx.stop.set()
        return None
    status, latency = None, None
    if conn is not None and not conn.closed.is_set():
        t = time.monotonic()
        try:
            status = msgspec.convert(await conn.call("warmspec/status", None, s.request_timeout_s), Status)
            latency = round(time.monotonic() - t, 4)
        except (Closed, RpcFailure, asyncio.TimeoutError, msgspec.ValidationError):
            status = None
    ctx.memory.append(MemorySample(
        t_s=round(ctx.now(), 2), rss_bytes=rss, status_latency_s=latency,
        queue=status.queue if status else None, active=status.active if status else None,
        prefix_cache_bytes=status.prefix_cache.bytes if status else None,
        prefix_cache_entries=status.prefix_cache.entries if status else None,
        workspace_bytes=status.workspace_bytes if status else None,
        mlx_active_bytes=status.memory.mlx_active_bytes if status else None,
        mlx_cache_bytes=status.memory.mlx_cache_bytes if status else None))
    return status


async def sampler(ctx: Ctx) -> None:
    conn: Rpc | None = None
    last_print = 0.0
    while ctx.running():
        if conn is None or conn.closed.is_set():
            try:
                conn = await Rpc.unix(ctx.daemon.socket, "sampler")
                await conn.initialize("soak-sampler", ctx.settings.request_timeout_s)
            except (OSError, Closed, RpcFailure, asyncio.TimeoutError):
                conn = None
        await sample(ctx, conn)
        if ctx.now() - last_print >= 30:
            last_print = ctx.now()
            print(f"warmspec soak: {ctx.now():.0f}/{ctx.settings.seconds:.0f} s, {progress(ctx)}", file=sys.stderr)
        await pause(ctx, ctx.settings.sample_s)
    if conn is not None:
        conn.abort()


def progress(ctx: Ctx) -> str:
    counts = {o: sum(r.outcome == o for r in ctx.records) for o in ("ok", "failed", "cancelled", "malformed")}
    rss = ctx.memory[-1].rss_bytes / 2**20 if ctx.memory else 0
    return (f"{len(ctx.records)} requests ({', '.join(f'{n} {o}' for o, n in counts.items())}), "
            f"{ctx.keystrokes} keystrokes, RSS {rss:.0f} MiB")


# -- the run ---------------------------------------------------------------------------------------


async def load(ctx: Ctx) -> Status | None:
    """All actors for ``seconds``; then the drain; then the daemon's final status."""
    s = ctx.settings
    editors = [Editor(ctx, i) for i in range(s.editors)]
    actors = [asyncio.create_task(e.run(), name=e.name) for e in editors]
    actors += [asyncio.create_task(agent(ctx, j), name=f"agent-{j}") for j in range(s.agents)]
    actors += [asyncio.create_task(chaos(ctx), name="chaos"), asyncio.create_task(fuzz(ctx), name="fuzz")]
    sampling = asyncio.create_task(sampler(ctx), name="sampler")
    await pause(ctx, s.seconds)
    ctx.stop.set()
    # Actors stop making requests; those in flight get the drain to finish, then are cut.
    done, cut = await asyncio.wait(actors, timeout=s.drain_s + s.request_timeout_s / 10)
    for task in cut:
        task.cancel()
    await asyncio.gather(*cut, return_exceptions=True)
    for req in list(ctx.open):
        req.done("cancelled", error="still in flight when the drain ended", intent="cut")
    await sampling
    for task in done:
        task.result()  # a bug in the harness: loud
    conn = None
    status = None
    if ctx.daemon.alive():
        try:
            conn = await Rpc.unix(ctx.daemon.socket, "final")
            await conn.initialize("soak-final", s.request_timeout_s)
        except (OSError, Closed, RpcFailure, asyncio.TimeoutError):
            conn = None
        status = await sample(ctx, conn)
        if conn is not None:
            conn.abort()
    return status


async def replay(ctx: Ctx, daemon: Daemon) -> tuple[list[ReplayRecord], Status | None]:
    """Every distinct greedy answer of the load, asked again alone, one at a time."""
    import aiohttp

    s = ctx.settings
    groups: dict[str, list[RequestRecord]] = {}
    for r in sorted(ctx.records, key=lambda r: r.started_s):
        if r.key is not None:
            groups.setdefault(r.key, []).append(r)
    out = []
    conn: Rpc | None = None
    async with aiohttp.ClientSession() as session:
        for i, (key, recs) in enumerate(groups.items()):
            spec = ctx.specs[key]
            if conn is None or conn.closed.is_set():
                conn = await Rpc.unix(daemon.socket, "replay")
                await conn.initialize("soak-replay", s.request_timeout_s, roots=[ctx.workspace], inline=ctx.inline)
            if isinstance(spec, HttpSpec):
                ans = await http_generate(session, daemon.http, spec, s.request_timeout_s)
            elif isinstance(spec, RpcSpec):
                ans = await rpc_generate(conn, spec, s.request_timeout_s)
            else:
                ans = await inline_alone(conn, spec, s.request_timeout_s)
            out.append(compare(key, recs, ans))
            if (i + 1) % 20 == 0:
                print(f"warmspec soak: replayed {i + 1}/{len(groups)}", file=sys.stderr)
    status = None
    if conn is not None and not conn.closed.is_set():
        try:
            status = msgspec.convert(await conn.call("warmspec/status", None, s.request_timeout_s), Status)
        except (Closed, RpcFailure, asyncio.TimeoutError, msgspec.ValidationError):
            status = None
        conn.abort()
    return out, status


async def inline_alone(conn: Rpc, spec: InlineSpec, timeout: float) -> Answer:
    try:
        await conn.notify("textDocument/didOpen", {"textDocument": {
            "uri": spec.uri, "languageId": "python", "version": 1, "text": spec.text}})
        result = await conn.call("textDocument/inlineCompletion", {
            "textDocument": {"uri": spec.uri}, "position": {"line": spec.line, "character": spec.character},
            "context": {"triggerKind": TRIGGER_AUTOMATIC}}, timeout)
        await conn.notify("textDocument/didClose", {"textDocument": {"uri": spec.uri}})
    except (Closed, RpcFailure, asyncio.TimeoutError) as e:
        return Answer(error=failure(e))
    items = (result or {}).get("items") or []
    return Answer(text=items[0]["insertText"] if items else "")


def compare(key: str, recs: list[RequestRecord], alone: Answer) -> ReplayRecord:
    """The answer alone against every answer under load with the same key: the same text, and
    the same token count where both are known."""
    kind = recs[0].kind
    ids = [r.id for r in recs]
    if alone.error is not None:
        return ReplayRecord(key=key, kind=kind, load_ids=ids, equal=False, error=alone.error)
    differing = [r for r in recs if r.text != alone.text
                 or (r.tokens is not None and alone.tokens is not None and r.tokens != alone.tokens)]
    difference = None
    if differing:
        a, b = differing[0].text or "", alone.text or ""
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        difference = (f"{differing[0].id}: from character {at}: under load {a[at:at + 60]!r} "
                      f"({differing[0].tokens} tokens), alone {b[at:at + 60]!r} ({alone.tokens} tokens)")
    return ReplayRecord(key=key, kind=kind, load_ids=ids, equal=not differing, text=alone.text,
                        tokens=alone.tokens, differing=[r.id for r in differing], difference=difference)


# -- summaries and the verdict ---------------------------------------------------------------------


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Nearest rank: the smallest sample with at least ``q`` of the samples at or below it."""
    if not xs:
        return None
    ordered = sorted(xs)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summarize(records: Sequence[RequestRecord]) -> list[KindSummary]:
    out = []
    for kind in sorted({r.kind for r in records}):
        rs = [r for r in records if r.kind == kind]
        ok = [r for r in rs if r.outcome == "ok"]
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        lat = [r.latency_s for r in ok if r.latency_s is not None]
        cancel = [r.cancel_latency_s for r in rs if r.cancel_latency_s is not None]
        out.append(KindSummary(
            kind=kind, requests=len(rs), ok=len(ok), failed=sum(r.outcome == "failed" for r in rs),
            cancelled=sum(r.outcome == "cancelled" for r in rs), malformed=sum(r.outcome == "malformed" for r in rs),
            ttft_p50_s=percentile(ttft, 0.5), ttft_p99_s=percentile(ttft, 0.99),
            latency_p50_s=percentile(lat, 0.5), latency_p99_s=percentile(lat, 0.99),
            cancel_latency_p50_s=percentile(cancel, 0.5), cancel_latency_p99_s=percentile(cancel, 0.99)))
    return out


def window_peaks(samples: Sequence[MemorySample], start_s: float) -> list[int]:
    """The highest resident memory in each ``RSS_WINDOW_S`` window from ``start_s`` (a last window
    whose samples cover less than half of one -- the sample taken once the load has drained -- is
    merged into the one before).

    Why peaks of windows and not every sample: under load a sample holds whatever the requests in
    flight hold at that instant (their caches, the passes' buffers): on this CPU MLX's active memory
    alone spread 12-15% between samples while the windows' peaks stayed within 7%. Memory that is
    not given back -- a leak, an unbounded store -- raises the peaks window after window."""
    windows: dict[int, list[MemorySample]] = {}
    for m in samples:
        if m.t_s >= start_s:
            windows.setdefault(int((m.t_s - start_s) // RSS_WINDOW_S), []).append(m)
    groups = [windows[i] for i in sorted(windows)]
    if len(groups) > 1 and groups[-1][-1].t_s - groups[-1][0].t_s < RSS_WINDOW_S / 2:
        groups[-2:] = [groups[-2] + groups[-1]]
    return [max(m.rss_bytes for m in g) for g in groups]


def judge(requests: Sequence[RequestRecord], daemons: Sequence[DaemonRun], memory: Sequence[MemorySample],
          replays: Sequence[ReplayRecord], warmup_s: float) -> list[Criterion]:
    """The issue's criteria, and a clean daemon log and exit, each with what decided it."""
    load = next((d for d in daemons if d.role == "load"), None)
    status = load.status if load else None
    failed = [r for r in requests if r.outcome == "failed"]
    daemon_failed = status.requests_failed if status else None
    detail = f"{len(failed)} of {len(requests)} requests failed"
    if failed:
        detail += f" (first: {failed[0].id} {failed[0].kind}: {failed[0].error})"
    detail += f"; the daemon counted {daemon_failed if daemon_failed is not None else '?'} failed jobs"
    if load is not None and not load.alive:
        detail += "; THE DAEMON DIED during the load"
    criteria = [Criterion(name="no unexpected failures", detail=detail,
                          passed=not failed and daemon_failed == 0 and load is not None and load.alive)]

    resets = status.engine_resets if status else None
    criteria.append(Criterion(name="no engine resets", passed=resets == 0,
                              detail=f"{resets if resets is not None else 'unknown (no final status)'} engine resets"))

    differing = [r for r in replays if not r.equal]
    compared = sum(len(r.load_ids) for r in replays)
    detail = (f"{len(replays) - len(differing)} of {len(replays)} distinct greedy requests ({compared} under load) "
              "answered the same alone")
    if differing:
        first = differing[0]
        detail += f"; first: {first.kind} {first.difference or first.error}"
    if not replays:
        detail = "no greedy request got its answer under load: nothing to compare"
    criteria.append(Criterion(name="greedy answers equal to alone", passed=bool(replays) and not differing,
                              detail=detail))

    after = [m for m in memory if m.t_s >= warmup_s]
    peaks = window_peaks(after, warmup_s)
    if len(after) < 2 or len(peaks) < 2:
        criteria.append(Criterion(name="resident memory flat after warm-up", passed=False,
                                  detail=(f"{len(after)} samples after the warm-up ({warmup_s:.0f} s): too few "
                                          f"(the verdict compares windows of {RSS_WINDOW_S:.0f} s: two at least)")))
    else:
        rss = [m.rss_bytes for m in after]
        spread = (max(rss) - min(rss)) / min(rss)
        drift = (max(peaks) - min(peaks)) / min(peaks)
        criteria.append(Criterion(
            name="resident memory flat after warm-up", passed=drift <= RSS_TOLERANCE,
            detail=(f"after {warmup_s:.0f} s: the peaks of {len(peaks)} windows of {RSS_WINDOW_S:.0f} s span "
                    f"{min(peaks) / 2**20:.0f}-{max(peaks) / 2**20:.0f} MiB, {drift:.1%} (at most "
                    f"{RSS_TOLERANCE:.0%}); the {len(rss)} samples {min(rss) / 2**20:.0f}-"
                    f"{max(rss) / 2**20:.0f} MiB ({spread:.1%}: the requests in flight)")))

    problems = []
    for d in daemons:
        if d.log_errors:
            problems.append(f"{d.role} daemon: {len(d.log_errors)} errors in its log (first: {d.log_errors[0]})")
        if d.alive and d.exit_code != 0:
            problems.append(f"{d.role} daemon: exit status {d.exit_code} after SIGTERM")
    criteria.append(Criterion(name="daemon log clean, clean exit", passed=not problems and bool(daemons),
                              detail="; ".join(problems) or "no errors logged; exit status 0 on SIGTERM"))
    return criteria


# -- report ----------------------------------------------------------------------------------------


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(cell(v) for v in row) + " |" for row in rows]


def _s(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def _mib(x: int | None) -> str:
    return "" if x is None else f"{x / 2**20:.0f}" if x >= 10 << 20 else f"{x / 2**20:.2f}"


def verdict(res: SoakResults) -> str:
    failed = [c.name for c in res.criteria if not c.passed]
    return "**PASS**: every criterion holds" if res.passed else f"**FAIL**: {'; '.join(failed)}"


def report(res: SoakResults) -> str:
    s, m = res.settings, res.machine
    load = next((d for d in res.daemons if d.role == "load"), None)
    st = load.status if load else None
    lines = [
        f"# warmspec soak: {res.model}, {s.seconds:.0f} s, seed {s.seed}", "",
        f"Verdict: {verdict(res)}", "",
        f"- machine: {m.cpu}, {m.cores} cores, {m.os}; {m.device}, {m.blas}; MLX {m.mlx}, mlx-lm {m.mlx_lm}, "
        f"Python {m.python}; load average {m.load_avg:.2f} at start",
        (f"- started {res.started_at}; the load ran {res.load_s:.0f} s (drain included); the harness itself "
         f"used {res.harness_cpu_s:.0f} s of CPU (clients, replay, report; not the daemons)"),
        (f"- load: {s.editors} editors ({s.relay_editors} through `warmspec lsp`), {s.agents} agents, chaos "
         f"(cancels, hang-ups), fuzz (bad frames and requests); chats max_tokens {s.max_tokens}, ghost text "
         f"{s.inline_prefix_chars}/{s.inline_suffix_chars} characters around the cursor, {s.inline_max_tokens} "
         f"tokens; tool results {s.tool_chars} characters, long prompts {s.long_prompt_chars}; prefix budget "
         f"{_mib(s.prefix_budget_bytes)} MiB; {s.workspace_files} workspace files; "
         f"{res.keystrokes} keystrokes (didChange)"
         + (f"; daemon arguments `{' '.join(s.daemon_args)}`" if s.daemon_args else "")),
        f"- replays: {res.replay_daemon}", "",
        "## Criteria", "",
    ]
    lines += _table(("criterion", "holds", "detail"),
                    [(c.name, "yes" if c.passed else "**NO**", c.detail) for c in res.criteria])
    lines += ["", "## Requests per kind", "",
              ("ok: answered; cancelled: cancelled on purpose (superseded ghost text, $/cancelRequest, "
               "hang-ups; the cancel latency is from $/cancelRequest to the daemon's reply); malformed: a bad "
               "frame or request answered with the right error; failed: anything else. TTFT: to the first "
               "streamed text (streamed kinds); latency: to the whole answer. Times of ok requests, in seconds."), ""]
    lines += _table(("kind", "requests", "ok", "failed", "cancelled", "malformed", "TTFT p50", "TTFT p99",
                     "latency p50", "latency p99", "cancel latency p50", "p99"),
                    [(k.kind, k.requests, k.ok, k.failed, k.cancelled, k.malformed, _s(k.ttft_p50_s),
                      _s(k.ttft_p99_s), _s(k.latency_p50_s), _s(k.latency_p99_s), _s(k.cancel_latency_p50_s),
                      _s(k.cancel_latency_p99_s)) for k in res.kinds])
    failed = [r for r in res.requests if r.outcome == "failed"]
    lines += ["", f"## Unexpected failures ({len(failed)})", ""]
    lines += _table(("request", "kind", "at s", "error"),
                    [(r.id, r.kind, f"{r.started_s:.1f}", r.error) for r in failed[:100]]) if failed else ["None."]
    if len(failed) > 100:
        lines.append(f"... and {len(failed) - 100} more in results.json")
    lines += ["", "## The daemon", ""]
    for d in res.daemons:
        ds = d.status
        lines.append(f"- {d.role}: pid {d.pid}, ready after {d.ready_s:.1f} s, "
                     + ("died before the end, " if not d.alive else f"exit status {d.exit_code} on SIGTERM after "
                        f"{_s(d.stop_s)} s, ")
                     + (f"{ds.requests_completed} jobs completed, {ds.requests_failed} failed, "
                        f"{ds.engine_resets} engine resets; prefix cache {ds.prefix_cache.hits} hits, "
                        f"{ds.prefix_cache.misses} misses, {ds.prefix_cache.evictions} evictions" if ds else
                        "no final status")
                     + f"; log {d.log}")
        lines += [f"  - {e}" for e in d.log_errors[:20]]
    lines += ["", "## Resident memory", "",
              (f"VmRSS of the daemon every {s.sample_s:g} s; warm-up: the first {s.warmup_fraction:.0%} of the "
               f"run ({res.warmup_s:.0f} s), where the model, caches and allocator pools fill; after it the "
               f"peaks of {RSS_WINDOW_S:.0f}-second windows may span at most {RSS_TOLERANCE:.0%} of their "
               "minimum (a sample holds what the requests in flight hold). Status latency: a "
               "warmspec/status round trip (a stalled event loop shows here)."
               + (" Plot: rss.png." if (res.memory and _has_matplotlib()) else "")), ""]
    step = max(1, math.ceil(len(res.memory) / 20))
    shown = list(res.memory[::step]) + ([res.memory[-1]] if res.memory and (len(res.memory) - 1) % step else [])
    lines += _table(("t s", "RSS MiB", "MLX active MiB", "MLX cache MiB", "prefix cache MiB", "entries",
                     "workspace MiB", "queue", "status latency s"),
                    [(f"{x.t_s:.0f}", _mib(x.rss_bytes), _mib(x.mlx_active_bytes), _mib(x.mlx_cache_bytes),
                      _mib(x.prefix_cache_bytes), x.prefix_cache_entries
                      if x.prefix_cache_entries is not None else "", _mib(x.workspace_bytes),
                      x.queue if x.queue is not None else "", _s(x.status_latency_s)) for x in shown])
    equal = sum(r.equal for r in res.replays)
    lines += ["", "## Replay: each greedy answer against the same request alone", "",
              f"{equal} of {len(res.replays)} distinct requests answered the same alone "
              f"({sum(len(r.load_ids) for r in res.replays)} answers under load)."]
    bad = [r for r in res.replays if not r.equal]
    if bad:
        lines += [""] + _table(("kind", "load requests", "differing", "where"),
                               [(r.kind, ", ".join(r.load_ids[:5]), ", ".join(r.differing[:5]),
                                 r.difference or f"replay failed: {r.error}") for r in bad[:50]])
    by_kind: dict[str, list[ReplayRecord]] = {}
    for r in res.replays:
        by_kind.setdefault(r.kind, []).append(r)
    if by_kind:
        lines += [""] + _table(("kind", "distinct", "equal"),
                               [(k, len(v), sum(r.equal for r in v)) for k, v in sorted(by_kind.items())])
    lines += ["", f"Verdict: {verdict(res)}", ""]
    if st is None:
        lines.append("(no final status from the load daemon)")
    return "\n".join(lines) + "\n"


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(res: SoakResults, path: Path) -> None:
    if not res.memory or not _has_matplotlib():
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    t = [x.t_s for x in res.memory]
    ax.plot(t, [x.rss_bytes / 2**20 for x in res.memory], label="daemon RSS")
    prefix = [(x.t_s, x.prefix_cache_bytes / 2**20) for x in res.memory if x.prefix_cache_bytes is not None]
    if prefix:
        ax.plot(*zip(*prefix), label="prefix cache")
    ax.axvline(res.warmup_s, color="grey", linestyle="--", linewidth=1, label="end of warm-up")
    ax.set(xlabel="seconds", ylabel="MiB", title=f"warmspec soak: {res.model}, seed {res.settings.seed}")
    ax.legend(loc="best", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(res: SoakResults, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_bytes(msgspec.json.format(msgspec.json.encode(res), indent=2))
    (out / "report.md").write_text(report(res))
    plot(res, out / "rss.png")


def machine(status: Status | None) -> Machine:
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu

    def version(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "?"

    return Machine(cpu=cpu, cores=os.cpu_count() or 0, os=platform.platform(), python=platform.python_version(),
                   mlx=version("mlx"), mlx_lm=version("mlx-lm"), device=status.model.device if status else "?",
                   blas=status.blas if status else "?", load_avg=os.getloadavg()[0])


# -- command line ----------------------------------------------------------------------------------


def soak(settings: SoakSettings, out: Path) -> SoakResults:
    """The load, then the replay; the workspace copy is removed afterwards (the seed makes it
    again), the logs stay in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    workspace = out / "workspace"
    files = pick_files(settings.workspace_files, settings.seed, workspace)
    try:
        return _soak(settings, out, workspace, files)
    finally:
        shutil.rmtree(workspace)


def _soak(settings: SoakSettings, out: Path, workspace: Path, files: list[Path]) -> SoakResults:
    texts = {f: f.read_text() for f in files}
    inline = wire.InlineCompletionSettings(prefix_chars=settings.inline_prefix_chars,
                                           suffix_chars=settings.inline_suffix_chars,
                                           max_tokens=settings.inline_max_tokens)
    load_avg = os.getloadavg()[0]
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    print(f"warmspec soak: starting the daemon (log {out / 'daemon-load.log'})", file=sys.stderr)
    daemon = start_daemon("load", out, settings, workspace)
    daemons: list[DaemonRun] = []
    try:
        ctx = Ctx(settings, out, workspace, files, texts, daemon, inline)
        status = asyncio.run(load(ctx))
    finally:
        daemons.append(stop_daemon(daemon, None))
    daemons[0].status = status
    load_s = ctx.now()
    print(f"warmspec soak: load done, {progress(ctx)}; replaying {len(ctx.specs)} distinct greedy requests "
          "alone on a fresh daemon", file=sys.stderr)
    fresh = start_daemon("replay", out, settings, workspace)
    replay_status = None
    try:
        replays, replay_status = asyncio.run(replay(ctx, fresh))
    finally:
        daemons.append(stop_daemon(fresh, None))
    daemons[1].status = replay_status
    warmup_s = settings.warmup_fraction * settings.seconds
    usage = resource.getrusage(resource.RUSAGE_SELF)
    records = sorted(ctx.records, key=lambda r: r.started_s)
    m = machine(status)
    m.load_avg = load_avg
    criteria = judge(records, daemons, ctx.memory, replays, warmup_s)
    return SoakResults(
        settings=settings, machine=m, model=status.model.id if status else (settings.model or "default"),
        started_at=started, load_s=round(load_s, 1), warmup_s=warmup_s,
        harness_cpu_s=round(usage.ru_utime + usage.ru_stime, 1),
        replay_daemon=("a fresh daemon, started as the load's was: the load's own would answer ghost text from "
                       "its completion cache and resume prompts from prefix states built under load, comparing "
                       "a state corrupted under load with itself"),
        files=[f.name for f in files], keystrokes=ctx.keystrokes, daemons=daemons, requests=records, kinds=summarize(records),
        memory=ctx.memory, replays=replays, criteria=criteria, passed=all(c.passed for c in criteria))


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "soak", help="drive one daemon with a mixed editor/agent load and check it holds up",
        description="Start a daemon, drive it over its socket, stdio relays and HTTP with a seeded load "
                    "(editors typing and asking for ghost text, agents' multi-turn chats with tool reads, "
                    "cancellations, hang-ups, malformed frames, prefix-cache eviction) for --seconds, replay "
                    "every greedy answer alone on a fresh daemon, and write DIR/results.json, DIR/report.md "
                    "and DIR/rss.png. Exit status 1 when a criterion fails.")
    p.add_argument("--seconds", type=float, default=600.0, help="how long the load runs (default 600)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR")
    p.add_argument("--seed", type=int, default=0, help="the same seed makes the same requests")
    p.add_argument("--model", "-m", default=None, help="the daemon's --model (default: the embedded one)")
    p.add_argument("--editors", type=int, default=3)
    p.add_argument("--relay-editors", type=int, default=1, help="of the editors, how many use `warmspec lsp`")
    p.add_argument("--agents", type=int, default=3, help="agents: OpenAI HTTP, Anthropic HTTP, socket, in turn")
    p.add_argument("--max-tokens", type=int, default=24, help="most tokens of a chat answer")
    p.add_argument("--inline-max-tokens", type=int, default=12)
    p.add_argument("--inline-prefix-chars", type=int, default=1000)
    p.add_argument("--inline-suffix-chars", type=int, default=300)
    p.add_argument("--tool-chars", type=int, default=1200, help="most characters of a file in a tool result")
    p.add_argument("--long-prompt-chars", type=int, default=5000, help="prompts cancelled during prefill")
    p.add_argument("--prefix-budget", type=int, default=96 << 20, metavar="BYTES",
                   help="the daemon's prefix-cache budget (default 96 MiB: ~2000 tokens of the default "
                        "model's states, so conversations evict each other)")
    p.add_argument("--workspace-files", type=int, default=24)
    p.add_argument("--sample-s", type=float, default=5.0, help="resident memory every this many seconds")
    p.add_argument("--drain-s", type=float, default=60.0,
                   help="after the load, how long requests in flight may take to finish")
    p.add_argument("--request-timeout", type=float, default=300.0, metavar="S",
                   help="a request without its answer after S seconds has failed")
    p.add_argument("--daemon-arg", action="append", default=[], metavar="ARG", dest="daemon_args",
                   help="one more `warmspec serve` argument for both daemons, repeatable; a value that "
                        "starts with a dash needs the = form (--daemon-arg=--prefix-disk=0: no disk tier)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.seconds <= 0 or args.editors < 0 or args.agents < 0 or not 0 <= args.relay_editors <= args.editors:
        print("warmspec soak: --seconds must be positive, --relay-editors at most --editors", file=sys.stderr)
        return 2
    settings = SoakSettings(
        seconds=args.seconds, seed=args.seed, model=args.model, editors=args.editors,
        relay_editors=args.relay_editors, agents=args.agents, max_tokens=args.max_tokens,
        inline_prefix_chars=args.inline_prefix_chars, inline_suffix_chars=args.inline_suffix_chars,
        inline_max_tokens=args.inline_max_tokens, tool_chars=args.tool_chars,
        long_prompt_chars=args.long_prompt_chars, prefix_budget_bytes=args.prefix_budget,
        workspace_files=args.workspace_files, sample_s=args.sample_s, warmup_fraction=0.2,
        drain_s=args.drain_s, request_timeout_s=args.request_timeout, daemon_args=args.daemon_args)
    # Absolute: the daemons and `warmspec lsp` relays run elsewhere than here, and a relative
    # workspace or socket path would name another place for them (a relative --out once sent
    # every workspace read to docs/…/workspace/docs/…/workspace).
    args.out = args.out.resolve()
    try:
        res = soak(settings, args.out)
    except SoakError as e:
        print(f"warmspec soak: {e}", file=sys.stderr)
        return 1
    write(res, args.out)
    for c in res.criteria:
        print(f"{'ok  ' if c.passed else 'FAIL'} {c.name}: {c.detail}")
    print(f"{verdict(res).replace('**', '')} ({args.out / 'report.md'})")
    return 0 if res.passed else 1
