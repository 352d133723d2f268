"""Hypothesis throws malformed bodies, near-valid requests with wrong fields, odd paths and odd
headers at the HTTP server: every reply must be a well-formed JSON error (4xx) in the API's own
format, nothing may crash, and the server must answer a valid request afterwards.

Near-valid requests always carry an invalid token limit, so no fuzz case ever starts a generation
(each would take seconds); the fields around it still get decoded and checked first.
"""

from __future__ import annotations

import json
import re
import string

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from test_http import COSTS, KEY, Server
from warmspec.core.engine import Engine
from warmspec.core.gate import CostTable
from warmspec.server.app import App, Limits

LIMITS = Limits(max_body_bytes=16 << 10)
POSTS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"]
GETS = ["/v1/models", "/metrics", "/health", "/", "/status", "/status.json", "/v1/models/x"]
USER = [{"role": "user", "content": "hi"}]
# each endpoint's request with the field that bounds its generation, and its other fields
NEAR_VALID = {
    "/v1/chat/completions": ({"model": "m", "messages": USER}, "max_tokens",
                             ["messages", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
                              "stream_options", "n", "tools", "tool_choice", "logprobs"]),
    "/v1/completions": ({"model": "m", "prompt": "hi"}, "max_tokens",
                        ["prompt", "temperature", "seed", "stop", "stream", "echo", "suffix", "n", "logprobs"]),
    "/v1/responses": ({"model": "m", "input": "hi"}, "max_output_tokens",
                      ["input", "instructions", "temperature", "top_p", "stream", "tools", "tool_choice",
                       "previous_response_id", "metadata", "stop"]),
    "/v1/messages": ({"model": "m", "messages": USER}, "max_tokens",
                     ["messages", "system", "temperature", "top_k", "stop_sequences", "stream", "tools",
                      "tool_choice", "seed"]),
}
SKIPPED_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "expect", "upgrade"}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12)
texts = st.text(max_size=20)
parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "input_text", "image_url", "tool_use",
                                                                  "tool_result", "x"]), "text": texts}), max_size=3)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "bot"]), "content": texts | parts},
    optional={"tool_calls": st.lists(st.fixed_dictionaries({"id": texts, "type": st.just("function"), "function":
                                     st.fixed_dictionaries({"name": texts, "arguments": texts})}), max_size=2),
              "tool_call_id": texts, "name": texts}), max_size=3)
tools = st.lists(st.fixed_dictionaries({"type": st.just("function"), "name": texts, "input_schema": st.just({}),
                                        "function": st.fixed_dictionaries({"name": texts})}), max_size=2)
# well-typed (often out-of-range) values for the fields each endpoint reads
PLAUSIBLE = {
    "messages": messages, "prompt": texts | st.lists(texts, max_size=3), "system": texts | parts,
    "input": texts | st.lists(st.fixed_dictionaries({}, optional={
        "type": st.sampled_from(["message", "function_call", "function_call_output", "x"]),
        "role": st.sampled_from(["user", "assistant", "developer", "tool"]), "content": texts | parts,
        "call_id": texts, "name": texts, "arguments": texts, "output": texts}), max_size=3),
    "instructions": texts, "temperature": st.floats(-1, 12), "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-5, 2**64), "min_p": st.floats(-0.5, 1.5), "seed": st.integers(-(2**65), 2**65),
    "stop": texts | st.lists(st.text(max_size=300), max_size=20), "stop_sequences": st.lists(texts, max_size=20),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.integers(-1, 3), "logprobs": st.booleans() | st.integers(0, 3), "echo": st.booleans(),
    "suffix": texts, "tools": tools, "previous_response_id": texts, "metadata": st.dictionaries(texts, texts),
    "tool_choice": st.sampled_from(["auto", "none", "required", "any", {"type": "auto"}, {"type": "tool"},
                                    {"type": "function", "name": "f"}, {"type": "function", "function": {"name": "f"}}]),
}
bad_ints = st.sampled_from([0, -1, -(2**40), LIMITS.max_tokens + 1, 2**63 - 1])


def mostly(usual: st.SearchStrategy, rare: st.SearchStrategy) -> st.SearchStrategy:
    """``usual`` three times in four: well-typed values get past decoding to the checks behind it."""
    return st.tuples(st.integers(0, 3), usual, rare).map(lambda t: t[2] if t[0] == 0 else t[1])


