"""Malformed input at the socket: bad headers, wrong Content-Length, invalid JSON, JSON that is not
JSON-RPC, wrong param types. The daemon must never crash or hang, must answer every malformed
message with exactly one well-formed JSON-RPC error, and must serve a valid request afterwards.

Two properties: frames whose boundaries are still known (a body that is bad in any way, headers
that are broken but say or imply where the frame ends) are counted -- one error each; stream
garbage (raw bytes, a Content-Length that lies) has no frame boundaries to count by, so there every
reply must be an error and the daemon must keep serving."""

from __future__ import annotations

import socket

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from warmspec.client import Client
from warmspec_protocol import rpc as wire
from warmspec_protocol.rpc import ErrorCode

from test_rpc import InProcessDaemon, chat

CODES = {int(c) for c in ErrorCode}
KNOWN = set(wire.METHODS) | wire.LSP_REQUESTS | wire.LSP_NOTIFICATIONS


@pytest.fixture(scope="module")
def daemon(default_lm, tmp_path_factory):
    d = InProcessDaemon(default_lm, tmp_path_factory.mktemp("fuzz"))
    yield d
    d.close()


def framed(body: bytes) -> bytes:
    return b"Content-Length: %d\r\n\r\n%s" % (len(body), body)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)

# Params of real methods with exactly one field broken, so none of them ever reaches the model.
# No NaN or infinity where null is a valid value: JSON encodes them as null, which made a valid
# request (a chat of the default 1024 tokens) that then held the engine after its client left.
finite = dict(allow_nan=False, allow_infinity=False)
VALID_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
broken_chat = st.one_of(
    st.builds(lambda v: {**VALID_CHAT, "max_tokens": v},
              st.text() | st.integers(max_value=0) | st.floats(**finite) | st.lists(st.integers(), max_size=2)),
    st.builds(lambda v: {**VALID_CHAT, "messages": v},
              st.just([]) | st.integers() | st.text() | st.lists(st.dictionaries(st.text(max_size=5), json_values,
                                                                                 max_size=2), min_size=1, max_size=2)),
    st.builds(lambda v: {**VALID_CHAT, "temperature": v}, st.text() | st.floats(min_value=10.5, **finite)
              | st.floats(max_value=-0.1, **finite)),
    st.builds(lambda k, v: {**VALID_CHAT, k: v}, st.text(min_size=1, max_size=8).filter(lambda k: k not in
                                                                                     wire.ChatParams.__struct_fields__), json_values),
)
bad_params = st.one_of(
    st.builds(lambda p: ("warmspec/chat", p), broken_chat),
    st.builds(lambda p: ("warmspec/complete", p), st.builds(lambda v: {"prompt": v}, st.integers() | st.just("") | st.none())),
    st.builds(lambda p: ("warmspec/didRead", p), st.builds(lambda v: {"path": v}, st.integers() | st.just("") | st.lists(st.text()))),
    st.builds(lambda p: ("textDocument/inlineCompletion", p), json_values),
    st.builds(lambda p: ("warmspec/status", p), st.lists(json_values, min_size=1, max_size=2) | st.text() | st.integers()),
)


def bad_request_body(draw) -> bytes:
    kind = draw(st.sampled_from(["invalid-json", "not-object", "bad-envelope", "bad-params", "unknown-method"]))
    ids = st.integers() | st.text(max_size=8)
    if kind == "invalid-json":
        return draw(st.binary(min_size=1, max_size=60).filter(lambda b: not _is_json(b)))
    if kind == "not-object":
        return msgspec.json.encode(draw(st.lists(json_values, max_size=3) | st.integers() | st.text() | st.none()))
    if kind == "bad-envelope":
        env = {"jsonrpc": draw(st.sampled_from(["2.0", "1.0", 2, None])), "id": draw(ids),
               "method": draw(st.sampled_from(["warmspec/status"]) | st.integers() | st.none())}
        key = draw(st.sampled_from(["jsonrpc", "id", "method"]))
        env[key] = draw(st.sampled_from([2.5, True, [], {}, None]) if key != "jsonrpc" else st.sampled_from(["1.0", 2, None]))
        return msgspec.json.encode(env)
    if kind == "bad-params":
        method, params = draw(bad_params)
        return msgspec.json.encode({"jsonrpc": "2.0", "id": draw(ids), "method": method, "params": params})
    method = draw(st.text(min_size=1, max_size=20).filter(lambda m: m not in KNOWN))
    return msgspec.json.encode({"jsonrpc": "2.0", "id": draw(ids), "method": method, "params": draw(json_values)})


