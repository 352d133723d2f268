"""The HTTP transport against the official ``openai`` and ``anthropic`` SDKs, on the default model.

One server (with an API key, so every call also proves the key is accepted) runs in a thread with
its own event loop. Greedy decoding is deterministic, so streamed and whole answers, and answers
given under concurrency, must equal the same prompts answered alone. A second server puts a
scripted engine behind a Hermes-style chat template, to test tool calls end to end (the default
model's template has no tools).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

import anthropic
import openai
import msgspec
import pytest

from warmspec.core.engine import Delta, Engine, EngineError, Finished
from warmspec.core.gate import CostTable
from warmspec.model import LoadedModel
from warmspec.server.app import App, Limits
from warmspec.server.http import CTX, host_allowed, start_http
from warmspec_protocol import Message
from warmspec.server.tools import ToolCallSplitter, parse_tool_calls, tool_format
from warmspec.tokenizer import Tokenizer
from warmspec.core import GenerationStats

KEY = "test-key"
QUESTION = "What is the capital of France?"
MAX_BODY = 64 << 10
GREEDY = {"temperature": 0}  # the anthropic SDK has no sampling arguments any more
COSTS = {0: {1: 1.0, 2: 1.1, 33: 2.0}}  # skips the few-second cost measurement


class Server:
    """An HTTP server for ``app`` on a free port, on an event loop in a background thread."""

    def __init__(self, app: App, keepalive_s: float = 0.5, allow_origins: tuple[str, ...] = ()):
        self.app = app
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.runner = self.loop.run_until_complete(start_http(app, "127.0.0.1", 0, keepalive_s=keepalive_s,
                                                                  allow_origins=allow_origins))
            started.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert started.wait(30)
        self.port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.ctx = self.runner.app[CTX]

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.app.stop()

    def openai(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def anthropic(self, key: str = KEY) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=key, max_retries=0, timeout=120)

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def post(self, path: str, obj: object, key: str | None = KEY) -> tuple[int, dict[str, str], bytes]:
        headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
        return self.request("POST", path, json.dumps(obj).encode(), headers)

    def wait_idle(self, timeout: float = 60) -> None:
        s = self.app.scheduler
        end = time.time() + timeout
        while s.active is not None or s.queue_depth:
            assert time.time() < end, "scheduler still busy"
            time.sleep(0.05)


def sse_lines(conn: http.client.HTTPConnection, path: str, body: object) -> Iterator[bytes]:
    """Raw lines of a streamed reply, as they arrive."""
    conn.request("POST", path, json.dumps(body).encode(),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    assert resp.getheader("Content-Type").startswith("text/event-stream")
    while line := resp.readline():
        yield line


@pytest.fixture(scope="module")
def server(default_lm):
    app = App(default_lm, Engine(default_lm, costs=CostTable(COSTS)), api_key=KEY,
              limits=Limits(max_body_bytes=MAX_BODY))
    srv = Server(app)
    yield srv
    srv.close()


def chat(srv: Server, text: str, *, stream: bool = False, **kw) -> str:
    client = srv.openai()
    messages = [{"role": "user", "content": text}]
    if not stream:
        return client.chat.completions.create(model="m", messages=messages, temperature=0, **kw).choices[0].message.content
    chunks = client.chat.completions.create(model="m", messages=messages, temperature=0, stream=True, **kw)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def prompt_tokens(srv: Server, messages: list[dict]) -> int:
    return len(srv.app.chat_prompt(msgspec.convert(messages, list[Message])))


# -- the SDKs, endpoint by endpoint -----------------------------------------------------------------


def test_models_list_in_both_sdks(server, default_lm):
    assert [m.id for m in server.openai().models.list()] == [default_lm.name]
    assert server.openai().models.retrieve(default_lm.name).owned_by == "warmspec"
    with pytest.raises(openai.NotFoundError):
        server.openai().models.retrieve("no-such-model")
    listed = server.anthropic().models.list()
    assert [m.id for m in listed.data] == [default_lm.name] and listed.data[0].type == "model"


def test_chat_completion_whole_and_streamed(server):
    messages = [{"role": "user", "content": QUESTION}]
    raw = server.openai().chat.completions.with_raw_response.create(
        model="anything", messages=messages, temperature=0, max_tokens=20)
    r = raw.parse()
    text = r.choices[0].message.content
    assert "Paris" in text
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.role == "assistant"
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.usage.prompt_tokens == prompt_tokens(server, messages)
    assert 0 < r.usage.completion_tokens < 20
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    stats = r.model_extra["warmspec"]
    assert stats["completion_tokens"] == r.usage.completion_tokens and stats["passes"] > 0
    header = json.loads(raw.headers["X-Warmspec-Stats"])
    assert header["completion_tokens"] == r.usage.completion_tokens
    assert set(header) >= {"tokens_per_pass", "acceptance", "drafted", "accepted", "decode_tok_s"}

    chunks = list(server.openai().chat.completions.create(
        model="m", messages=messages, temperature=0, max_tokens=20, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt came again
    assert chunks[-1].model_extra["warmspec"]["completion_tokens"] == r.usage.completion_tokens


def test_chat_content_parts_system_and_length(server):
    client = server.openai()
    parts = client.chat.completions.create(model="m", temperature=0, max_tokens=3, messages=[
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "What is the capital"},
                                     {"type": "text", "text": "of France?"}]}])
    assert parts.choices[0].finish_reason == "length" and parts.usage.completion_tokens == 3
    plain = [{"role": "system", "content": "Answer briefly."},
             {"role": "user", "content": "What is the capital\nof France?"}]
    assert parts.usage.prompt_tokens == prompt_tokens(server, plain)
    # max_completion_tokens wins over max_tokens; sampling options change per request, no reload
    r = client.chat.completions.create(model="m", messages=plain, max_tokens=9, max_completion_tokens=2,
                                       temperature=0.7, top_p=0.9, seed=3, extra_body={"top_k": 20, "min_p": 0.05})
    assert r.usage.completion_tokens == 2
    assert r.usage.prompt_tokens_details.cached_tokens > 0  # nothing reloaded: the prefix cache is warm


def test_stop_strings_map_to_each_api(server):
    text = chat(server, QUESTION, max_tokens=20, stop=["Paris"])
    assert text == "The capital of France is "
    m = server.anthropic().messages.create(model="m", max_tokens=20, extra_body=GREEDY, stop_sequences=["Paris"],
                                           messages=[{"role": "user", "content": QUESTION}])
    assert m.content[0].text == text and m.stop_reason == "stop_sequence" and m.stop_sequence == "Paris"
    m = server.anthropic().messages.create(model="m", max_tokens=20, extra_body=GREEDY, stop_sequences=["Rome"],
                                           messages=[{"role": "user", "content": QUESTION}])
    assert m.stop_reason == "end_turn" and m.stop_sequence is None and "Paris" in m.content[0].text


def test_completions_whole_and_streamed(server):
    client = server.openai()
    r = client.completions.create(model="m", prompt="The capital of France is", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert "Paris" in r.choices[0].text
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens == len(server.app.text_prompt("The capital of France is"))
    chunks = list(client.completions.create(model="m", prompt=["The capital of France is"], max_tokens=6,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].model_extra["warmspec"]["completion_tokens"] == 6


def test_responses_whole_and_streamed(server):
    client = server.openai()
    r = client.responses.create(model="m", input=QUESTION, max_output_tokens=20, temperature=0)
    assert r.status == "completed" and "Paris" in r.output_text
    assert r.usage.input_tokens == prompt_tokens(server, [{"role": "user", "content": QUESTION}])
    assert r.usage.output_tokens == r.model_extra["warmspec"]["completion_tokens"]

    with client.responses.stream(model="m", input=QUESTION, max_output_tokens=20, temperature=0) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_response()
    assert final.output_text == r.output_text and final.id.startswith("resp_")
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert kinds.count("response.output_text.delta") >= 2

    short = client.responses.create(model="m", instructions="Answer briefly.", max_output_tokens=2, temperature=0,
                                    input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.usage.input_tokens == prompt_tokens(
        server, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}])


def test_messages_whole_and_streamed(server):
    client = server.anthropic()
    messages = [{"role": "user", "content": QUESTION}]
    m = client.messages.create(model="m", max_tokens=20, extra_body=GREEDY, messages=messages)
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "end_turn"
    assert "Paris" in m.content[0].text
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == prompt_tokens(server, messages)
    assert m.usage.output_tokens == m.model_extra["warmspec"]["completion_tokens"]

    with client.messages.stream(model="m", max_tokens=20, extra_body=GREEDY, messages=messages) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.content[0].text == m.content[0].text and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == m.usage.output_tokens
    assert final.usage.cache_read_input_tokens > 0  # same prompt again: prefix cache
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta" and "content_block_start" in kinds and "content_block_stop" in kinds
    assert events[-2].model_extra["warmspec"]["completion_tokens"] == m.usage.output_tokens

    system = client.messages.create(model="m", max_tokens=2, extra_body=GREEDY, system="Answer briefly.", messages=[
        {"role": "user", "content": [{"type": "text", "text": QUESTION}]}])
    assert system.stop_reason == "max_tokens" and system.usage.output_tokens == 2
    assert system.usage.input_tokens + system.usage.cache_read_input_tokens == prompt_tokens(
        server, [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTION}])
    counted = client.messages.count_tokens(model="m", messages=messages)
    assert counted.input_tokens == prompt_tokens(server, messages)


def test_raw_sse_framing(server):
    """The exact wire format: OpenAI chat ends with [DONE]; Anthropic names every event."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    lines = list(sse_lines(conn, "/v1/chat/completions",
                           {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                            "stream": True}))
    data = [line for line in lines if line.startswith(b"data: ")]
    assert data[-1] == b"data: [DONE]\n" and all(json.loads(d[6:])["object"] == "chat.completion.chunk"
                                                 for d in data[:-1])
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    lines = [line for line in sse_lines(conn, "/v1/messages",
                                        {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                                         "max_tokens": 3, "stream": True})
             if line.strip() and not line.startswith(b":")]  # keep-alive comments come when the CPU is slow
    names = [line[7:].strip().decode() for line in lines if line.startswith(b"event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    for name, payload in zip(lines[0::2], lines[1::2]):  # every event line is followed by its data
        assert json.loads(payload[6:])["type"] == name[7:].strip().decode()


# -- concurrency, disconnects, keep-alives ----------------------------------------------------------


def test_eight_clients_at_once_match_alone_and_a_disconnect_disturbs_none(server):
    n = 6  # tokens per answer: complete answers, a short test

    def messages_api(text: str, stream: bool) -> Callable[[], str]:
        def ask() -> str:
            kw = dict(model="m", max_tokens=n, extra_body=GREEDY, messages=[{"role": "user", "content": text}])
            if not stream:
                return server.anthropic().messages.create(**kw).content[0].text
            with server.anthropic().messages.stream(**kw) as s:
                return "".join(s.text_stream)
        return ask

    def responses_api(text: str) -> Callable[[], str]:
        return lambda: server.openai().responses.create(model="m", input=text, max_output_tokens=n,
                                                        temperature=0).output_text

    topics = ["Name a color.", "Name a fruit.", "Say hello.", "Name an animal.", "Count to three.",
              "Name a planet.", "Name a tree.", "Name a sport."]
    clients = [lambda t=t, s=s: chat(server, t, stream=s, max_tokens=n) for t, s in zip(topics[:4], (0, 1, 0, 1))]
    clients += [messages_api(topics[4], False), messages_api(topics[5], True), responses_api(topics[6]),
                lambda: server.openai().completions.create(model="m", prompt=topics[7], max_tokens=n,
                                                           temperature=0).choices[0].text]
    alone = [ask() for ask in clients]
    assert all(alone)

    # A client that leaves mid-stream: its job runs first, the eight queue behind it.
    before_tokens = server.app.engine.totals.completion_tokens
    before_gone = server.ctx.disconnects
    reading = threading.Event()

    def leave_mid_stream() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        for line in sse_lines(conn, "/v1/chat/completions", {
                "model": "m", "messages": [{"role": "user", "content": "Write a long story."}],
                "max_tokens": 400, "stream": True}):
            if b'"content":"' in line and b'"content":""' not in line:
                break
        reading.set()
        conn.sock.close()
        conn.close()

    leaver = threading.Thread(target=leave_mid_stream)
    leaver.start()
    assert reading.wait(60)
    with ThreadPoolExecutor(len(clients)) as pool:
        together = list(pool.map(lambda ask: ask(), clients))
    leaver.join()
    server.wait_idle()
    assert together == alone
    assert server.ctx.disconnects == before_gone + 1
    # the story was cut off: all tokens generated since are far fewer than its 400
    assert server.app.engine.totals.completion_tokens - before_tokens < len(clients) * n + 100


def test_a_client_that_leaves_a_whole_reply_cancels_its_job(server):
    before_tokens = server.app.engine.totals.completion_tokens
    before_gone = server.ctx.disconnects
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": "m", "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 400}).encode(),
        {"Content-Type": "application/json", "x-api-key": KEY})
    while server.app.scheduler.active is None:
        time.sleep(0.01)
    time.sleep(0.3)  # a few tokens into the story
    conn.sock.close()
    server.wait_idle()
    assert server.ctx.disconnects == before_gone + 1
    assert server.app.engine.totals.completion_tokens - before_tokens < 100