bad_limits = mostly(bad_ints, st.text(max_size=4) | st.booleans() | st.just([1]))
header_values = st.text(alphabet=string.printable.strip("\r\n\x0b\x0c"), max_size=40)
header_names = st.sampled_from(["Content-Type", "Content-Encoding", "Accept", "Accept-Encoding", "Cookie",
                                 "Origin", "Authorization", "x-api-key"]) \
    | st.text(alphabet=string.ascii_letters + string.digits + "-_", min_size=1, max_size=20).filter(
        lambda n: n.lower() not in SKIPPED_HEADERS)
good_auth = st.sampled_from([{"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}, {"authorization": f"bearer {KEY}"}])
bad_auth = st.dictionaries(st.sampled_from(["Authorization", "x-api-key"]),
                           st.sampled_from([KEY, f"Bearer {KEY} x", "", "Bearer", f"Basic {KEY}"]) | header_values,
                           max_size=2)
paths = st.text(alphabet=string.ascii_letters + string.digits + "/-_.%~", max_size=30).map(lambda p: "/" + p)


@pytest.fixture(scope="module")
def server(default_lm):
    srv = Server(App(default_lm, Engine(default_lm, costs=CostTable(COSTS)), api_key=KEY, limits=LIMITS))
    yield srv
    srv.close()


def check_error(path: str, status: int, headers: dict[str, str], body: bytes) -> None:
    assert 400 <= status < 500, (status, body[:300])
    assert headers["content-type"].startswith("application/json"), headers
    reply = json.loads(body)
    message = reply["error"]["message"]
    what = message.split(":")[0] if "`" not in message else message[message.find("`"):]
    event(f"{status} {re.sub(r'[0-9]+', 'N', what)[:60]}")  # see --hypothesis-show-statistics
    if path.startswith("/v1/messages"):
        assert reply["type"] == "error" and set(reply["error"]) == {"type", "message"}
        assert isinstance(reply["error"]["message"], str) and reply["error"]["message"]
    else:
        assert set(reply) == {"error"} and set(reply["error"]) == {"message", "type", "param", "code"}
        assert isinstance(reply["error"]["message"], str) and reply["error"]["message"]


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


def still_serving(srv: Server) -> None:
    status, _, body = srv.post("/v1/chat/completions", {"model": "m", "messages": USER, "max_tokens": 2})
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] >= 1


fuzz = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)


@fuzz
@given(path=st.sampled_from(POSTS), body=st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
def test_garbage_bodies(server, path, body):
    status, headers, reply = server.request("POST", path, body, auth())
    if path.endswith("count_tokens") and status == 200:  # a body that happens to be a valid count
        assert "input_tokens" in json.loads(reply)
        return
    check_error(path, status, headers, reply)


@fuzz
@given(data=st.data(), path=st.sampled_from(list(NEAR_VALID)))
def test_near_valid_requests_with_wrong_fields(server, data, path):
    base, limit_field, fields = NEAR_VALID[path]
    body = dict(base, **{limit_field: data.draw(bad_limits, "limit")})
    for field in data.draw(st.lists(st.sampled_from(fields), max_size=3, unique=True), "fields"):
        body[field] = data.draw(mostly(PLAUSIBLE[field], json_values), field)
    if data.draw(st.booleans(), "mutate a message") and isinstance(body.get("messages"), list):
        message = dict(USER[0], **data.draw(st.dictionaries(st.sampled_from(["role", "content", "name", "tool_calls"]),
                                                            json_values, max_size=2), "message"))
        body["messages"] = [message]
    status, headers, reply = server.request("POST", path, json.dumps(body).encode(), auth())
    check_error(path, status, headers, reply)


@fuzz
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
       path=st.sampled_from(POSTS + GETS) | paths,
       key=good_auth | bad_auth,
       extra=st.dictionaries(header_names, header_values, max_size=4),
       body=st.binary(max_size=64))
def test_odd_methods_paths_and_headers(server, method, path, key, extra, body):
    status, reply_headers, reply = server.request(method, path, body, key | extra)
    if status < 400:  # a GET that passed the key check
        assert method == "GET" and path in GETS[:-1], (method, path, status)
        return
    check_error(path, status, reply_headers, reply)


def test_serves_after_fuzzing(server):
    still_serving(server)
    assert server.ctx.requests  # and it counted what it saw
    assert not any(status >= 500 for _, status in server.ctx.requests)
