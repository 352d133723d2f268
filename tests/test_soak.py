"""``warmspec soak``: the real command end to end on a tiny random model (fast, so many answers
complete and get replayed), and its checks on fabricated runs, to show each criterion can fail."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import types
from pathlib import Path

import mlx.core as mx
import msgspec
from mlx.utils import tree_flatten
from tokenizers import decoders

import tiny
from warmspec import soak
from warmspec.core.engine import Engine
from warmspec.server.app import App
from warmspec.server.http import Context
from warmspec.tokenizer import byte_tokenizer
from warmspec_protocol import GenerationStats, ModelInfo, SamplingParams, Status
from warmspec_protocol.soak import DaemonRun, MemorySample, RequestRecord, SoakResults


def tiny_model_dir(path: Path) -> Path:
    """tests/tiny.py's random llama as an MLX model directory, with a byte-level tokenizer: it
    loads in milliseconds and decodes hundreds of tokens a second on this CPU."""
    path.mkdir(parents=True)
    lm = tiny.build("llama")
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(lm.model.parameters())))
    (path / "config.json").write_text(json.dumps(dict(tiny.CONFIGS["llama"], max_position_embeddings=4096)))
    backend = byte_tokenizer().backend
    backend.decoder = decoders.ByteLevel()
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text("{}")
    return path


def test_soak_runs_end_to_end_and_reports(tmp_path):
    out = tmp_path / "soak"
    model = tiny_model_dir(tmp_path / "tiny-llama")
    run = subprocess.run(
        [sys.executable, "-m", "warmspec", "soak", "--seconds", "15", "--out", str(out), "--model", str(model),
         "--seed", "3", "--editors", "2", "--relay-editors", "1", "--agents", "3", "--workspace-files", "8",
         "--sample-s", "1", "--drain-s", "5", "--request-timeout", "60", "--max-tokens", "8",
         "--inline-max-tokens", "8", "--inline-prefix-chars", "400", "--inline-suffix-chars", "100",
         "--tool-chars", "300", "--long-prompt-chars", "1500",
         "--prefix-budget", "400000"],  # ~800 tokens of the tiny model's states (bytes): evictions
        capture_output=True, text=True, timeout=300)
    assert run.returncode in (0, 1), run.stderr[-3000:]
    res = msgspec.json.decode((out / "results.json").read_bytes(), type=SoakResults)
    assert res.passed == (run.returncode == 0)
    assert res.settings.seed == 3 and res.settings.seconds == 15
    assert [c.name for c in res.criteria] == ["no unexpected failures", "no engine resets",
                                              "greedy answers equal to alone", "resident memory flat after warm-up",
                                              "daemon log clean, clean exit"]
    assert run.stdout.splitlines()[-1].startswith("PASS" if res.passed else "FAIL")

    # every actor made requests over its transport; each record is accounted for
    kinds = {r.kind for r in res.requests}
    assert {"inline", "connect", "chat_rpc"} <= kinds, kinds
    assert kinds & {"chat_http", "chat_http_stream"} and kinds & {"messages_http", "messages_http_stream"}, kinds
    assert kinds & set(soak.CHAOS) and kinds & {"malformed_rpc", "malformed_http"}, kinds
    assert {r.transport for r in res.requests} == {"unix", "relay", "http"}
    assert {r.outcome for r in res.requests} <= {"ok", "failed", "cancelled", "malformed"}
    assert all(r.id.startswith(r.actor + "#") for r in res.requests)
    assert sum(k.requests for k in res.kinds) == len(res.requests)
    assert res.keystrokes > 0 and any(r.kind == "inline" and r.outcome == "ok" for r in res.requests)

    # every distinct greedy answer was replayed alone on the second daemon
    keys = {r.key for r in res.requests if r.key is not None}
    assert keys and {r.key for r in res.replays} == keys
    assert [d.role for d in res.daemons] == ["load", "replay"]
    assert res.daemons[0].status is not None or not res.daemons[0].alive
    assert len(res.files) == 8 and sorted(p.name for p in out.iterdir()) == [
        "daemon-load.log", "daemon-replay.log", "editor-0-lsp.log", "report.md", "results.json", "rss.png"]
    assert len([m for m in res.memory if m.t_s >= res.warmup_s]) >= 2
    assert all(m.rss_bytes > 0 for m in res.memory)

    report = (out / "report.md").read_text()
    for heading in ("## Criteria", "## Requests per kind", "## Unexpected failures", "## The daemon",
                    "## Resident memory", "## Replay"):
        assert heading in report
    assert report.count("Verdict: **" + ("PASS" if res.passed else "FAIL")) == 2
    assert (out / "rss.png").stat().st_size > 0


# -- the checks, on fabricated runs -----------------------------------------------------------------


def status(**changes) -> Status:
    model = ModelInfo(id="m", source="s", device="cpu", quantized=False, context_length=None,
                      parameters_bytes=0, defaults=SamplingParams())
    return msgspec.structs.replace(Status(pid=1, model=model, blas="b", uptime_s=1.0, queue=0, active=False,
                                          requests_completed=10, requests_failed=0, totals=GenerationStats()),
                                   **changes)


def healthy() -> dict:
    requests = [RequestRecord(id="agent-0#0", actor="agent-0", kind="chat_http", transport="http", intent="normal",
                              outcome="ok", started_s=1.0, greedy=True, key="k1", text="hello", tokens=2),
                RequestRecord(id="editor-0#1", actor="editor-0", kind="inline", transport="unix", intent="cancel",
                              outcome="cancelled", started_s=2.0, error="error -32801: superseded"),
                RequestRecord(id="fuzz#0", actor="fuzz", kind="malformed_rpc", transport="unix", intent="malformed",
                              outcome="malformed", started_s=3.0)]
    daemons = [DaemonRun(role="load", pid=1, log="l", ready_s=1.0, exit_code=0, status=status()),
               DaemonRun(role="replay", pid=2, log="r", ready_s=1.0, exit_code=0)]
    memory = [MemorySample(t_s=t, rss_bytes=(500 + t // 10) << 20) for t in range(0, 200, 5)]
    replays = [soak.compare("k1", requests[:1], soak.Answer(text="hello", tokens=2))]
    return dict(requests=requests, daemons=daemons, memory=memory, replays=replays, warmup_s=20.0)


def verdicts(run: dict) -> dict[str, bool]:
    return {c.name: c.passed for c in soak.judge(**run)}


def test_a_healthy_run_passes_every_criterion():
    assert all(verdicts(healthy()).values()), soak.judge(**healthy())


def test_each_criterion_can_fail():
    run = healthy()
    run["requests"][0] = msgspec.structs.replace(run["requests"][0], outcome="failed", error="HTTP 500")
    assert not verdicts(run)["no unexpected failures"]

    run = healthy()
    run["daemons"][0].status = status(requests_failed=1)  # a job failed for a client that had left
    assert not verdicts(run)["no unexpected failures"]

    run = healthy()
    run["daemons"][0].alive = False
    assert not verdicts(run)["no unexpected failures"]

    run = healthy()
    run["daemons"][0].status = status(engine_resets=1)
    assert not verdicts(run)["no engine resets"]

    run = healthy()
    run["replays"] = [soak.compare("k1", run["requests"][:1], soak.Answer(text="hellp", tokens=2))]
    assert not verdicts(run)["greedy answers equal to alone"]
    run["replays"] = [soak.compare("k1", run["requests"][:1], soak.Answer(text="hello", tokens=3))]
    assert not verdicts(run)["greedy answers equal to alone"]  # same text, other token count
    run["replays"] = [soak.compare("k1", run["requests"][:1], soak.Answer(error="no answer in time"))]
    assert not verdicts(run)["greedy answers equal to alone"]
    run["replays"] = []
    assert not verdicts(run)["greedy answers equal to alone"]  # nothing compared proves nothing

    run = healthy()
    run["memory"] += [MemorySample(t_s=200.0, rss_bytes=600 << 20)]  # +18% after warm-up
    assert not verdicts(run)["resident memory flat after warm-up"]
    run = healthy()
    run["memory"] = [MemorySample(t_s=1.0, rss_bytes=100 << 20)] + run["memory"][1:]  # growth in warm-up only
    assert verdicts(run)["resident memory flat after warm-up"]
    run["memory"] = run["memory"][:4]
    assert not verdicts(run)["resident memory flat after warm-up"]  # too few samples after warm-up
    # requests in flight: samples 500 or 580 MiB (16% apart) in every window, peaks flat: passes;
    # the same with the peaks climbing 2% a window (a leak): 500 -> 600 MiB over 10 windows fails
    saw = [MemorySample(t_s=t, rss_bytes=(580 if t % 10 else 500) << 20) for t in range(0, 700, 5)]
    assert verdicts(dict(run, memory=saw, warmup_s=100.0))["resident memory flat after warm-up"]
    leak = [MemorySample(t_s=t, rss_bytes=int((500 + t / 7) * 2**20)) for t in range(0, 700, 5)]
    assert not verdicts(dict(run, memory=leak, warmup_s=100.0))["resident memory flat after warm-up"]
    assert soak.window_peaks(saw, 100.0) == [580 << 20] * 10  # 100-695 s: ten windows

    run = healthy()
    run["daemons"][1].log_errors = ["traceback: RuntimeError: Event loop is closed"]
    assert not verdicts(run)["daemon log clean, clean exit"]
    run = healthy()
    run["daemons"][0].exit_code = 1
    assert not verdicts(run)["daemon log clean, clean exit"]


def test_compare_names_the_differing_request_and_where():
    recs = [RequestRecord(id=f"editor-1#{i}", actor="editor-1", kind="inline", transport="unix", intent="normal",
                          outcome="ok", started_s=float(i), greedy=True, key="k", text=text)
            for i, text in enumerate(["    return x\n", "    return y\n"])]
    r = soak.compare("k", recs, soak.Answer(text="    return x\n"))
    assert not r.equal and r.differing == ["editor-1#1"]
    assert "from character 11" in r.difference and "'y\\n'" in r.difference


def test_log_errors_finds_error_lines_and_tracebacks():
    log = """2026-12-01 10:06:48,611 warmspec.http INFO POST /v1/messages: the client disconnected
