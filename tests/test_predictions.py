"""Predicted outputs (OpenAI's ``prediction``) end to end, on the default model: through the HTTP
API with the official ``openai`` SDK, through JSON-RPC ``warmspec/chat``, and through
``warmspec edit``, which passes the file it rewrites as the prediction.

A prediction only changes how the answer is drafted, never the answer: greedy answers with a right
prediction, a wrong one and none must be the same text, and the usage's prediction counts must be
what the engine's per-source statistics say.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import openai
import pytest

from conftest import SAMPLE_FILE
from test_http import Server
from warmspec.cli import EDIT_SYSTEM, build_prompt_messages, first_code_block
from warmspec.client import Client
from warmspec.core import Engine
from warmspec.server.app import App
from warmspec.server.rpc import RpcService
from warmspec_protocol import Message
from warmspec_protocol import rpc as wire

KEY = "test-key"
TASK = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
UNRELATED = ("The lighthouse keeper climbed the stairs every evening at dusk, counting the steps "
             "aloud, and lit the lamp before the fishing boats came home across the bay. " * 3)


@pytest.fixture(scope="module")
def server(default_lm, default_costs, tmp_path_factory):
    """One daemon, HTTP and JSON-RPC over a Unix socket in front of the same app, as ``serve``.
    Ungated: the gate times the host's work per step and pauses drafting when it is slow, so on a
    busy machine what a prediction got to draft would vary from run to run; here every step drafts
    what the drafter proposes, and the counts follow from the tokens alone."""
    engine = Engine(default_lm, costs=default_costs, observe_costs=False, gated=False)
    app = App(default_lm, engine, api_key=KEY)
    srv = Server(app)
    srv.socket = tmp_path_factory.mktemp("rpc") / "rpc.sock"
    srv.service = RpcService(app)
    asyncio.run_coroutine_threadsafe(srv.service.serve_unix(srv.socket), srv.loop).result(30)
    yield srv
    asyncio.run_coroutine_threadsafe(srv.service.close(), srv.loop).result(30)
    srv.close()


def forget_answers(srv: Server) -> None:
    """Drop the engine's recent answers, a draft source of their own, so that what a request's
    prediction does is not mixed with what repeating the last answer does."""
    srv.wait_idle()
    srv.app.engine.recent.clear()


def ask(srv: Server, **kw):
    forget_answers(srv)
    return srv.openai().chat.completions.create(model="m", messages=TASK, temperature=0, max_tokens=64, **kw)


def test_a_right_prediction_is_accepted_and_changes_nothing(server):
    plain = ask(server)
    answer = plain.choices[0].message.content
    assert plain.usage.completion_tokens > 20
    details = plain.usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)

    predicted = ask(server, prediction={"type": "content", "content": answer})
    assert predicted.choices[0].message.content == answer
    details = predicted.usage.completion_tokens_details
    counts = predicted.model_extra["warmspec"]["sources"]["prediction"]
    assert details.accepted_prediction_tokens == counts["accepted"] > predicted.usage.completion_tokens // 2
    assert details.rejected_prediction_tokens == counts["drafted"] - counts["accepted"]
    assert predicted.model_extra["warmspec"]["passes"] < plain.model_extra["warmspec"]["passes"]

    # text parts, streamed, with usage in the last chunk: the same
    chunks = list(server.openai().chat.completions.create(
        model="m", messages=TASK, temperature=0, max_tokens=64, stream=True,
        stream_options={"include_usage": True},
        prediction={"type": "content", "content": [{"type": "text", "text": answer}]}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0


def test_an_unrelated_prediction_is_thrown_away_and_changes_nothing(server):
    answer = ask(server).choices[0].message.content
    wrong = ask(server, prediction={"type": "content", "content": UNRELATED})
    assert wrong.choices[0].message.content == answer
    details = wrong.usage.completion_tokens_details
    counts = wrong.model_extra["warmspec"]["sources"]["prediction"]
    assert details.rejected_prediction_tokens == counts["drafted"] - counts["accepted"] > 0
    assert details.accepted_prediction_tokens == counts["accepted"]


def test_bad_predictions_are_refused(server):
    client = server.openai()
    with pytest.raises(openai.BadRequestError, match="prediction"):
        client.chat.completions.create(model="m", messages=TASK, max_tokens=4,
                                       prediction={"type": "image", "content": "x"})
    with pytest.raises(openai.BadRequestError, match="not supported"):
        client.chat.completions.create(model="m", messages=TASK, max_tokens=4,
                                       prediction={"type": "content", "content": [{"type": "image_url"}]})
    too_long = "x" * (server.app.max_prompt_chars + 1)
    with pytest.raises(openai.BadRequestError, match="cannot fit the context"):
        client.chat.completions.create(model="m", messages=TASK, max_tokens=4,
                                       prediction={"type": "content", "content": too_long})
    assert ask(server).choices[0].message.content  # and the daemon keeps serving


def test_json_rpc_chat_takes_a_prediction(server):
    messages = [Message(role="user", content=TASK[0]["content"])]
    with Client.unix(server.socket, timeout=120) as c:
        c.initialize(api_key=KEY)
        forget_answers(server)
        plain = c.call("warmspec/chat", wire.ChatParams(messages=messages, max_tokens=64, temperature=0),
                       wire.GenerateResult)
        forget_answers(server)
        predicted = c.call("warmspec/chat", wire.ChatParams(messages=messages, max_tokens=64, temperature=0,
                                                            prediction=plain.text), wire.GenerateResult)
    assert predicted.text == plain.text
    assert "prediction" not in plain.stats.sources
    assert predicted.stats.sources["prediction"].accepted > predicted.stats.completion_tokens // 2


def test_first_code_block():
    assert first_code_block("Here:\n```python\na = 1\n\nb = 2\n```\nDone.\n```\nx\n```") == "a = 1\n\nb = 2\n"
    assert first_code_block("  ```\nx\n  ```") == "x\n"
    assert first_code_block("no block") is None
    assert first_code_block("```\ncut before the fence closed") is None


def test_warmspec_edit_passes_the_file_as_the_prediction(server, tmp_path, monkeypatch):
    """``warmspec edit`` through the daemon's socket: the file goes as the prediction, and the new
    file is the first code block of the answer the same chat gets without a prediction. (How much
    of the prediction is drafted here depends on the gate, which times the host's work: the file is
    in the prompt too, and the prompt's copy is drafted where it agrees with the answer for longer.)"""
    path = tmp_path / "paths.py"
    path.write_text(SAMPLE_FILE)
    instruction = "rename the function cache_dir to cache_root"
    env = dict(os.environ, WARMSPEC_API_KEY=KEY)
    predicted: list[str | None] = []
    tokens = server.app.prediction_tokens
    monkeypatch.setattr(server.app, "prediction_tokens", lambda text: (predicted.append(text), tokens(text))[1])
    forget_answers(server)
    r = subprocess.run([sys.executable, "-m", "warmspec", "edit", "--socket", str(server.socket), "--temp", "0",
                        str(path), instruction], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode in (0, 3), r.stderr
    assert predicted == [f"```\n{SAMPLE_FILE}```"]  # the file, in the fence the system prompt asks for
    assert "tokens accepted" in r.stderr.rsplit("prediction:", 1)[1]  # the summary says what it did

    messages = build_prompt_messages(f"Rewrite the file {path.name}: {instruction}", [path], EDIT_SYSTEM)
    forget_answers(server)
    with Client.unix(server.socket, timeout=600) as c:
        c.initialize(api_key=KEY)
        plain = c.call("warmspec/chat", wire.ChatParams(messages=[Message(**m) for m in messages], temperature=0),
                       wire.GenerateResult)
    expected = first_code_block(plain.text)
    assert expected is not None, plain.text
    assert (r.stdout, r.returncode) == ((expected, 0) if expected != SAMPLE_FILE else ("", 3))

    w = subprocess.run([sys.executable, "-m", "warmspec", "edit", "--socket", str(server.socket), "--temp", "0",
                        "--write", str(path), instruction], env=env, capture_output=True, text=True, timeout=600)
    assert w.returncode == r.returncode and w.stdout == ""
    assert path.read_text() == expected
