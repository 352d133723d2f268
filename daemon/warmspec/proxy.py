"""``warmspec lsp``: an editor's language server that is the daemon, reached through this process.

An editor spawns its language server and speaks LSP on the child's stdin and stdout. A model per
editor window would cost each window seconds of loading and a copy of the weights, so this process
loads none: it finds the daemon, or starts it in the background exactly as ``warmspec ask`` does
(connect.py), and relays bytes between stdio and the daemon's Unix socket until either side
closes. The daemon serves the editor like any socket client, and adds the project the editor names
in ``initialize`` to its workspace roots (it does that for local connections only).

The relay reads the editor's frames (``Content-Length`` framing) only to learn LSP's exit status
-- 0 when ``shutdown`` came before ``exit`` -- and to put the api key (``--api-key-file``, else
``$WARMSPEC_API_KEY``) into ``initialize`` when the editor sends no key, as ``ask`` does. Every other frame goes on unchanged; framing it
cannot follow makes it pass the rest of the stream on as it comes, for the daemon to answer.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import sys
import threading

import msgspec

from warmspec_protocol.rpc import ErrorCode

from .client import Client, RpcError
from .connect import check_model, connect_daemon
from .server.daemon import DaemonError, RuntimePaths, api_key_from, claim_stdout, default_lsp_roots

log = logging.getLogger("warmspec.lsp")

CHUNK = 1 << 16
HEADER_LIMIT = 64 << 10  # a header this long without its end is not framing we follow
BODY_LIMIT = 64 << 20  # frames are held until complete; longer ones pass as raw bytes
_HEADER_END = re.compile(rb"\r?\n\r?\n")


class _Method(msgspec.Struct):
    """All the relay needs of a message."""

    method: str | None = None


class EditorStream:
    """The editor-to-daemon byte stream, split into frames to look at them: ``feed`` returns the
    bytes to send on (whole frames; a partial one waits for the rest)."""

    def __init__(self, api_key: str | None = None):
        self.api_key = api_key
        self.shut_down = False  # ``shutdown`` was requested
        self.exited = False  # ``exit`` was sent
        self._buf = bytearray()
        self._raw = False

    def feed(self, data: bytes) -> bytes:
        if self._raw:
            return data
        self._buf += data
        out = bytearray()
        while (piece := self._next()) is not None:
            out += piece
        return bytes(out)

    def rest(self) -> bytes:
        """What is left at the end of input: a partial frame, passed on for the daemon to judge."""
        rest, self._buf = bytes(self._buf), bytearray()
        return rest

    def _next(self) -> bytes | None:
        buf = self._buf
        if not buf:
            return None
        blank = len(buf) - len(buf.lstrip(b"\r\n"))  # blank lines between frames
        if blank:
            return self._take(blank)
        end = _HEADER_END.search(buf)
        if end is None:
            return self._pass_raw() if len(buf) > HEADER_LIMIT else None
        length = _content_length(bytes(buf[:end.start()]))
        if length is None or length > BODY_LIMIT:
            return self._pass_raw()
        if len(buf) < end.end() + length:
            return None
        header_len = end.end()
        frame = self._take(header_len + length)
        return self._look(frame, frame[header_len:])

    def _take(self, n: int) -> bytes:
        piece = bytes(self._buf[:n])
        del self._buf[:n]
        return piece

    def _pass_raw(self) -> bytes:
        log.info("the editor's framing is not understood; relaying the rest of its input unread")
        self._raw = True
        return self.rest()

    def _look(self, frame: bytes, body: bytes) -> bytes:
        try:
            method = msgspec.json.decode(body, type=_Method).method
        except (msgspec.DecodeError, msgspec.ValidationError):
            return frame  # the daemon answers it with an error
        if method == "shutdown":
            self.shut_down = True
        elif method == "exit":
            self.exited = True
        elif method == "initialize" and self.api_key:
            return self._with_api_key(body) or frame
        return frame

    def _with_api_key(self, body: bytes) -> bytes | None:
        """``initialize`` with ``initializationOptions.apiKey`` added; None when it has one."""
        msg = msgspec.json.decode(body)
        params = msg.get("params")
        if not isinstance(params, dict):
            return None
        if params.get("initializationOptions") is None:
            params["initializationOptions"] = {}
        options = params["initializationOptions"]
        if not isinstance(options, dict) or "apiKey" in options:
            return None
        options["apiKey"] = self.api_key
        new = msgspec.json.encode(msg)
        return b"Content-Length: %d\r\n\r\n%s" % (len(new), new)


def _content_length(header: bytes) -> int | None:
    """The frame's length, or None when it has none that is a plain number of at most 15 digits
    (``int()`` of thousands of digits raises, which used to end the relay thread)."""
    for line in header.split(b"\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            value = value.strip()
            return int(value) if value.isdigit() and len(value) <= 15 else None
    return None


class Relay:
    """Bytes both ways between the editor (two file descriptors) and the daemon (a socket)."""

    def __init__(self, sock: socket.socket, stdin_fd: int, stdout_fd: int, stream: EditorStream):
        self.sock = sock
        self.stdin_fd = stdin_fd
        self.stdout_fd = stdout_fd
        self.stream = stream
        self.editor_done = threading.Event()  # the editor closed stdin, or stopped reading stdout

    def run(self) -> None:
        """Relay until the daemon ends the connection: after ``exit``, after the editor's end of
        input, or when it stops; or until the editor stops reading."""
        threading.Thread(target=self._to_daemon, name="warmspec-lsp-in", daemon=True).start()
        self._to_editor()

    def _to_daemon(self) -> None:
        try:
            for data in self._editor_input():
                self.sock.sendall(self.stream.feed(data))
            self.editor_done.set()
            self.sock.sendall(self.stream.rest())
            self.sock.shutdown(socket.SHUT_WR)  # the daemon reads the end of input and hangs up
        except OSError as e:  # the daemon went away: _to_editor sees its end of the stream too
            log.debug("relay to the daemon ended: %s", e)

    def _editor_input(self):
        """Chunks of stdin until its end (or a read error, which ends the editor's input too)."""
        while True:
            try:
                data = os.read(self.stdin_fd, CHUNK)
            except OSError as e:
                log.warning("reading the editor's input failed: %s", e)
                return
            if not data:
                return
            yield data

    def _to_editor(self) -> None:
        while True:
            try:
                data = self.sock.recv(CHUNK)
            except ConnectionError:
                return
            if not data:
                return
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(self.stdout_fd, view):]
            except BrokenPipeError:
                self.editor_done.set()
                return


