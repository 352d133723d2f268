"""A small blocking JSON-RPC client for the daemon: what ``warmspec ask`` speaks.

Plain sockets and msgspec -- no asyncio, pygls or MLX -- so a question costs Python's start-up and
not a model load. Frames are parsed from the client's own buffer, never half-read, so an
interrupted wait (Ctrl-C sets a flag; reads time out to look at it) leaves the stream in step and
the client can still send ``$/cancelRequest`` and read the reply.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import msgspec

from warmspec_protocol import rpc as wire

T = TypeVar("T")

POLL_S = 0.1  # how often a wait looks at its ``interrupted`` flag
CANCEL_GRACE_S = 10.0  # how long to wait for the reply to $/cancelRequest


class RpcError(Exception):
    """The daemon answered with a JSON-RPC error."""

    def __init__(self, code: int, message: str):
        super().__init__(f"{message} ({code})")
        self.code = code
        self.message = message


class Client:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = bytearray()
        self._ids = itertools.count(1)

    @classmethod
    def unix(cls, path: Path | str, timeout: float | None = None) -> "Client":
        """Connect to the daemon's socket; ``OSError`` when nothing listens there."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
        except OSError:
            sock.close()
            raise
        sock.settimeout(None)
        return cls(sock)

    @classmethod
    def tcp(cls, host: str, port: int, timeout: float | None = None) -> "Client":
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.settimeout(None)
        return cls(sock)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- calls ---------------------------------------------------------------------------------------

    def initialize(self, api_key: str | None = None, name: str = "warmspec-cli",
                   roots: Sequence[Path] = ()) -> wire.InitializeResult:
        """``roots``: project directories for the daemon's workspace (added on the Unix socket
        only; see PROTOCOL.md)."""
        options = wire.InitializationOptions(api_key=api_key) if api_key else None
        folders = [wire.WorkspaceFolder(uri=Path(r).absolute().as_uri(), name=Path(r).name) for r in roots]
        params = wire.InitializeParams(process_id=os.getpid(), client_info=wire.ClientInfo(name=name),
                                       workspace_folders=folders or None, initialization_options=options)
        result = self.call("initialize", params, wire.InitializeResult)
        self.notify("initialized", {})
        return result

    def call(self, method: str, params: msgspec.Struct | dict | None, result_type: type[T]) -> T:
        return self.wait(self.start(method, params), result_type)

    def start(self, method: str, params: msgspec.Struct | dict | None) -> int:
        """Send a request; returns its id (for ``wait`` and ``cancel``)."""
        msg_id = next(self._ids)
        self.send(wire.Request(id=msg_id, method=method, params=msgspec.UNSET if params is None else params))
        return msg_id

    def notify(self, method: str, params: msgspec.Struct | dict | None) -> None:
        self.send(wire.Notification(method=method, params=msgspec.UNSET if params is None else params))

    def cancel(self, msg_id: int) -> None:
        self.notify("$/cancelRequest", wire.CancelParams(id=msg_id))

    def wait(self, msg_id: int, result_type: type[T], *,
             on_delta: Callable[[wire.DeltaParams], None] | None = None,
             on_progress: Callable[[wire.ProgressParams], None] | None = None,
             interrupted: Callable[[], bool] | None = None) -> T:
        """Read until the reply to ``msg_id``, passing its deltas to ``on_delta`` (and what the
        daemon does before the first, such as reloading the model, to ``on_progress``). Once
        ``interrupted()`` turns true the request is cancelled on the daemon, and the wait ends
        with its reply (``RpcError`` -32800, or the result if it was already done)."""
        cancelled_at: float | None = None
        while True:
            if interrupted is not None and cancelled_at is None and interrupted():
                self.cancel(msg_id)
                cancelled_at = time.monotonic()
            if cancelled_at is not None and time.monotonic() - cancelled_at > CANCEL_GRACE_S:
                raise TimeoutError("the daemon did not answer the cancellation")
            env = self.read(POLL_S if interrupted is not None else None)
            if env is None:
                continue
            if env.method is not msgspec.UNSET:
                if env.method == "warmspec/delta" and on_delta is not None:
                    delta = msgspec.convert(env.params, wire.DeltaParams)
                    if delta.id == msg_id:
                        on_delta(delta)
                elif env.method == "warmspec/progress" and on_progress is not None:
                    progress = msgspec.convert(env.params, wire.ProgressParams)
                    if progress.id == msg_id:
                        on_progress(progress)
                continue
            if env.id != msg_id:
                continue
            if env.error is not msgspec.UNSET:
                raise RpcError(env.error.code, env.error.message)
            return msgspec.convert(env.result, result_type)

    # -- framing ---------------------------------------------------------------------------------------

    def send(self, message: msgspec.Struct) -> None:
        body = msgspec.json.encode(message)
        self.sock.sendall(b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    def read(self, timeout: float | None = None) -> wire.Envelope | None:
        """The next message, or None when ``timeout`` passes first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (body := self._take_frame()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(1 << 16)
            except TimeoutError:
                return None
            if not data:
                raise ConnectionError("the daemon closed the connection")
            self._buf += data
        return msgspec.json.decode(body, type=wire.Envelope)

    def _take_frame(self) -> bytes | None:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            return None
        length = None
        for line in bytes(self._buf[:end]).split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length is None:
            raise ConnectionError("the daemon sent a frame without Content-Length")
        start = end + 4
        if len(self._buf) < start + length:
            return None
        body = bytes(self._buf[start:start + length])
        del self._buf[:start + length]
        return body
