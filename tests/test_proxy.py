"""The editor side of ``warmspec lsp``'s relay (proxy.EditorStream): frames pass unchanged however
the bytes arrive, ``shutdown``/``exit`` are noticed for the exit status, ``$WARMSPEC_API_KEY`` goes
into an ``initialize`` that has no key, and framing it cannot follow is passed on as raw bytes.
The relay end to end, with a daemon, is in test_daemon_cli.py."""

from __future__ import annotations

import msgspec

from warmspec.proxy import EditorStream


def frame(msg: dict) -> bytes:
    body = msgspec.json.encode(msg)
    return b"Content-Length: %d\r\n\r\n%s" % (len(body), body)


def body_of(data: bytes) -> dict:
    header, _, body = data.partition(b"\r\n\r\n")
    assert int(header.split(b":")[1]) == len(body)
    return msgspec.json.decode(body)


INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"capabilities": {}, "rootUri": "file:///p"}}
OPEN = {"jsonrpc": "2.0", "method": "textDocument/didOpen",
        "params": {"textDocument": {"uri": "file:///p/a.py", "languageId": "python", "version": 1,
                                    "text": "print('Content-Length: 5\\r\\n\\r\\n')\n"}}}
SHUTDOWN = {"jsonrpc": "2.0", "id": 2, "method": "shutdown"}
EXIT = {"jsonrpc": "2.0", "method": "exit"}


def test_frames_pass_unchanged_byte_by_byte_and_shutdown_exit_are_seen():
    data = b"\r\n" + frame(INIT) + frame(OPEN) + b"\n" + frame(SHUTDOWN)
    stream = EditorStream()
    out = b"".join(stream.feed(data[i:i + 1]) for i in range(len(data)))
    assert out == data
    assert stream.shut_down and not stream.exited
    assert stream.feed(frame(EXIT)) == frame(EXIT)
    assert stream.exited and stream.rest() == b""


def test_a_partial_frame_waits_and_is_passed_on_at_the_end():
    stream = EditorStream()
    whole = frame(OPEN)
    assert stream.feed(whole[:30]) == b""
    assert stream.rest() == whole[:30]


def test_api_key_goes_into_initialize_without_one():
    out = body_of(EditorStream("k3y").feed(frame(INIT)))
    assert out["params"]["initializationOptions"] == {"apiKey": "k3y"}
    assert out["params"]["rootUri"] == "file:///p"
    with_options = dict(INIT, params=dict(INIT["params"], initializationOptions={"inlineCompletion": {}}))
    out = body_of(EditorStream("k3y").feed(frame(with_options)))
    assert out["params"]["initializationOptions"] == {"inlineCompletion": {}, "apiKey": "k3y"}
    own = dict(INIT, params=dict(INIT["params"], initializationOptions={"apiKey": "mine"}))
    assert EditorStream("k3y").feed(frame(own)) == frame(own)
    assert EditorStream(None).feed(frame(INIT)) == frame(INIT)
    assert EditorStream("k3y").feed(frame(OPEN)) == frame(OPEN)


def test_framing_it_cannot_follow_passes_as_raw_bytes():
    bad = b"Content-Type: x\r\n\r\n{}" + frame(SHUTDOWN)
    stream = EditorStream("k3y")
    assert stream.feed(bad) == bad
    assert stream.feed(frame(INIT)) == frame(INIT)  # raw from now on: no key added
    assert not stream.shut_down
    not_json = b"Content-Length: 3\r\n\r\n{x}"
    stream = EditorStream()
    assert stream.feed(not_json + frame(EXIT)) == not_json + frame(EXIT)
    assert stream.exited


def test_a_content_length_of_thousands_of_digits_passes_as_raw_bytes():
    """``int()`` refuses strings of over 4300 digits: such a header used to raise out of the relay
    thread, and the editor's input stopped reaching the daemon. Now it is framing the relay cannot
    follow, passed on for the daemon to answer."""
    bad = b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n{}"
    stream = EditorStream()
    assert stream.feed(bad) == bad
    assert stream.feed(frame(EXIT)) == frame(EXIT)  # still relaying (raw)