def cmd_lsp(args: argparse.Namespace) -> int:
    """Relay the editor on stdio to the daemon; LSP's exit status (0 after shutdown and exit)."""
    from rich.console import Console

    protocol_out = claim_stdout()
    err = Console(stderr=True, soft_wrap=True)
    api_key = api_key_from(args)
    roots = default_lsp_roots(args.workspace)
    args.workspace = [str(r) for r in roots]  # for a daemon started now
    paths = RuntimePaths.resolve(args.socket)
    try:
        # Connections of our own before the editor's (which must start with its own initialize):
        # the --model check, then --workspace for a daemon that was already running.
        with connect_daemon(args, err) as probe:
            probe.initialize(api_key=api_key, name="warmspec-lsp")
            check_model(probe, args.model)
        if roots:
            with Client(_connect(paths)) as client:
                client.initialize(api_key=api_key, name="warmspec-lsp", roots=roots)
    except RpcError as e:
        hint = " (set WARMSPEC_API_KEY or --api-key-file)" if e.code == ErrorCode.UNAUTHORIZED else ""
        raise DaemonError(f"the daemon refused: {e.message}{hint}") from None
    except ConnectionError as e:
        raise DaemonError(f"lost the daemon at {paths.socket}: {e}") from None
    log.info("relaying to the daemon at %s", paths.socket)
    stream = EditorStream(api_key)
    with _connect(paths) as sock:
        relay = Relay(sock, sys.stdin.buffer.fileno(), protocol_out.fileno(), stream)
        relay.run()
    if stream.exited or relay.editor_done.is_set():
        return 0 if stream.shut_down else 1
    print(f"warmspec: the daemon closed the connection (stopped, or failed: see {paths.log})",
          file=sys.stderr)
    return 1


def _connect(paths: RuntimePaths) -> socket.socket:
    """A new connection to the daemon, which answered a moment ago."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(paths.socket))
    except OSError as e:
        sock.close()
        raise DaemonError(f"lost the daemon at {paths.socket}: {e}") from None
    return sock
