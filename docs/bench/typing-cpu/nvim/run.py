"""Ghost-text latency in a real headless Neovim: the plugin with its defaults, prefetch on and off.

    python docs/bench/typing-cpu/nvim/run.py --out docs/bench/typing-cpu/nvim

Types the replay's span (``warmspec.replay``: core/sampling.py, lines 34-45, at its pace: 150 ms
within a word, 350 ms after a blank, 800 ms before a line's first key) into the file in Neovim,
once with the plugin's ``prefetch`` on (its default) and once off, each against a fresh daemon
that ``warmspec lsp`` starts. Per request it reads the plugin's trace: when the request went out,
when a first non-blank character of it was shown, when its final suggestion was. Writes
results.json and report.md. Needs ``nvim`` (0.7 or later)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from warmspec import replay

ROOT = Path(__file__).resolve().parents[4]
PLUGIN = ROOT / "clients" / "nvim"
SCRIPT = Path(__file__).with_name("typing.lua")


def schedule(text: str, start: int, end: int, path: Path) -> dict:
    keys = [[chars, round(gap * 1000)] for _, chars, gap in replay.keystrokes(text, start, end)]
    line = text.count("\n", 0, start) + 1
    col = len(text[text.rfind("\n", 0, start) + 1:start].encode())
    return {"file": str(path), "line": line, "col": col, "keys": keys}


def side(text: str, start: int, end: int, prefetch: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="warmspec-nvim-typing-") as tmp:
        tmp = Path(tmp)
        path = tmp / "typed.py"
        path.write_text(text[:start] + text[end:])
        plan = tmp / "plan.json"
        plan.write_text(json.dumps(schedule(text, start, end, path)))
        out = tmp / "out.json"
        from warmspec.fetch import cache_dir

        env = dict(os.environ, WARMSPEC_RUNTIME_DIR=str(tmp / "rt"), WARMSPEC_CACHE=str(cache_dir()),
                   WARMSPEC_TYPING=str(plan), WARMSPEC_TYPING_OUT=str(out),
                   WARMSPEC_PREFETCH="1" if prefetch else "0",
                   WARMSPEC_TEST_CMD=json.dumps([sys.executable, "-m", "warmspec", "lsp", "--workspace", str(tmp)]))
        for var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME"):
            env[var] = str(tmp / var.lower())
        try:
            subprocess.run(["nvim", "--headless", "-u", "NONE", "-i", "NONE", "--cmd", f"set rtp^={PLUGIN}",
                            "-c", f"luafile {SCRIPT}"], env=env, cwd=tmp, stdin=subprocess.DEVNULL,
                           capture_output=True, timeout=900)
        finally:
            subprocess.run([sys.executable, "-m", "warmspec", "stop"], env=env, capture_output=True, timeout=60)
        res = json.loads(out.read_text())
    if res.get("failure"):
        raise SystemExit(f"nvim: {res['failure']}")
    lines = res.pop("lines")
    res["typed_ok"] = "\n".join(lines) + "\n" == text
    if not res["typed_ok"]:  # the first line that differs, to see what went wrong
        res["typed_diff"] = next(([i + 1, a, b] for i, (a, b) in enumerate(zip(lines, text.split("\n"))) if a != b),
                                 [len(lines), "", ""])
    return res


def per_request(trace: list[dict]) -> list[dict]:
    reqs: dict[int, dict] = {}
    for e in trace:
        r = reqs.setdefault(e["id"], {"id": e["id"]})
        if e["kind"] == "request":
            r["sent"] = e["t"]
        elif "sent" in r:
            if e.get("text", "").strip() and "first" not in r:
                r["first_ms"] = round(e["t"] - r["sent"], 1)
                r["first"] = True
            if e["kind"] == "final":
                r["final_ms"] = round(e["t"] - r["sent"], 1)
    return [r for r in reqs.values() if "sent" in r]


def q(xs: list[float], p: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else None


def summary(name: str, res: dict) -> dict:
    reqs = per_request(res["trace"])
    first = [r["first_ms"] for r in reqs if "first_ms" in r]
    final = [r["final_ms"] for r in reqs if "final_ms" in r]
    st = res.get("status") or {}
    return {"side": name, "requests": len(reqs), "showed_a_character": len(first),
            "first_visible_ms_median": statistics.median(first) if first else None,
            "first_visible_ms_p90": q(first, 0.9), "final_ms_median": statistics.median(final) if final else None,
            "finals_shown": len(final), "typing_s": round((res["ended"] - res["started"]) / 1000 - 3, 1),
            "typed_text_matches": res["typed_ok"],
            "daemon": {k: st.get(k) for k in ("requests", "cancelled", "cache_hits", "prefetched",
                                              "prefetch_attached", "tokens_generated", "first_visible")}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--lines", type=int, nargs=2, default=replay.DEFAULT_LINES, metavar=("FIRST", "LAST"),
                   help="the span of the file typed (1-based, inclusive)")
    args = p.parse_args()
    text = replay.DEFAULT_FILE.read_text()
    start, end = replay.span(text, tuple(args.lines))
    sides = []
    raw = {}
    for name, prefetch in (("prefetch on (the default)", True), ("prefetch off", False)):
        res = side(text, start, end, prefetch)
        raw[name] = res
        sides.append(summary(name, res))
        print(json.dumps(sides[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"sides": sides, "raw": raw}, indent=1))
    rows = ["| side | requests | showed a first character | first visible, median | p90 | final, median | "
            "daemon: prefetched / attached / cancelled |", "|---|---|---|---|---|---|---|"]
    for s in sides:
        d = s["daemon"]
        rows.append(f"| {s['side']} | {s['requests']} | {s['showed_a_character']} | {s['first_visible_ms_median']} ms | "
                    f"{s['first_visible_ms_p90']} ms | {s['final_ms_median']} ms | "
                    f"{d['prefetched']} / {d['prefetch_attached']} / {d['cancelled']} |")
    (args.out / "report.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