def test_keepalive_comments_while_waiting_for_the_first_token(server):
    busy = threading.Thread(target=chat, args=(server, "Write a poem."), kwargs=dict(max_tokens=12))
    busy.start()
    while server.app.scheduler.active is None:  # the poem holds the engine
        time.sleep(0.01)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    before_text = []
    for line in sse_lines(conn, "/v1/chat/completions", {
            "model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}):
        if b'"content":"' in line and b'"content":""' not in line:
            break
        before_text.append(line)
    conn.close()
    busy.join()
    assert b": keep-alive\n" in before_text


# -- auth, limits, errors ---------------------------------------------------------------------------


def test_api_key_is_required_everywhere_but_health(server):
    with pytest.raises(openai.AuthenticationError) as e:
        server.openai(key="wrong").models.list()
    assert e.value.body["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError) as e:
        server.anthropic(key="wrong").messages.create(model="m", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert e.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                       "message": e.value.body["error"]["message"]}}
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}, {"x-api-key": ""}):
        status, _, reply = server.request("POST", "/v1/chat/completions", json.dumps(body).encode(), headers)
        assert status == 401 and "API key" in json.loads(reply)["error"]["message"]
    assert server.request("GET", "/metrics")[0] == 401
    assert server.request("GET", "/v1/models", headers={"x-api-key": KEY})[0] == 200
    assert server.request("GET", "/health")[0] == 200


