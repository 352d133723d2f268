"""LSP base framing (``Content-Length: N`` headers, then N bytes of JSON), read defensively.

pygls's own reader skips what it cannot parse without a word; the daemon must instead answer every
bad frame with a JSON-RPC error and find the next frame, so it reads frames itself.
"""

from __future__ import annotations

import asyncio

from warmspec_protocol.rpc import ErrorCode

HEADER_LIMIT = 64 << 10  # longest header line, and all of a frame's header lines together;
# beyond it the stream cannot be resynchronized
CONTENT_TYPE = b"application/vscode-jsonrpc; charset=utf-8"


class FrameError(Exception):
    """A frame that cannot be read. ``fatal``: the stream cannot be resynchronized."""

    def __init__(self, code: ErrorCode, message: str, *, fatal: bool = False):
        super().__init__(message)
        self.code = code
        self.message = message
        self.fatal = fatal


async def read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes | None:
    """The next message body, or None at the end of the stream.

    Header names are case-insensitive and headers other than Content-Length are ignored (LSP's
    Content-Type is always utf-8). A frame with a bad header still has its body consumed when its
    length is known, so the next frame is read in step.
    """
    length: int | None = None
    problem: str | None = None
    seen = False
    header_bytes = 0
    while True:
        try:
            line = await reader.readline()
        except ValueError:  # over HEADER_LIMIT without a newline
            raise FrameError(ErrorCode.PARSE_ERROR, "header line too long", fatal=True) from None
        if not line:
            return None
        header_bytes += len(line)
        if header_bytes > HEADER_LIMIT:  # header lines without end: never a frame
            raise FrameError(ErrorCode.PARSE_ERROR, f"headers longer than {HEADER_LIMIT} bytes", fatal=True)
        if not line.strip():
            if seen:
                break
            continue  # blank lines between frames
        seen = True
        name, colon, value = line.partition(b":")
        if not colon:
            problem = problem or f"malformed header line {line[:60]!r}"
        elif name.strip().lower() == b"content-length":
            value = value.strip()
            if value.isdigit() and len(value) <= 15:
                length = int(value)
            else:
                problem = problem or f"invalid Content-Length {value[:30]!r}"
    if length is None:
        raise FrameError(ErrorCode.PARSE_ERROR, problem or "missing Content-Length header")
    if length > max_bytes:
        raise FrameError(ErrorCode.INVALID_REQUEST,
                         f"message of {length} bytes is over the limit of {max_bytes}", fatal=True)
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        return None
    if problem:
        raise FrameError(ErrorCode.PARSE_ERROR, problem)
    return body


def frame(body: bytes) -> bytes:
    return b"Content-Length: %d\r\nContent-Type: %s\r\n\r\n%s" % (len(body), CONTENT_TYPE, body)
