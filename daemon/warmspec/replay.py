"""A scripted typing session replayed over a real file through the editor protocol: how ghost text
serves someone typing, with and without the feedback adaptation, side by side.

The user retypes a span of lines of a file (removed first; the rest of the file stays around it)
at a fixed pace -- ``PACE``: 150 ms between the characters of a word, 350 ms after a blank or a
punctuation mark, 800 ms after a line break, whose indentation the editor inserts -- the way the
editor clients behave: a full-text ``didChange`` per keystroke, ghost text asked for once the
debounce has passed (with adaptation: the clients' rule, the daemon's advice and 1.2x the user's
median pause; without: 150 ms), and a keystroke cancelling the request still in flight. A
suggestion that arrives is read for ``READ_S``, then accepted as far as it is right, in whole
words (the clients' next-word rule): all of it (Tab), or its right words with the rest dismissed;
one wrong from its first word is dismissed when the next key is typed. Every event goes back as
feedback, so the daemon's counts are the session's.

Each side gets an engine of its own on the one loaded model (nothing cached from the other side),
behind a real ``RpcService`` on TCP, spoken to with raw JSON-RPC frames (the result's ``warmspec``
field carries each answer's timings, and the advised debounce). One warm-up suggestion first, not
counted: the measurement is of a warm daemon.

Measured: characters typed and accepted; the model's time (prefill and decode of the ghost-text
jobs); characters accepted per second of model time; tokens generated and thrown away (the
daemon's count); requests cancelled by a keystroke, cut at the budget, served from the cache; per
answered request the daemon's time to its first visible character and to its final suggestion.

    python -m warmspec.replay [--file F --lines A-B] [--budget-ms 250] [--out DIR]
    warmspec bench --probe typing --out DIR       (the defaults: this package's sampling.py)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import msgspec

from warmspec_protocol import rpc as wire

DEFAULT_FILE = Path(__file__).parent / "core" / "sampling.py"
DEFAULT_LINES = (34, 45)  # most of the body of ``distribution`` (core/sampling.py)
PACE = {"word": 0.150, "blank": 0.350, "line": 0.800}
READ_S = 0.2
BASE_DEBOUNCE_MS = 150
NEXT_WORD = re.compile(r"\s*(?:[A-Za-z0-9_]+|[^A-Za-z0-9_\s]+)")  # the clients' next word


class Request(msgspec.Struct, kw_only=True):
    outcome: str  # answered; cancelled (by a keystroke); late (answered as the key came); error
    suggestion: str = ""
    accepted_chars: int = 0
    finish: str = ""
    first_visible_ms: float | None = None  # the daemon's
    final_ms: float | None = None
    client_first_visible_ms: float | None = None  # sent -> first visible partial (or answer) received
    client_final_ms: float | None = None
    max_tokens: int = 0
    debounce_ms: int = 0


class Side(msgspec.Struct, kw_only=True):
    adapt: bool
    budget_ms: int | None
    patient: bool = False
    prefetch: bool = False  # inlineCompletion.prefetch: suggestions start at the keystroke
    typed_chars: int = 0  # typed by the user
    accepted_chars: int = 0  # inserted from suggestions
    shown: int = 0
    accepted: int = 0
    partial: int = 0
    dismissed: int = 0
    model_s: float = 0.0
    tokens_generated: int = 0
    tokens_thrown_away: int = 0
    wall_s: float = 0.0
    plain_tok_s: float = 0.0  # plain greedy decode just before, on the same engine: how busy the CPU was
    load_avg: float = 0.0  # the 1-minute load average at the end
    text_ok: bool = False  # the document ended as the file
    requests: list[Request] = []

    @property
    def chars_per_model_s(self) -> float:
        return self.accepted_chars / self.model_s if self.model_s else 0.0


def accepted_prefix(suggestion: str, upcoming: str) -> int:
    """How much of ``suggestion`` a user takes: whole next-words, as long as they are right."""
    n = 0
    while n < len(suggestion):
        m = NEXT_WORD.match(suggestion, n)
        end = m.end() if m else len(suggestion)
        if upcoming[n:end] != suggestion[n:end]:
            break
        n = end
    return n


def keystrokes(text: str, start: int, end: int) -> list[tuple[int, str, float]]:
    """The span as typed: (where, what one keystroke inserts, the pause before it)."""
    out = []
    i = start
    while i < end:
        ch = text[i]
        prev = text[i - 1] if i else "\n"
        # the first key of a line: only the indentation the editor inserted stands before it
        line = not text[text.rfind("\n", 0, i) + 1 : i].strip(" \t")
        gap = PACE["line"] if line else PACE["word"] if (prev.isalnum() or prev == "_") else PACE["blank"]
        if ch == "\n":  # the editor indents the next line
            j = i + 1
            while j < end and text[j] in " \t":
                j += 1
            out.append((i, text[i:j], gap))
            i = j
        else:
            out.append((i, ch, gap))
            i += 1
    return out


def position(doc: str, offset: int) -> dict:
    line_start = doc.rfind("\n", 0, offset) + 1
    return {"line": doc.count("\n", 0, offset), "character": len(doc[line_start:offset].encode("utf-16-le")) // 2}


class Conn:
    """Raw JSON-RPC over a stream: results as sent (extension fields included), notifications to
    ``on_notification``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 on_notification: Callable[[str, Any], None]):
        from .server.framing import read_frame

        self.writer = writer
        self.pending: dict[int, asyncio.Future] = {}
        self.ids = itertools.count(1)
        self.on_notification = on_notification

        async def read() -> None:
            while (body := await read_frame(reader, 1 << 24)) is not None:
                env = msgspec.json.decode(body, type=wire.Envelope)
                if env.method is not msgspec.UNSET:
                    self.on_notification(env.method, env.params)
                elif (fut := self.pending.pop(env.id, None)) is not None and not fut.done():
                    fut.set_result(env)

        self.reader_task = asyncio.ensure_future(read())

    def send(self, msg: msgspec.Struct) -> None:
        from .server.framing import frame

        self.writer.write(frame(msgspec.json.encode(msg)))

    def request(self, method: str, params: Any) -> tuple[int, asyncio.Future]:
        msg_id = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[msg_id] = fut
        self.send(wire.Request(id=msg_id, method=method, params=params))
        return msg_id, fut

    async def call(self, method: str, params: Any) -> Any:
        env = await self.request(method, params)[1]
        if env.error is not msgspec.UNSET:
            raise RuntimeError(f"{method}: {env.error.message}")
        return env.result

    def notify(self, method: str, params: Any) -> None:
        self.send(wire.Notification(method=method, params=params))