def test_bad_requests_get_clear_errors_in_each_api_format(server):
    # malformed JSON, wrong types (with the offending field), unsupported options
    status, _, reply = server.post("/v1/chat/completions", None)
    assert status == 400 and json.loads(reply)["error"]["type"] == "invalid_request_error"
    status, _, reply = server.request("POST", "/v1/chat/completions", b"{not json",
                                      {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert status == 400 and "malformed JSON" in json.loads(reply)["error"]["message"]
    status, _, reply = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]})
    err = json.loads(reply)["error"]
    assert status == 400 and err["param"] == "messages[0].content" and "Expected" in err["message"]
    status, _, reply = server.post("/v1/messages", {"messages": [{"role": "user", "content": "x"}]})
    err = json.loads(reply)
    assert status == 400 and err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in err["error"]["message"]

    with pytest.raises(openai.BadRequestError, match="max_tokens must be between 1"):
        server.openai().chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        server.openai().chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], n=2)
    with pytest.raises(openai.BadRequestError, match="'image_url' is not supported"):
        server.openai().chat.completions.create(model="m", max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:,"}}]}])
    with pytest.raises(openai.BadRequestError, match="invalid sampling parameter"):
        server.openai().chat.completions.create(model="m", max_tokens=1, temperature=-1,
                                                messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError, match="does not fit the context"):
        server.anthropic().messages.create(model="m", max_tokens=1, messages=[{"role": "user", "content": "hi " * 9000}])
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        server.openai().responses.create(model="m", input="x", previous_response_id="resp_1")
    # tools on a model whose template ignores them: a clear 400, not a silent tool-less answer
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError, match="has no tool support"):
        server.openai().chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], tools=[weather])
    with pytest.raises(anthropic.BadRequestError, match="has no tool support"):
        server.anthropic().messages.create(model="m", max_tokens=1, messages=[{"role": "user", "content": "x"}],
                                           tools=[{"name": "get_weather", "input_schema": {"type": "object"}}])