def _is_json(b: bytes) -> bool:
    try:
        msgspec.json.decode(b)
        return True
    except msgspec.DecodeError:
        return False


NO_REPLY = object()

# Notifications get no reply by JSON-RPC's rules, however broken their params; ``exit`` is left
# out (it ends the connection, correctly).
NOTIFIED = sorted(wire.LSP_NOTIFICATIONS - {"exit"}) + ["warmspec/chat", "warmspec/status", "x/unknown"]


def reply_id(body: bytes):
    """The id an error reply to ``body`` must carry: the request's, or null where it cannot be
    read (JSON-RPC 2.0, section 5)."""
    try:
        obj = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    raw = obj.get("id") if isinstance(obj, dict) else None
    return raw if isinstance(raw, (int, str)) and not isinstance(raw, bool) else None


@st.composite
def malformed_frame(draw) -> tuple[bytes, object]:
    """One malformed message whose frame boundary is known, and the id its one error reply must
    carry (``NO_REPLY`` for a notification)."""
    kind = draw(st.sampled_from(["body", "body", "header", "no-length", "notification"]))
    if kind == "notification":
        note = {"jsonrpc": "2.0", "method": draw(st.sampled_from(NOTIFIED)), "params": draw(json_values)}
        return framed(msgspec.json.encode(note)), NO_REPLY
    if kind == "no-length":  # a header block without a usable length, and no body: one error
        header = draw(st.sampled_from([b"Content-Lenght: 5", b"Content-Length: abc", b"Content-Length: -1",
                                       b"Content-Length: 1e3", b"Content-Length: +5", b"Content-Length:",
                                       b"Content-Length: 99999999999999999999", b"Content-Length 7",
                                       b"Content-Type: x"]))
        return header + b"\r\n\r\n", None
    body = bad_request_body(draw)
    if kind == "body":
        return framed(body), reply_id(body)
    header, parsed = draw(st.sampled_from([(b"content-length:\t%d\r\n", True),
                                           (b"Content-Length: %d\r\nContent-Type: x\r\n", True),
                                           (b"Content-Length: %d\r\nX-Junk\r\n", False)]))
    return header % len(body) + b"\r\n" + body, reply_id(body) if parsed else None


@st.composite
def garbage(draw) -> bytes:
    """One stream fragment: a malformed frame, or bytes that may break the framing itself."""
    kind = draw(st.sampled_from(["body", "body", "header", "length", "raw"]))
    if kind == "body":
        return framed(bad_request_body(draw))
    if kind == "header":
        body = bad_request_body(draw)
        header = draw(st.sampled_from([b"Content-Length %d\r\n", b"Content-Lenght: %d\r\n", b"content-length:\t%d\r\n",
                                       b"Content-Length: %d\r\nX-Junk\r\n", b"Content-Length: %d\r\nContent-Type: x\r\n"]))
        return header % len(body) + b"\r\n" + body
    if kind == "length":
        body = bad_request_body(draw)
        length = draw(st.sampled_from([b"-1", b"abc", b"1e3", b"+5", b"", b"99999999999999999999"])
                      | st.integers(0, len(body) + 20).map(lambda n: str(n).encode()))
        return b"Content-Length: " + length + b"\r\n\r\n" + body
    return draw(st.binary(max_size=80))


INITIALIZE = framed(msgspec.json.encode(wire.Request(id="init", method="initialize", params=wire.InitializeParams())))


