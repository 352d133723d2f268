"""``warmspec bench`` end to end on tiny inputs, and the replay model against the real engine.

No timing is asserted: the bench's speed figures are ratios measured side by side, and a test on
a shared machine can only check that they are produced, consistent and exact.
"""

from __future__ import annotations

import argparse
import json

import msgspec
import numpy as np
import pytest

from warmspec import bench, fetch
from warmspec.core.engine import MAX_DRAFT, Engine
from warmspec.core.gate import CostTable
from warmspec_protocol.bench import BenchResults

from conftest import SAMPLE_FILE

from conftest import chat_prompt

# Verify-pass seconds measured on the 2-core development box (OpenBLAS, default model): wide
# passes cost 1.2-2.7x a step at 64 tokens of context and up to 3.7x at 1024, so the gate has
# real choices to make (it refuses short matches and cuts long drafts).
CPU_COSTS = {64: {1: 0.110, 2: 0.128, 4: 0.168, 8: 0.188, 16: 0.208, 24: 0.256, 33: 0.294},
             1024: {1: 0.133, 2: 0.159, 4: 0.211, 8: 0.261, 16: 0.317, 24: 0.422, 33: 0.494}}

SRC = SAMPLE_FILE

OTHER = '''import json
from pathlib import Path


def read_config(path: Path) -> dict:
    """The user's settings, or none."""
    return json.loads(path.read_text()) if path.exists() else {}
'''

ASK = ("Change request:\nRename cache_dir to user_cache_dir.\n\nOutput the complete updated file in "
       "one fenced code block (```python ... ```) and nothing else: no explanation before or after "
       "it, and do not omit or abbreviate any unchanged parts.")
# The default model answers this with the sentence, then end-of-sequence right after drafts that
# were accepted: the pass's drafted tokens must not be lost with the end-of-sequence token.
ECHO = "Say exactly this and nothing else: Hello world, this is a test."
EDIT = ("You are editing the file `paths.py`.\n\nHere is the current content of the file:\n\n"
        f"```python\n{SRC}```\n\n{ASK}")
REFERENCE = "```python\n" + SRC.replace("cache_dir", "user_cache_dir") + "```"


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def write_jsonl(path, cases) -> None:
    path.write_text("".join(json.dumps(c) + "\n" for c in cases))