def test_unknown_routes_methods_and_oversized_bodies(server):
    status, headers, reply = server.request("GET", "/v1/nothing", headers={"x-api-key": KEY})
    assert status == 404 and headers["content-type"].startswith("application/json")
    assert json.loads(reply)["error"]["type"] == "not_found_error"
    status, _, reply = server.request("GET", "/v1/messages", headers={"x-api-key": KEY})
    assert status == 405 and json.loads(reply)["type"] == "error"
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * MAX_BODY}], "max_tokens": 1}
    status, _, reply = server.post("/v1/chat/completions", big)
    assert status == 413 and "limit" in json.loads(reply)["error"]["message"]
    status, _, reply = server.post("/v1/messages", big)
    assert status == 413 and json.loads(reply)["error"]["type"] == "request_too_large"
    # chunked (no Content-Length): the limit still holds
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=iter([json.dumps(big).encode()]),
                 headers={"x-api-key": KEY, "Content-Type": "application/json", "Transfer-Encoding": "chunked"},
                 encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "request_too_large"
    conn.close()
    assert "Paris" in chat(server, QUESTION, max_tokens=8)  # still serving


@pytest.fixture(scope="module")
def tiny_server():
    """A server around a tiny random-weight model (byte tokenizer, 4096-token context), no key."""
    import tiny

    lm = tiny.build("llama")
    srv = Server(App(lm, Engine(lm, costs=CostTable(COSTS))))
    yield srv
    srv.close()