def client_debounce_ms(adapt: bool, advised: int | None, gaps: list[float]) -> float:
    """The clients' rule (ghost.lua, ghost.ts)."""
    if not adapt:
        return BASE_DEBOUNCE_MS
    wait = advised if advised is not None else BASE_DEBOUNCE_MS
    if len(gaps) >= 4:
        wait = max(wait, 1.2 * sorted(gaps)[math.ceil(len(gaps) / 2) - 1])
    return min(600, max(30, wait))


async def type_session(port: int, text: str, start: int, end: int, uri: str, *, adapt: bool,
                       budget_ms: int | None, engine_seconds: Callable[[], float],
                       inline_counts: Callable[[], tuple[int, int]], patient: bool = False,
                       prefetch: bool = False) -> Side:
    """The session; ``patient``: the user waits for every keystroke's suggestion before the next
    key (no debounce, nothing cancelled) -- each request's latency alone, as a latency probe."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    first_seen: dict[int, float] = {}

    def on_note(method: str, params: Any) -> None:
        if method == "warmspec/inlineCompletionPartial" and params["text"].strip():
            first_seen.setdefault(params["id"], time.perf_counter())

    conn = Conn(reader, writer, on_note)
    settings = {"stream": True, "adapt": adapt, "debounceMs": BASE_DEBOUNCE_MS, "maxTokens": 48,
                "prefetch": prefetch}
    if budget_ms:
        settings["deadlineMs"] = budget_ms
    await conn.call("initialize", {"processId": None, "capabilities": {}, "clientInfo": {"name": "warmspec-replay"},
                                   "initializationOptions": {"inlineCompletion": settings}})
    conn.notify("initialized", {})
    doc = text[:start] + text[end:]
    version = 1
    conn.notify("textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "python", "version": 1,
                                                          "text": doc}})
    side = Side(adapt=adapt, budget_ms=budget_ms, patient=patient, prefetch=prefetch)
    pos = start

    def change() -> None:
        nonlocal version
        version += 1
        conn.notify("textDocument/didChange", {"textDocument": {"uri": uri, "version": version},
                                               "contentChanges": [{"text": doc}]})

    def ask() -> tuple[int, asyncio.Future, float]:
        msg_id, fut = conn.request("textDocument/inlineCompletion", {
            "textDocument": {"uri": uri}, "position": position(doc, pos), "context": {"triggerKind": 2}})
        return msg_id, fut, time.perf_counter()

    # A warm-up suggestion, not counted: the prompt's prefill, once.
    _, fut, _ = ask()
    await fut
    model0, (generated0, thrown0) = engine_seconds(), inline_counts()
    started = time.perf_counter()
    advised: int | None = None
    gaps: list[float] = []
    keys = keystrokes(text, start, end)
    k = 0
    last_key = time.perf_counter()
    while pos < end:
        at, piece, gap = keys[k]
        assert at == pos, (at, pos)
        next_key = last_key + gap
        debounce = 0.0 if patient else client_debounce_ms(adapt, advised, gaps) / 1000
        if gap > debounce:
            await asyncio.sleep(max(0.0, last_key + debounce - time.perf_counter()))
            msg_id, fut, sent = ask()
            try:
                wait = None if patient else max(0.0, next_key - time.perf_counter())
                env = await asyncio.wait_for(asyncio.shield(fut), wait)
            except asyncio.TimeoutError:
                conn.notify("$/cancelRequest", {"id": msg_id})  # the keystroke comes first
                late = await fut
                seen = first_seen.get(msg_id)
                side.requests.append(Request(outcome="cancelled" if late.error is not msgspec.UNSET else "late",
                                             client_first_visible_ms=None if seen is None else (seen - sent) * 1000))
                env = None
            if env is not None:
                req = answered(env, sent, first_seen.get(msg_id))
                side.requests.append(req)
                if req.outcome == "answered":
                    advised = req.debounce_ms
                taken = accepted_prefix(req.suggestion, text[pos:end]) if req.suggestion else 0
                if req.suggestion:
                    conn.notify("warmspec/inlineCompletionFeedback", {"id": msg_id, "event": "shown"})
                    side.shown += 1
                if taken:
                    await asyncio.sleep(READ_S)
                    req.accepted_chars = taken
                    doc = doc[:pos] + req.suggestion[:taken] + doc[pos:]
                    pos += taken
                    side.accepted_chars += taken
                    change()
                    if taken == len(req.suggestion):
                        side.accepted += 1
                        conn.notify("warmspec/inlineCompletionFeedback", {"id": msg_id, "event": "accepted"})
                    else:
                        side.partial += 1
                        conn.notify("warmspec/inlineCompletionFeedback",
                                    {"id": msg_id, "event": "partial", "accepted_chars": taken})
                        conn.notify("warmspec/inlineCompletionFeedback", {"id": msg_id, "event": "dismissed"})
                    last_key = time.perf_counter()
                    k = resync(keys, pos)
                    continue
                if req.suggestion:
                    side.dismissed += 1
                    conn.notify("warmspec/inlineCompletionFeedback", {"id": msg_id, "event": "dismissed"})
        if not patient:
            await asyncio.sleep(max(0.0, next_key - time.perf_counter()))
        gaps = (gaps + [gap * 1000])[-8:] if gap < 1.0 else gaps
        doc = doc[:pos] + piece + doc[pos:]
        pos += len(piece)
        side.typed_chars += len(piece)
        k += 1
        last_key = time.perf_counter()
        change()
    side.wall_s = time.perf_counter() - started
    await conn.call("warmspec/status", None)  # every notification before it has been handled
    side.model_s = engine_seconds() - model0
    generated, thrown = inline_counts()
    side.tokens_generated, side.tokens_thrown_away = generated - generated0, thrown - thrown0
    side.text_ok = doc == text
    writer.close()
    conn.reader_task.cancel()
    return side


def resync(keys: list[tuple[int, str, float]], pos: int) -> int:
    """The index of the keystroke that types the character at ``pos`` (after an accept). An accept
    can end inside a keystroke (a line break with its indentation): its rest becomes one."""
    for i, (at, piece, gap) in enumerate(keys):
        if at + len(piece) > pos:
            if at < pos:
                keys[i] = (pos, piece[pos - at:], gap)
            return i
    return len(keys)


def answered(env: wire.Envelope, sent: float, first_partial: float | None) -> Request:
    now = time.perf_counter()
    if env.error is not msgspec.UNSET:
        return Request(outcome="error", finish=env.error.message)
    result = msgspec.convert(env.result, wire.InlineCompletionResult)
    info = result.warmspec
    text = result.items[0].insert_text if result.items else ""
    client_first = (first_partial - sent) * 1000 if first_partial is not None else (
        (now - sent) * 1000 if text.strip() else None)
    return Request(outcome="answered", suggestion=text, finish=info.finish,
                   first_visible_ms=info.first_visible_ms, final_ms=info.final_ms,
                   client_first_visible_ms=client_first, client_final_ms=(now - sent) * 1000,
                   max_tokens=info.max_tokens, debounce_ms=info.debounce_ms)


def run_side(lm, text: str, start: int, end: int, *, adapt: bool, budget_ms: int | None,
             patient: bool = False, prefetch: bool = False) -> Side:
    """One side: a fresh engine and daemon around ``lm``, the session typed against it."""
    from .core import Engine, SamplingParams, default_cost_cache
    from .server.app import App
    from .server.rpc import RpcService

    tmp = Path(tempfile.mkdtemp(prefix="warmspec-typing-"))
    try:
        path = tmp / "typed.py"
        path.write_text(text)
        engine = Engine(lm, cost_cache=default_cost_cache(lm))
        for event in engine.generate(lm.tokenizer.encode(text[:start][-400:]), SamplingParams(),
                                     max_tokens=16, speculate=False):
            plain = event
        app = App(lm, engine, workspace_roots=[tmp])
        app.start()
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        service = RpcService(app)
        port = asyncio.run_coroutine_threadsafe(service.serve_tcp("127.0.0.1", 0), loop).result(60)
        try:
            totals = app.engine.totals
            side = asyncio.run(type_session(
                port, text, start, end, path.as_uri(), adapt=adapt, budget_ms=budget_ms,
                engine_seconds=lambda: totals.prefill_s + totals.decode_s,
                inline_counts=lambda: (app.inline.counts.tokens_generated, app.inline.counts.tokens_thrown_away),
                patient=patient, prefetch=prefetch))
            side.plain_tok_s = plain.stats.decode_tok_s
            side.load_avg = os.getloadavg()[0]
            return side
        finally:
            asyncio.run_coroutine_threadsafe(service.close(), loop).result(60)
            app.stop()
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def span(text: str, lines: tuple[int, int]) -> tuple[int, int]:
    """Character offsets of lines ``a``..``b`` (1-based, inclusive), their final newline excluded."""
    starts = [0] + [m.end() for m in re.finditer("\n", text)]
    a, b = lines
    return starts[a - 1], starts[b] - 1


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))] if xs else float("nan")


def report(sides: list[Side], file: str, lines: tuple[int, int], lm_name: str) -> str:
    def col(f: Callable[[Side], str]) -> str:
        return " | ".join(f(s) for s in sides)

    def answered_(s: Side) -> list[Request]:
        return [r for r in s.requests if r.outcome == "answered"]

    def ms(xs: list[float | None]) -> list[float]:
        return [x for x in xs if x is not None]

    def lat(s: Side, attr: str, every: bool = False) -> str:
        xs = ms([getattr(r, attr) for r in (s.requests if every else answered_(s))])
        return f"{statistics.median(xs):.0f} / {_q(xs, 0.9):.0f} / {max(xs):.0f}" if xs else "-"

    rows = [
        ("adaptation", col(lambda s: ("on" if s.adapt else "off") + (", patient typist" if s.patient else "")
                                     + (", prefetch" if s.prefetch else ""))),
        ("characters typed / accepted from suggestions", col(lambda s: f"{s.typed_chars} / {s.accepted_chars}")),
        ("suggestions shown: accepted / in part / dismissed",
         col(lambda s: f"{s.shown}: {s.accepted} / {s.partial} / {s.dismissed}")),
        ("requests: answered / cancelled by a keystroke",
         col(lambda s: f"{len(answered_(s))} / {sum(r.outcome == 'cancelled' for r in s.requests)}")),
        ("answers cut at the budget / from the cache",
         col(lambda s: f"{sum(r.finish == 'deadline' for r in answered_(s))} / "
                       f"{sum(r.finish == 'cache' for r in answered_(s))}")),
        ("model time (prefill + decode), s", col(lambda s: f"{s.model_s:.2f}")),
        ("**characters accepted per second of model time**", col(lambda s: f"**{s.chars_per_model_s:.1f}**")),
        ("tokens generated / thrown away",
         col(lambda s: f"{s.tokens_generated} / {s.tokens_thrown_away}"
                       f" ({s.tokens_thrown_away / s.tokens_generated:.0%})" if s.tokens_generated else "0 / 0")),
        ("first visible character, daemon: median / p90 / max ms", col(lambda s: lat(s, "first_visible_ms"))),
        ("first visible character, client, every request that showed one: median / p90 / max ms",
         col(lambda s: lat(s, "client_first_visible_ms", every=True))),
        ("final suggestion, daemon: median / p90 / max ms", col(lambda s: lat(s, "final_ms"))),
        ("suggestion length at the end (maxTokens) / advised debounce ms",
         col(lambda s: (lambda a: f"{a[-1].max_tokens} / {a[-1].debounce_ms}" if a else "-")(answered_(s)))),
        ("session wall time, s", col(lambda s: f"{s.wall_s:.0f}")),
        ("plain greedy decode just before, tok/s / load average after",
         col(lambda s: f"{s.plain_tok_s:.1f} / {s.load_avg:.1f}")),
        ("document ends as the file", col(lambda s: "yes" if s.text_ok else "NO")),
    ]
    budget = sides[0].budget_ms
    head = [f"Typing session: lines {lines[0]}-{lines[1]} of {file} retyped, {lm_name}, "
            f"budget {budget} ms per suggestion" if budget else "no budget", "",
            "| | " + " | ".join(f"side {i + 1}" for i in range(len(sides))) + " |",
            "|---|" + "---|" * len(sides)]
    return "\n".join(head + [f"| {name} | {value} |" for name, value in rows]) + "\n"


def run(lm, out: Path, *, file: Path = DEFAULT_FILE, lines: tuple[int, int] = DEFAULT_LINES,
        budget_ms: int | None = 250, patient: bool = False, compare: str = "adapt") -> str:
    """Two sides: adaptation off then on (``compare="adapt"``), or with adaptation, prefetch off
    then on (``"prefetch"``); writes typing.json and typing.md into ``out``."""
    text = file.read_text()
    start, end = span(text, lines)
    configs = [(False, False), (True, False)] if compare == "adapt" else [(True, False), (True, True)]
    sides = [run_side(lm, text, start, end, adapt=adapt, budget_ms=budget_ms, patient=patient, prefetch=pf)
             for adapt, pf in configs]
    out.mkdir(parents=True, exist_ok=True)
    (out / "typing.json").write_bytes(msgspec.json.format(msgspec.json.encode(sides)))
    md = report(sides, file.name, lines, lm.name)
    (out / "typing.md").write_text(md)
    return md


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m warmspec.replay", description=__doc__.split("\n\n")[0])
    p.add_argument("--file", type=Path, default=DEFAULT_FILE)
    p.add_argument("--lines", default="-".join(map(str, DEFAULT_LINES)), help="A-B, 1-based, inclusive")
    p.add_argument("--budget-ms", type=int, default=250, help="deadlineMs per suggestion (0: none)")
    p.add_argument("--patient", action="store_true",
                   help="the typist waits for each keystroke's suggestion (every request's latency alone)")
    p.add_argument("--compare", choices=("adapt", "prefetch"), default="adapt",
                   help="the two sides: feedback adaptation off and on, or prefetch off and on")
    p.add_argument("--model", default=None)
    p.add_argument("--out", type=Path, default=Path("typing-out"))
    args = p.parse_args(argv)
    from . import blas

    blas.reexec_with_blas(["-m", "warmspec.replay", *(sys.argv[1:] if argv is None else argv)])
    from .model import load

    a, b = (int(x) for x in args.lines.split("-"))
    print(run(load(args.model), args.out, file=args.file, lines=(a, b), budget_ms=args.budget_ms or None,
              patient=args.patient, compare=args.compare))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