def test_bench_end_to_end(default_lm, tmp_path):
    copy = tmp_path / "copy.jsonl"
    write_jsonl(copy, [
        {"id": "edit", "messages": user(EDIT), "max_tokens": 24, "reference": REFERENCE},
        {"id": "ws", "messages": user("You are editing the file `pkg/paths.py`, which you read "
                                      "earlier.\n\n" + ASK), "max_tokens": 24,
         "workspace": {"files": {"pkg/paths.py": SRC, "pkg/config.py": OTHER}},
         "read_files": ["pkg/paths.py"], "reference": REFERENCE},
    ])
    chat = tmp_path / "chat.jsonl"
    write_jsonl(chat, [
        {"id": "prose", "messages": user("Describe a lighthouse at night."), "max_tokens": 16},
        {"id": "echo", "messages": user(ECHO), "max_tokens": 16},
        {"id": "conv", "max_tokens": 8, "turns": [
            user(f"Read this file:\n```python\n{SRC}```\nWhat does it do?"),
            [*user(f"Read this file:\n```python\n{SRC}```\nWhat does it do?"),
             {"role": "assistant", "content": "It finds the model cache."},
             {"role": "user", "content": "Which environment variable wins?"}]]},
    ])
    out = tmp_path / "out"
    res = bench.bench(default_lm, [copy, chat], out, costs=CostTable(CPU_COSTS), replay_outputs=True)

    on_disk = msgspec.json.decode((out / "results.json").read_bytes(), type=BenchResults)
    assert on_disk == res
    assert res.model == default_lm.name and res.machine.cores >= 1 and res.machine.blas
    # 4 single-turn cases and one of 2 turns, in 2 modes, alternating per case
    assert len(res.cases) == (4 + 2) * 2
    assert [r.mode for r in res.cases[:4]] == ["plain", "ngram", "plain", "ngram"]
    echo = [r for r in res.cases if r.id == "echo"]
    assert echo[0].finish_reason == "stop" and echo[1].tokens == echo[0].tokens, \
        "ngram lost the tokens drafted just before end-of-sequence"
    assert all(r.identical_to_plain for r in res.cases)
    assert res.summary.ngram.identical == "6/6" and res.summary.plain.identical == "6/6"
    assert res.summary.ngram.divergences == 0 and all(r.divergence is None for r in res.cases)
    ngram_rows = [r for r in res.cases if r.mode == "ngram"]
    slowest = min(ngram_rows, key=lambda r: bench.case_speedup(r, next(
        p for p in res.cases if p.mode == "plain" and (p.id, p.turn) == (r.id, r.turn))))
    assert res.summary.ngram.min_case == slowest.id and res.summary.ngram.min_speedup > 0
    assert set(res.files) == {"copy.jsonl", "chat.jsonl"}
    assert res.files["copy.jsonl"].ngram.cases == 2 and res.files["chat.jsonl"].ngram.cases == 4
    for r in res.cases:
        assert r.tokens > 0 and r.passes > 0 and r.decode_s > 0 and r.ttft_s > 0
        assert r.accepted <= r.drafted and 0.0 <= r.copy_fraction <= 1.0
        # one repeat: the per-source counts add up to the row's own
        assert [sum(c[0] for c in r.sources.values()), sum(c[1] for c in r.sources.values())] == \
            [r.drafted, r.accepted]
        assert r.mode == "ngram" or r.sources == {}
    # the echo drafts from the request itself, and the gate's ledger booked it (its sign is the
    # clock's: 8 tokens on a busy host booked -21 ms in a fresh CI; the ledger's arithmetic is
    # tested on given times in test_speculative)
    assert next(r for r in echo if r.mode == "ngram").sources["request"][1] > 0
    assert echo[1].booked_s != 0.0 and echo[0].booked_s == 0.0
    # the ledger's price of a plain step, from a request's own steady plain steps (plain: none)
    assert all(r.ledger_plain_s == 0.0 for r in res.cases if r.mode == "plain")
    assert any(r.ledger_plain_s > 0.0 for r in ngram_rows)
    assert res.summary.ngram.sources == bench.source_counts(r.sources for r in ngram_rows)
    assert sum(a for _, a in res.summary.ngram.sources.values()) == sum(r.accepted for r in ngram_rows)

    conv = [r for r in res.cases if r.id == "conv"]
    assert [r.turn for r in conv] == [0, 1, 0, 1]
    assert all(r.cached_tokens > 100 for r in conv if r.turn == 1)  # turn 2 found turn 1 cached
    prefix = res.files["chat.jsonl"].prefix_cache
    assert prefix.turns_cold == 2 and prefix.turns_warm == 2 and prefix.ttft_warm_s > 0

    # replays: both references copy the file in the prompt (or the workspace); prose replays
    # plain's own output, which copies nothing
    variants = {(r.id, r.variant): r for r in res.replays}
    assert set(variants) == {("edit", "prompt_only"), ("ws", "prompt_only"), ("ws", "in_prompt"),
                             ("ws", "workspace"), ("prose", "prompt_only"), ("echo", "prompt_only")}
    ref_tokens = len(default_lm.tokenizer.encode(REFERENCE))
    plain = {r.id: r.tokens for r in res.cases if r.mode == "plain"}
    for r in res.replays:
        assert r.tokens_per_pass >= 1.0
        assert r.tokens == (ref_tokens if r.reference == "case" else plain[r.id])
    assert variants["prose", "prompt_only"].reference == "plain"
    assert variants["edit", "prompt_only"].tokens_per_pass > 4
    assert variants["ws", "in_prompt"].tokens_per_pass > 4
    assert variants["ws", "workspace"].tokens_per_pass > 4
    assert variants["ws", "prompt_only"].tokens_per_pass < 2  # the file is nowhere to copy from
    assert set(res.files["copy.jsonl"].replay) == {"prompt_only", "in_prompt", "workspace"}
    assert res.summary.replay["workspace"].projected_speedup > 1.5

    text = (out / "report.md").read_text()
    assert "copy.jsonl" in text and "chat.jsonl" in text and "## Cases" in text
    assert "| copy.jsonl | ws | 0 | ngram |" in text
    png = (out / "speedup.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_replay_of_copied_text_drafts_long(default_lm):
    """A reference that is the prompt's file is drafted many tokens a pass; text that occurs
    nowhere is decoded one token a pass and projects no speedup."""
    prompt = chat_prompt(default_lm, EDIT)
    engine = bench.replay_engine(default_lm, CostTable(CPU_COSTS), MAX_DRAFT)
    copied = default_lm.tokenizer.encode("```python\n" + SRC + "```")
    r = bench.replay(engine, prompt, copied)
    assert r.tokens == copied
    assert r.stats.tokens_per_pass > 5 and r.projected_speedup > 2
    assert len(engine.model.script.decode_passes()) == r.stats.passes

    fresh = default_lm.tokenizer.encode("Quietly, seven purple owls negotiated a treaty over tea.")
    r = bench.replay(engine, prompt, fresh)
    assert r.tokens == fresh
    assert r.stats.tokens_per_pass <= 1.1 and 0.9 < r.projected_speedup < 1.1


@pytest.mark.parametrize("question, n, finish, rejects", [(EDIT, 160, "length", True),
                                                           (ECHO, 40, "stop", False)])
def test_replay_reproduces_real_ngram_run(default_lm, question, n, finish, rejects):
    """Replaying plain's greedy output through the replay model takes the same passes, drafts
    and acceptances as the real ngram run with the same frozen cost table: one verify loop.
    The copy runs into the budget and has drafts rejected; the echo ends in end-of-sequence."""
    prompt = chat_prompt(default_lm, question)
    plain = bench.decode(Engine(default_lm, speculate=False), prompt, n)
    # neither run times the host: the gate decides from the table alone (timed, a busy machine
    # made the two differ by one draft)
    real = bench.decode(Engine(default_lm, costs=CostTable(CPU_COSTS), observe_costs=False, observe_host=False),
                        prompt, n)
    assert plain.finish_reason == finish
    assert real.tokens == plain.tokens
    assert real.stats.accepted > 0 and (real.stats.accepted < real.stats.drafted) == rejects

    engine = bench.replay_engine(default_lm, CostTable(CPU_COSTS), MAX_DRAFT)
    r = bench.replay(engine, prompt, plain.tokens, max_tokens=n)
    assert r.tokens == plain.tokens
    fields = ("completion_tokens", "passes", "drafted", "accepted", "gated_steps")
    assert [getattr(r.stats, f) for f in fields] == [getattr(real.stats, f) for f in fields]


def test_copy_fraction():
    src = list(range(100))
    assert bench.copy_fraction(src[10:40], src) == 1.0
    assert bench.copy_fraction(list(range(200, 230)), src) == 0.0
    assert bench.copy_fraction(src[10:30] + list(range(200, 220)), src) == 0.5
    assert bench.copy_fraction(src[10:15], src) == 0.0  # shorter than a span: no evidence
    loop = list(range(200, 220)) * 3  # repeats itself: drafted from its own output
    assert bench.copy_fraction(loop, src) == 40 / 60
    rng = np.random.default_rng(0)
    assert bench.copy_fraction(rng.integers(0, 50, 300).tolist(), rng.integers(0, 50, 300).tolist()) == 0.0


def test_paired_speedup_compares_runs_of_the_same_repeat():
    """A host that turns twice as slow during the second repeat, between plain's run and the
    mode's: per-mode medians put the mode at 0.5x plain although every repeat but that one ran
    them at the same speed; the median of each repeat's own ratio says 1.0x, and the summary
    counts the case under the floor only by medians."""
    from warmspec_protocol.bench import CaseResult

    def row(mode, runs):
        return CaseResult(file="f", id="c", mode=mode, tokens=100, decode_s=sorted(runs)[len(runs) // 2],
                          prefill_s=0.0, passes=100, drafted=0, accepted=0, identical_to_plain=True,
                          decode_runs=runs)

    plain = row("plain", [1.0, 1.0, 2.0])
    mode = row("ngram", [1.0, 2.0, 2.0])
    assert bench.case_speedup(mode, plain) == 0.5  # medians: 1.0 s against 2.0 s
    assert bench.paired_speedup(mode, plain) == 1.0  # 1/1, 1/2, 2/2
    s = bench.mode_summary([mode], {bench._key(plain): plain})
    assert (s.below_floor, s.below_floor_paired) == (1, 0)
    assert (s.min_speedup, s.min_paired_speedup) == (0.5, 1.0)
    one = row("ngram", [2.0])
    assert bench.paired_speedup(one, plain) == bench.case_speedup(one, plain) == 0.5  # one repeat: medians
    # the host's own noise, told beside the ratios: plain's slowest repeat over its fastest
    steady = CaseResult(file="f", id="d", mode="plain", tokens=100, decode_s=1.0, prefill_s=0.0, passes=100,
                        drafted=0, accepted=0, identical_to_plain=True, decode_runs=[1.0, 1.1, 1.0])
    p = bench.mode_summary([plain, steady], {bench._key(plain): plain, bench._key(steady): steady})
    assert (p.run_spread, p.max_run_spread) == (pytest.approx(1.55), 2.0)
    assert bench.run_spread(one) == 1.0  # one repeat: no spread to tell


def test_the_summary_tells_a_loss_the_ledger_saw_from_the_hosts_noise():
    """Of the cases under the floor, the summary counts those whose ledger (drafting steps against
    the same run's plain steps) booked drafting as losing over 3% of their decode time; and it
    gives the loop's own plain step against plain decoding's time per token."""
    import io

    from warmspec_protocol.bench import CaseResult, Machine

    def row(id, mode, runs, booked=0.0, step=0.0):
        return CaseResult(file="f", id=id, mode=mode, tokens=100, decode_s=sorted(runs)[len(runs) // 2],
                          prefill_s=0.0, passes=100, drafted=10, accepted=0, identical_to_plain=True,
                          decode_runs=runs, booked_s=booked, ledger_plain_s=step)

    plain = {id: row(id, "plain", [1.0, 1.0, 1.0]) for id in ("noise", "loss", "fast", "slight")}
    mode = [row("noise", "ngram", [1.2, 1.2, 1.2], booked=0.05, step=0.0100),  # under; ledger gained
            row("loss", "ngram", [1.2, 1.2, 1.2], booked=-0.10, step=0.0102),  # under; ledger lost 8%
            row("fast", "ngram", [0.8, 0.8, 0.8], booked=-0.10, step=0.0098),  # over the floor
            row("slight", "ngram", [1.1, 1.1, 1.1], booked=-0.03)]  # under; lost 2.7%: within the floor
    s = bench.mode_summary(mode, {bench._key(r): r for r in plain.values()})
    assert (s.below_floor, s.below_floor_paired, s.below_floor_ledger) == (3, 3, 1)
    assert s.loop_plain_step == pytest.approx(1.0)  # 0.98, 1.00, 1.02 of 0.01 s; "slight" has none
    rows = list(plain.values()) + mode
    machine = Machine(cpu="cpu", cores=2, os="os", python="3", mlx="0", mlx_lm="0", device="cpu",
                      blas="blas", load_avg=0.0)
    res = BenchResults(machine=machine, model="m", inputs=["f"], modes=["plain", "ngram"], repeat=3,
                       max_draft=8, costs={}, replay_costs="", cases=rows, replays=[],
                       summary=bench.summarize(rows, [], 3), files={"f": bench.summarize(rows, [], 3)})
    assert "the ledger lost on 1" in bench.report(res)
    text = io.StringIO()
    bench.print_summary(res, file=text)
    assert "the ledger lost on 1 of those under 0.97x" in text.getvalue()
    assert "the loop's plain step 1.00x plain's" in text.getvalue()


def test_recheck_runs_again_only_a_case_under_the_floor(default_lm, tmp_path, monkeypatch):
    """``recheck``: a case whose first repeats put n-gram under the floor runs that many more
    times, and its figures take every run; a case over the floor is not run again. The host is
    scripted: "noisy" runs n-gram at 0.8x plain in its first three repeats, then at 1.25x, so it
    is under the floor at first and over it after the recheck; "fast" runs at 1.25x throughout."""
    real = bench.decode
    runs: dict[tuple[int, bool], int] = {}

    def scripted(engine, prompt, max_tokens, sources=()):
        sample = real(engine, prompt, max_tokens, sources)
        if max_tokens != bench.WARMUP_TOKENS:
            n = runs[(max_tokens, engine.speculate)] = runs.get((max_tokens, engine.speculate), 0) + 1
            slow = max_tokens == 6 and n <= 3
            sample.stats.decode_s = 1.0 if not engine.speculate else 1.25 if slow else 0.8
        return sample

    monkeypatch.setattr(bench, "decode", scripted)
    cases = tmp_path / "cases.jsonl"
    write_jsonl(cases, [{"id": "noisy", "messages": user(ECHO), "max_tokens": 6},
                        {"id": "fast", "messages": user(ECHO), "max_tokens": 7}])
    res = bench.bench(default_lm, [cases], tmp_path / "out", repeat=3, recheck=4, costs=CostTable(CPU_COSTS))
    assert runs == {(6, False): 7, (6, True): 7, (7, False): 3, (7, True): 3}
    ngram = {r.id: r for r in res.cases if r.mode == "ngram"}
    assert ngram["noisy"].decode_runs == [1.25] * 3 + [0.8] * 4 and ngram["fast"].decode_runs == [0.8] * 3
    s = res.summary.ngram
    assert (s.below_floor_paired, s.rechecked, s.below_floor_first) == (0, 1, 1)
    assert res.recheck == 4 and "1 rechecked; 1 paired before" in bench.report(res)
    without = bench.mode_summary([ngram["noisy"]], {bench._key(r): r for r in res.cases if r.mode == "plain"})
    assert without.rechecked == 0  # no repeat given: nothing to tell a recheck by


def parse(*argv):
    parser = argparse.ArgumentParser(prog="warmspec")
    bench.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_resume_keeps_finished_cases(default_lm, tmp_path):
    cases = tmp_path / "cases.jsonl"
    write_jsonl(cases, [{"id": "one", "messages": user(ECHO), "max_tokens": 6},
                        {"id": "two", "messages": user("Name a colour."), "max_tokens": 6}])
    out = tmp_path / "out"
    first = bench.bench(default_lm, [cases], out, limit=1, costs=CostTable(CPU_COSTS))
    assert [r.id for r in first.cases] == ["one", "one"]
    # a run cut short resumes: the finished case is kept as measured, not run again
    again = bench.bench(default_lm, [cases], out, resume=True)
    assert again.cases[:2] == first.cases and [r.id for r in again.cases[2:]] == ["two", "two"]
    assert again.costs == first.costs  # priced with the first run's table, not re-measured
    assert msgspec.json.decode((out / "results.json").read_bytes(), type=BenchResults) == again
    with pytest.raises(ValueError, match="another run"):
        bench.bench(default_lm, [cases], out, modes=["plain"], resume=True)


def test_a_run_without_plain_prints_no_ratios(default_lm, tmp_path):
    """Modes compared among themselves (no plain): the summary gives tok/s, not a 0.00x "vs
    plain" nor "identical 0/1" against a baseline that was never run."""
    import io
    import warnings

    cases = tmp_path / "cases.jsonl"
    write_jsonl(cases, [{"id": "one", "messages": user(ECHO), "max_tokens": 6}])
    with warnings.catch_warnings(record=True) as caught:  # the plot has no points: no empty legend
        warnings.simplefilter("always")
        res = bench.bench(default_lm, [cases], tmp_path / "out", modes=["ngram"],
                          costs=CostTable(CPU_COSTS))
    assert not [w for w in caught if "legend" in str(w.message)]
    text = io.StringIO()
    bench.print_summary(res, file=text)
    assert "no plain mode to compare with" in text.getvalue()
    assert "vs plain" not in text.getvalue() and "identical" not in text.getvalue()


def test_command_line(tmp_path):
    args = parse("bench", "a.jsonl", "b.jsonl", "--out", str(tmp_path), "--limit", "3", "--replay")
    assert args.func is bench.run
    assert [p.name for p in args.prompts] == ["a.jsonl", "b.jsonl"]
    assert args.modes == "plain,ngram" and args.repeat == 1 and args.limit == 3 and args.replay
    # bad input is refused before the model is loaded
    assert bench.run(parse("bench", "a.jsonl", "--out", str(tmp_path), "--modes", "turbo")) == 2
    assert bench.run(parse("bench", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path))) == 2


def test_divergence_reports_position_tokens_and_margin():
    """A mode's output that differs from plain's is located, and plain's margin there comes from a
    one-position pass: here an output changed on purpose, where plain's choice was not a tie."""
    import mlx.core as mx

    import tiny
    from test_engine import reference_greedy

    lm = tiny.build("llama")
    prompt = list(range(7, 40))
    plain = reference_greedy(lm.model, prompt, 20, set())
    assert bench.divergence(lm, prompt, plain, list(plain)) is None
    other = [*plain[:6], (plain[6] + 1) % tiny.VOCAB, *plain[7:]]
    d = bench.divergence(lm, prompt, plain, other)
    logits = lm.model(mx.array([prompt + plain[:6]]))[0, -1]
    top = sorted(logits.tolist())[-2:]
    assert (d.position, d.plain_token, d.other_token) == (6, plain[6], other[6])
    assert d.margin == pytest.approx(top[1] - top[0], abs=1e-4)
    assert d.other_gap == pytest.approx(top[1] - logits[other[6]].item(), abs=1e-4)
    assert d.bug == (d.margin > bench.TIE_MARGIN) and d.bug  # random weights: no near tie there
    shorter = bench.divergence(lm, prompt, plain, plain[:10])
    assert (shorter.position, shorter.other_token) == (10, None)


def test_model_drafter_modes(default_lm, tmp_path):
    """Modes mtp and draft run beside plain with their drafters loaded once; outputs identical,
    the accepted tokens' source named per mode. (A head of random weights: it guesses badly, which
    is what a gate and an exact verify must survive.)"""
    from warmspec.core import mtp

    head = mtp.MTPHead(mtp.target_parts(default_lm.model))  # random weights
    mtp.save_mtp(head, tmp_path / "h.safetensors")
    cases = tmp_path / "c.jsonl"
    write_jsonl(cases, [{"id": "echo", "messages": user(ECHO), "max_tokens": 12}])
    res = bench.bench(default_lm, [cases], tmp_path / "out", modes=("plain", "mtp", "draft"),
                      costs=CostTable(CPU_COSTS), mtp_path=tmp_path / "h.safetensors",
                      draft_model=str(fetch.default_model_path()))
    assert [r.mode for r in res.cases] == ["plain", "mtp", "draft"]
    assert all(r.identical_to_plain for r in res.cases)
    # the model as its own draft model is always right where it drafted -- and, as big as the
    # target, too slow to pay on this CPU: the gate, timing its proposals, stops asking it (the
    # random head: wrong, and stopped too)
    draft_row = res.cases[2]
    assert draft_row.accepted == draft_row.drafted
    assert res.summary.mtp is not None and res.summary.draft is not None


def test_restart_between_turns_reads_the_disk_tier(default_lm, tmp_path):
    """``--restart-between-turns``: turn 2 runs on a fresh engine that only has the disk tier, and
    finds turn 1 there -- the same tokens as without a restart."""
    chat = tmp_path / "chat.jsonl"
    first = user(f"Read this file:\n```python\n{SRC}```\nWhat does it do?")
    write_jsonl(chat, [{"id": "conv", "max_tokens": 8, "turns": [
        first, [*first, {"role": "assistant", "content": "It finds the model cache."},
                {"role": "user", "content": "Which environment variable wins?"}]]}])
    (_, case), = bench.read_cases([chat])
    prep = bench.prepare(case, default_lm.tokenizer, tmp_path)
    engines = {"plain": Engine(default_lm, speculate=False)}
    kept = bench.run_modes(engines, prep, 8, 1)["plain"][0]
    restarted = bench.run_modes(engines, prep, 8, 1, restart=True)["plain"][0]
    assert [s.tokens for s in restarted] == [s.tokens for s in kept]
    assert restarted[1].stats.cached_tokens == kept[1].stats.cached_tokens > 100
    assert engines["plain"].disk is None  # detached after the case

    res = bench.bench(default_lm, [chat], tmp_path / "out", modes=["plain"], restart_between_turns=True)
    assert res.restart_between_turns and res.cases[1].cached_tokens > 100
    assert "after a restart" in (tmp_path / "out" / "report.md").read_text()