def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing(tiny_server, monkeypatch):
    """A 1 MiB prompt (under the body limit) for a 4096-token context of one-character tokens:
    400 in each API's format, the tokenizer never called; a full queue: 503, not tokenized either."""
    tok = tiny_server.app.lm.tokenizer
    calls = []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda *a, **k: calls.append(1) or encode(*a, **k))
    huge = "x" * (1 << 20)
    refused = [tiny_server.post("/v1/completions", {"model": "m", "prompt": huge, "max_tokens": 1}, key=None),
               tiny_server.post("/v1/chat/completions", {"model": "m", "max_tokens": 1,
                                                         "messages": [{"role": "user", "content": huge}]}, key=None),
               tiny_server.post("/v1/messages", {"model": "m", "max_tokens": 1,
                                                 "messages": [{"role": "user", "content": huge}]}, key=None)]
    assert calls == []
    for (status, _, body), api in zip(refused, ("openai", "openai", "anthropic")):
        reply = json.loads(body)
        assert status == 400 and "cannot fit the context of 4096 tokens" in reply["error"]["message"], body
        assert (reply.get("type") == "error") == (api == "anthropic")  # each API's error format
    tiny_server.app.scheduler.max_queue = 0
    try:
        status, _, body = tiny_server.post("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 1},
                                           key=None)
    finally:
        tiny_server.app.scheduler.max_queue = 256
    assert status == 503 and "queue full" in json.loads(body)["error"]["message"]
    assert calls == []
    status, _, body = tiny_server.post("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 1}, key=None)
    assert status == 200 and calls == [1]


def test_requests_from_web_pages_are_refused(tiny_server):
    """What a web page can send without a CORS preflight -- a text/plain POST -- is refused with 415
    and starts nothing; so is a foreign Host (DNS rebinding: the page's own name resolving to
    127.0.0.1) and a foreign or opaque Origin (403), in each API's error format. Loopback Hosts and
    the daemon's own origin are served."""
    srv = tiny_server
    srv.wait_idle()  # an earlier test's job is counted once the worker is idle
    completed = srv.app.scheduler.completed
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1}).encode()
    chat_body = json.dumps({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}).encode()
    plain = {"Content-Type": "text/plain"}
    cases = [  # (method, path, body, headers, status, the API whose error format answers)
        ("POST", "/v1/completions", body, plain, 415, "openai"),
        ("POST", "/v1/completions", body, {}, 415, "openai"),
        ("POST", "/v1/messages", chat_body, {"Content-Type": "text/plain;charset=UTF-8"}, 415, "anthropic"),
        ("POST", "/v1/chat/completions", chat_body, {"Content-Type": "application/x-www-form-urlencoded"}, 415,
         "openai"),
        ("POST", "/v1/completions", body, {"Content-Type": "application/json", "Origin": "http://evil.example"},
         403, "openai"),
        ("POST", "/v1/messages", chat_body, {"Content-Type": "application/json", "Origin": "null"}, 403, "anthropic"),
        ("GET", "/v1/models", None, {"Origin": f"http://localhost:{srv.port}"}, 403, "openai"),  # Host is 127.0.0.1
        ("POST", "/v1/completions", body, {"Content-Type": "application/json", "Host": f"evil.example:{srv.port}"},
         403, "openai"),
        ("GET", "/v1/models", None, {"Host": f"rebind.example:{srv.port}"}, 403, "openai"),
        ("GET", "/health", None, {"Host": "127.0.0.1.nip.io"}, 403, "openai"),
    ]
    for method, path, data, headers, want, api in cases:
        status, reply_headers, reply = srv.request(method, path, data, headers)
        assert status == want, (method, path, headers, status, reply)
        assert reply_headers["content-type"].startswith("application/json")
        error = json.loads(reply)
        assert (error.get("type") == "error") == (api == "anthropic") and error["error"]["message"], error
    assert srv.app.scheduler.completed == completed  # nothing was generated
    served = [("GET", "/v1/models", {"Host": f"localhost:{srv.port}"}),
              ("GET", "/v1/models", {"Host": f"[::1]:{srv.port}", "Origin": f"http://[::1]:{srv.port}"}),
              ("GET", "/health", {"Host": "127.0.0.1"}),
              ("POST", "/v1/completions", {"Content-Type": "application/json; charset=utf-8",
                                           "Origin": f"http://127.0.0.1:{srv.port}"})]
    for method, path, headers in served:
        status, _, reply = srv.request(method, path, body if method == "POST" else None, headers)
        assert status == 200, (path, headers, reply)