def exchange(path, data: bytes) -> list[bytes]:
    """Send ``data`` after a valid initialize, close our side, read every reply until the daemon
    hangs up."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(str(path))
    sock.sendall(INITIALIZE + data)
    sock.shutdown(socket.SHUT_WR)
    received = bytearray()
    while chunk := sock.recv(1 << 16):
        received += chunk
    sock.close()
    bodies = []
    while received:
        head, sep, rest = bytes(received).partition(b"\r\n\r\n")
        assert sep, f"a reply without a header terminator: {bytes(received[:80])!r}"
        length = [int(v) for k, _, v in (h.partition(b":") for h in head.split(b"\r\n"))
                  if k.lower() == b"content-length"]
        assert len(length) == 1, head
        bodies.append(rest[: length[0]])
        assert len(bodies[-1]) == length[0]
        received = bytearray(rest[length[0]:])
    return bodies


def errors(daemon, data: bytes) -> list[wire.ErrorResponse]:
    """The replies to ``data`` after the initialize reply, each checked to be an error that blames
    the input, not the daemon."""
    replies = exchange(daemon.socket, data)
    assert replies, "the initialize reply is missing"
    init = msgspec.json.decode(replies[0], type=wire.Envelope)
    assert init.id == "init" and init.error is msgspec.UNSET
    out = []
    for body in replies[1:]:
        reply = msgspec.json.decode(body, type=wire.ErrorResponse)  # fails on anything but an error
        assert reply.jsonrpc == "2.0" and reply.error.code in CODES and reply.error.message
        assert reply.error.code != ErrorCode.INTERNAL_ERROR, reply.error.message  # bad input is not a fault
        out.append(reply)
    return out


def key(msg_id) -> str:
    return repr(msg_id)  # 1 and "1" are different ids


SETTINGS = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@SETTINGS
@given(frames=st.lists(malformed_frame(), min_size=1, max_size=6))
@example(frames=[(framed(b"[]"), None), (framed(b'{"jsonrpc": "2.0", "id": 1.5, "method": "x"}'), None),
                 (framed(b"\xff\xfe"), None)])
@example(frames=[(framed(b'{"jsonrpc": "2.0", "id": 7, "method": "warmspec/chat", "params": {"messages": 1}}'), 7),
                 (framed(b'{"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": 3}'), NO_REPLY),
                 (b"Content-Type: x\r\n\r\n", None)])
def test_malformed_frames_get_errors_and_the_daemon_keeps_serving(daemon, frames):
    """Every malformed message gets exactly one error, with its id where it has a readable one,
    and none of them runs a job. Notifications are the exception JSON-RPC makes: never answered."""
    scheduler = daemon.app.scheduler
    ran = scheduler.completed + scheduler.failed
    replies = errors(daemon, b"".join(data for data, _ in frames))
    expected = sorted(key(i) for _, i in frames if i is not NO_REPLY)
    assert sorted(key(r.id) for r in replies) == expected
    daemon.wait_idle()
    assert scheduler.completed + scheduler.failed == ran  # nothing ran


@SETTINGS
@given(frames=st.lists(garbage(), min_size=1, max_size=4))
@example(frames=[b"Content-Length: 3\r\n\r\n" + msgspec.json.encode({"jsonrpc": "2.0", "id": 1, "method": "warmspec/status"})])
@example(frames=[b"Content-Type: x\r\n\r\n{}", framed(b'{"jsonrpc": "2.0", "id": 1, "method": "warmspec/chat", "params": {"messages": 1}}')])
def test_stream_garbage_gets_only_errors(daemon, frames):
    """Bytes that break the framing itself: no count to check, but every reply is an error, no job
    runs, and the connection ends cleanly at the end of its input."""
    scheduler = daemon.app.scheduler
    ran = scheduler.completed + scheduler.failed
    errors(daemon, b"".join(frames))
    daemon.wait_idle()
    assert scheduler.completed + scheduler.failed == ran


def test_daemon_answers_after_the_fuzzing(daemon):
    exchange(daemon.socket, b"Content-Length: 5\r\n\r\n{]}}}" + b"\x00\xff" * 100 + b"\r\n\r\n")
    with Client.unix(daemon.socket) as c:
        c.initialize()
        result = c.call("warmspec/chat", chat("Say yes.", 2), wire.GenerateResult)
    assert result.stats.completion_tokens == 2 and result.text