2026-12-01 10:06:48,878 warmspec.scheduler ERROR request http messages failed
Traceback (most recent call last):
  File "scheduler.py", line 171, in _run
    ticket._push(event)
RuntimeError: Event loop is closed
2026-12-01 10:06:49,000 warmspec.daemon INFO stopping
Exception in thread warmspec-engine:
Traceback (most recent call last):
  File "threading.py", line 1045, in _bootstrap_inner

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "scheduler.py", line 180, in _run
RuntimeError: Event loop is closed
"""
    errors = soak.log_errors(log)
    assert errors[0].endswith("ERROR request http messages failed")
    assert errors[1:] == ["traceback: RuntimeError: Event loop is closed"] * 3


def test_the_load_is_the_same_for_the_same_seed(tmp_path):
    """Agents' requests come from the seed alone, not from answers: same seed, same bytes."""
    files = []
    for i in range(4):
        f = tmp_path / f"m{i}.py"
        f.write_text(f"def f{i}(x):\n    return x + {i}\n" * 30)
        files.append(f)
    ctx = types.SimpleNamespace(files=files, texts={f: f.read_text() for f in files}, workspace=tmp_path,
                                settings=types.SimpleNamespace(tool_chars=200))

    def bodies(seed: int) -> list[bytes]:
        rng = random.Random(f"{seed}/agent-0")
        conv = soak.new_conversation(ctx, rng, "agent-0-c0")
        out = []
        for _ in range(4):
            for api in ("openai", "anthropic"):
                out.append(soak.chat_body(api, conv.history, stream=False, max_tokens=8, temperature=0.0,
                                          seed=None, stop=None).body)
            soak.next_step(ctx, rng, conv)
        return out

    assert bodies(1) == bodies(1)
    assert bodies(1) != bodies(2)
    anthropic = json.loads(bodies(1)[1])
    roles = [m["role"] for m in anthropic["messages"]]
    assert roles[0] == "user" and all(a != b for a, b in zip(roles, roles[1:]))  # alternating, as the API wants


def test_engine_resets_are_counted_in_status_and_metrics():
    lm = tiny.build("llama")
    app = App(lm, Engine(lm, speculate=False))
    assert app.status().engine_resets == 0
    app.engine.reset()
    app.engine.reset()
    assert app.status().engine_resets == 2
    assert "warmspec_engine_resets_total 2\n" in Context(app, 5.0).prometheus()