def test_allow_origin_lets_one_web_origin_in():
    import tiny

    lm = tiny.build("llama")
    srv = Server(App(lm, Engine(lm, costs=CostTable(COSTS))), allow_origins=("http://App.example:3000/",))
    try:
        allowed = srv.request("GET", "/v1/models", headers={"Origin": "http://app.example:3000"})
        other = srv.request("GET", "/v1/models", headers={"Origin": "http://app.example:4000"})
        rebound = srv.request("GET", "/v1/models", headers={"Origin": "http://app.example:3000",
                                                            "Host": "app.example:3000"})
    finally:
        srv.close()
    assert allowed[0] == 200 and other[0] == 403
    assert rebound[0] == 403  # an allowed origin still needs a Host that is this server


def test_host_allowed_names_this_server_only():
    for host in ("localhost", "localhost:8080", "127.0.0.1:1", "127.9.9.9", "[::1]:80", "[::1]", "LocalHost:1"):
        assert host_allowed(host, "127.0.0.1"), host
    for host in ("evil.example", "localhost.evil.example:80", "127.0.0.1.nip.io", "localhost:x", "[::1]x",
                 "192.168.1.5:8080", ""):
        assert not host_allowed(host, "127.0.0.1"), host
    assert host_allowed("192.168.1.5:8080", "192.168.1.5") and host_allowed("box.lan:80", "box.lan")
    assert host_allowed("anything:80", "0.0.0.0") and host_allowed("[fe80::1]:80", "::")  # needs --api-key


def test_health_and_metrics(server, default_lm):
    chat(server, "Hi", max_tokens=2)
    status, _, reply = server.request("GET", "/health")
    health = json.loads(reply)
    assert status == 200 and health["status"] == "ok" and health["model"] == default_lm.name
    assert health["queue"] == 0 and health["uptime_s"] > 0

    status, headers, reply = server.request("GET", "/metrics", headers={"x-api-key": KEY})
    assert status == 200 and headers["content-type"].startswith("text/plain")
    text = reply.decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.fullmatch(r"# (HELP|TYPE) warmspec_\w+ .+", line), line
            continue
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    assert samples['warmspec_http_requests_total{route="/v1/chat/completions",status="200"}'] >= 1
    assert samples['warmspec_http_requests_total{route="/health",status="200"}'] >= 1
    totals = server.app.engine.totals
    assert samples["warmspec_completion_tokens_total"] == totals.completion_tokens > 0
    assert samples["warmspec_passes_total"] == totals.passes > 0
    assert samples["warmspec_drafted_tokens_total"] == totals.drafted
    assert samples["warmspec_accepted_tokens_total"] == totals.accepted
    assert samples["warmspec_tokens_per_pass"] == pytest.approx(totals.tokens_per_pass, rel=1e-5)
    assert samples["warmspec_acceptance_ratio"] == pytest.approx(totals.acceptance, rel=1e-5, abs=1e-9)
    assert samples["warmspec_queue_depth"] == 0
    prefix = server.app.engine.prefix_stats()
    assert samples["warmspec_prefix_cache_hits_total"] == prefix.hits
    assert samples["warmspec_prefix_cache_misses_total"] == prefix.misses
    assert samples["warmspec_prefix_cache_hits_total"] + samples["warmspec_prefix_cache_misses_total"] >= 1
    assert samples["warmspec_prefix_cache_tokens_reused_total"] == prefix.tokens_reused
    assert "warmspec_workspace_files" in samples
    assert f'warmspec_model_info{{model="{default_lm.name}"' in text


# -- tool calls -------------------------------------------------------------------------------------

HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these functions:\n<tools>\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\nFor each call, return "
    "<tool_call>{\"name\": <name>, \"arguments\": <args>}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALL_REPLY = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def with_template(tok: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(tok.backend, token_bytes=list(tok.token_bytes), special_ids=tok.special_ids,
                     eos_ids=tok.eos_ids, bos_token=tok.bos_token, eos_token=tok.eos_token,
                     chat_template=template)


class ScriptedEngine:
    """Stands in for ``Engine`` behind a real ``App`` and ``Scheduler``: answers ``reply`` in
    5-character pieces (so tags straddle deltas) and records the prompts it was given."""

    speculate = False

    def __init__(self) -> None:
        self.totals = GenerationStats()
        self.reply = CALL_REPLY
        self.fail: Exception | None = None  # raised after the first piece
        self.prompts: list[list[int]] = []

    def reset(self) -> None:
        pass

    def generate(self, prompt, params, *, max_tokens, stop=(), speculate=None, sources=(), prediction=(),
                 cancelled=None):
        self.prompts.append(list(prompt))
        pieces = [self.reply[i:i + 5] for i in range(0, len(self.reply), 5)]
        for piece in pieces:
            yield Delta(piece, [])
            if self.fail is not None:
                raise self.fail
        yield Finished("stop", self.reply, [], GenerationStats(prompt_tokens=len(prompt),
                                                               completion_tokens=len(pieces), passes=len(pieces)))


@pytest.fixture(scope="module")
def tool_server(default_lm):
    tok = with_template(default_lm.tokenizer, HERMES_TEMPLATE)
    lm = LoadedModel(model=default_lm.model, tokenizer=tok, name="hermes-scripted", source="test",
                     context_length=8192)
    srv = Server(App(lm, ScriptedEngine()))
    yield srv
    srv.close()


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def test_tool_format_is_found_by_rendering(default_lm):
    tok = default_lm.tokenizer
    assert tool_format(tok) == "none"  # SmolLM2's template ignores tools
    assert tool_format(with_template(tok, HERMES_TEMPLATE)) == "hermes"
    assert tool_format(with_template(tok, "{{ tools | tojson }}{% for m in messages %}{{ m.content }}{% endfor %}")) == "unparsed"


def test_tool_call_splitter_streams_text_and_holds_calls():
    split = ToolCallSplitter()
    out = "".join(split.feed(CALL_REPLY[i:i + 3]) for i in range(0, len(CALL_REPLY), 3))
    tail, calls = split.finish()
    assert out == "Let me check." and tail == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    split = ToolCallSplitter()
    assert split.feed("a <tool") == "a " and split.feed(" is a tag") == "<tool is a tag"
    assert split.finish() == ("", [])
    split = ToolCallSplitter()
    assert split.feed("x<tool_call>not json</tool_call>") == "x"
    assert split.finish() == ("<tool_call>not json</tool_call>", [])  # never dropped
    assert parse_tool_calls('<tool_call>{"name": "a"}</tool_call> <tool_call>{"name": "b", "arguments": {"x": 1}}'
                            '</tool_call>') is not None
    assert parse_tool_calls('<tool_call>{"name": "a"}</tool_call> trailing words') is None


def test_what_agent_clis_send_is_accepted(tool_server):
    """Claude Code sends system turns inside ``messages``; Codex CLI sends Responses tools of kinds
    other than ``function`` (``namespace``). Both were refused with a 400, which ended the agents'
    first turn (tests/test_agent_clis.py runs the CLIs themselves)."""
    engine = tool_server.app.engine
    engine.reply = "Fine."
    tok = tool_server.app.lm.tokenizer
    m = tool_server.anthropic().messages.create(model="m", max_tokens=20, messages=[
        {"role": "user", "content": "hi"}, {"role": "system", "content": "Answer in one word."}])
    assert m.content[0].text == "Fine." and "system\nAnswer in one word." in tok.decode(engine.prompts[-1])
    tools = [{"type": "namespace", "name": "mcp", "description": "a group of tools", "tools": []},
             {"type": "custom", "name": "apply_patch", "description": "freeform"},
             {"type": "function", "name": "get_weather", "description": "Weather in a city",
              "parameters": WEATHER["function"]["parameters"]}]
    r = tool_server.openai().responses.create(model="m", input="Weather in Paris?", tools=tools)
    prompt = tok.decode(engine.prompts[-1])
    assert r.output_text == "Fine." and "Weather in a city" in prompt and "freeform" not in prompt
    status, _, body = tool_server.post("/v1/responses", {"input": "hi", "tools": [{"type": "function"}]})
    assert status == 400 and b"tools[0].name" in body


def test_tool_calls_in_every_api(tool_server):
    engine = tool_server.app.engine
    engine.reply = CALL_REPLY
    client = tool_server.openai()
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER])
    assert tool_server.app.lm.tokenizer.decode(engine.prompts[-1]).count("Weather in a city") == 1
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    chunks = list(client.chat.completions.create(model="m", messages=messages, tools=[WEATHER], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Let me check."
    streamed = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in streamed] == [("get_weather", {"city": "Paris"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # the call and its result go back to the template on the next turn
    history = messages + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
    engine.reply = "It is 18 C."
    r = client.chat.completions.create(model="m", messages=history, tools=[WEATHER])
    assert r.choices[0].message.content == "It is 18 C." and r.choices[0].finish_reason == "stop"
    prompt = tool_server.app.lm.tokenizer.decode(engine.prompts[-1])
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert "tool\n18 C and sunny" in prompt  # special tokens such as <|im_start|> decode to ""

    engine.reply = CALL_REPLY
    tools = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER["function"]["parameters"]}]
    m = tool_server.anthropic().messages.create(model="m", max_tokens=50, messages=messages, tools=tools)
    assert m.stop_reason == "tool_use" and m.content[0].text == "Let me check."
    assert (m.content[1].type, m.content[1].name, m.content[1].input) == ("tool_use", "get_weather", {"city": "Paris"})
    with tool_server.anthropic().messages.stream(model="m", max_tokens=50, messages=messages, tools=tools) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"] and final.content[1].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"

    fn = {"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": WEATHER["function"]["parameters"]}
    with client.responses.stream(model="m", input="Weather in Paris?", tools=[fn]) as s:
        final = s.get_final_response()
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert final.output_text == "Let me check." and json.loads(final.output[1].arguments) == {"city": "Paris"}

    with pytest.raises(openai.BadRequestError, match="tool_choice 'required' is not supported"):
        client.chat.completions.create(model="m", messages=messages, tools=[WEATHER], tool_choice="required")
    engine.reply = "<tool_call>not json</tool_call>"
    r = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER])
    assert r.choices[0].message.content == engine.reply and r.choices[0].finish_reason == "stop"


def test_failures_after_the_stream_opened_reach_the_client(tool_server):
    """A job that fails mid-way: a daemon fault is a 500 (or an error event in the stream's
    format, which each SDK raises), a client error a 400, and the server carries on."""
    engine = tool_server.app.engine
    messages = [{"role": "user", "content": "x"}]
    engine.fail = RuntimeError("the model fell over")
    try:
        with pytest.raises(openai.InternalServerError, match="RuntimeError: the model fell over"):
            tool_server.openai().chat.completions.create(model="m", messages=messages)
        with pytest.raises(openai.APIError, match="the model fell over"):
            list(tool_server.openai().chat.completions.create(model="m", messages=messages, stream=True))
        with pytest.raises(anthropic.APIStatusError, match="api_error"):
            with tool_server.anthropic().messages.stream(model="m", max_tokens=5, messages=messages) as s:
                s.get_final_message()
        with tool_server.openai().responses.stream(model="m", input="x") as s:
            kinds = [ev.type for ev in s]
        assert kinds[-1] == "response.failed"
        engine.fail = EngineError("prompt too long for this engine")
        status, _, reply = tool_server.post("/v1/completions", {"prompt": "x", "max_tokens": 3}, key=None)
        assert status == 400 and json.loads(reply)["error"]["message"] == "prompt too long for this engine"
    finally:
        engine.fail = None
    engine.reply = "fine"
    assert tool_server.openai().chat.completions.create(model="m", messages=messages).choices[0].message.content == "fine"
