"""warmspec and OptiQ's n-gram speculation, side by side in one process, on the same model and cases.

The issue names OptiQ 0.7.7's n-gram path (``optiq.runtime.ngram_spec``) as the peer to beat and
quotes its figures on this CPU (2.9x on file edits, 1.1x on prose); quoting is not measuring, so
this runs it here against warmspec's plain and n-gram decoding, the three alternating per case on
one loaded model (float32 on CPU, as ``warmspec bench``). OptiQ runs as ``optiq serve
--ngram-draft 16`` runs it: draft ceiling 16 (its help's advice), gate on, n-gram length 3, the
whole prompt as context. Each run starts from a cache prefilled with all but the last prompt token,
so every decode time is the same thing: from there to the last token, prefill excluded.

Not part of the package or its tests (OptiQ is not a dependency). Like ``warmspec``, it
re-executes itself on the system OpenBLAS when one is installed. To run::

    pip download --no-deps mlx-optiq==0.7.7 -d /tmp/optiq && unzip -q /tmp/optiq/*.whl -d /tmp/optiq/src
    PYTHONPATH=/tmp/optiq/src python docs/bench/peer-optiq/side_by_side.py SHARED/bench/edits-public.jsonl \\
      SHARED/bench/prose-public.jsonl --limit 10 --out docs/bench/peer-optiq/draft16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from warmspec import blas

if __name__ == "__main__":  # before MLX is imported, as the warmspec CLI does
    blas.reexec_with_openblas(sys.argv)

import mlx.core as mx
import msgspec
from mlx_lm.models.cache import make_prompt_cache
from optiq.runtime.ngram_spec import NgramStats, ngram_generate_step
from warmspec.bench import chat_ids, decode, flush, machine, read_cases
from warmspec.core.engine import MAX_DRAFT, Engine
from warmspec.model import load

OPTIQ_DRAFT = 16  # `optiq serve --help`: "16 is a good value"


def warmspec_run(engine: Engine, prompt: list[int], max_tokens: int) -> dict:
    flush(engine)
    sample = decode(engine, prompt, max_tokens)
    s = sample.stats
    return {"tokens": sample.tokens, "decode_s": s.decode_s, "passes": s.passes,
            "drafted": s.drafted, "accepted": s.accepted}


def optiq_run(lm, prompt: list[int], max_tokens: int, draft: int = OPTIQ_DRAFT) -> dict:
    model, eos = lm.model, lm.tokenizer.eos_ids
    cache = make_prompt_cache(model)
    model(mx.array([prompt[:-1]]), cache=cache)
    mx.eval([c.state for c in cache])
    stats = NgramStats()
    tokens: list[int] = []
    t0 = time.perf_counter()
    steps = ngram_generate_step(mx.array(prompt[-1:]), model, context_tokens=prompt,
                                num_draft_tokens=draft, max_tokens=max_tokens,
                                prompt_cache=cache, stats=stats, persist_costs=False)
    for token, _ in steps:
        if int(token) in eos:
            break
        tokens.append(int(token))
        if len(tokens) >= max_tokens:
            break
    steps.close()
    decode_s = time.perf_counter() - t0
    return {"tokens": tokens, "decode_s": decode_s, "passes": stats.verify_steps + stats.plain_steps,
            "drafted": stats.drafted, "accepted": stats.accepted}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("prompts", nargs="+", type=Path)
    p.add_argument("--limit", type=int, default=None, help="first N cases of each file")
    p.add_argument("--skip", type=int, default=0,
                   help="leave out the first N cases of each file (a long set split across calls)")
    p.add_argument("--weights", choices=("auto", "float32", "quantized"), default="auto",
                   help="as warmspec bench: auto is float32 on a CPU and the GGUF's 4-bit on a GPU")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--optiq-draft", type=int, default=OPTIQ_DRAFT, help="OptiQ's draft ceiling")
    args = p.parse_args()

    lm = load(None, dequantize={"auto": None, "float32": True, "quantized": False}[args.weights])
    costs = Engine(lm).measure_costs()
    engines = {"plain": Engine(lm, speculate=False), "ngram": Engine(lm, speculate=True, costs=costs)}
    warm = lm.tokenizer.encode("Hello! How are you today? Hello! How are you today?")
    for e in engines.values():
        warmspec_run(e, warm, 8)
    optiq_run(lm, warm, 8)  # OptiQ calibrates its cost table once per model, on first use

    args.out.mkdir(parents=True, exist_ok=True)
    info = msgspec.to_builtins(machine())
    info["weights"] = "4-bit (the GGUF's Q4_1 as MLX quantized layers)" if lm.quantized else "float32 (dequantized at load)"
    rows = []
    cases = read_cases(args.prompts, None if args.limit is None else args.skip + args.limit)
    seen: dict[str, int] = {}
    for file, case in cases:
        seen[file] = seen.get(file, 0) + 1
        if seen[file] <= args.skip:
            continue
        prompt = chat_ids(lm.tokenizer, case.messages)
        runs = {m: warmspec_run(e, prompt, case.max_tokens) for m, e in engines.items()}
        runs["optiq"] = optiq_run(lm, prompt, case.max_tokens, args.optiq_draft)
        plain = runs["plain"]
        for mode, r in runs.items():
            rows.append({"file": file, "id": case.id, "mode": mode, "tokens": len(r["tokens"]),
                         "decode_s": r["decode_s"], "passes": r["passes"], "drafted": r["drafted"],
                         "accepted": r["accepted"], "identical_to_plain": r["tokens"] == plain["tokens"]})
        rate = {m: len(r["tokens"]) / r["decode_s"] for m, r in runs.items()}
        print(f"{file} {case.id}: plain {rate['plain']:.1f} tok/s | warmspec {rate['ngram'] / rate['plain']:.2f}x"
              f" | optiq {rate['optiq'] / rate['plain']:.2f}x"
              f" | identical {runs['ngram']['tokens'] == plain['tokens']}/{runs['optiq']['tokens'] == plain['tokens']}",
              flush=True)
        write(args.out, rows, args.optiq_draft, info)  # after every case: a run cut short keeps its cases


def summarize(rows: list[dict]) -> dict:
    out = {}
    for file in dict.fromkeys(r["file"] for r in rows):
        here = [r for r in rows if r["file"] == file]
        plain = {r["id"]: r for r in here if r["mode"] == "plain"}
        base = sum(r["tokens"] for r in plain.values()) / sum(r["decode_s"] for r in plain.values())
        out[file] = {}
        for mode in ("plain", "ngram", "optiq"):
            m = [r for r in here if r["mode"] == mode]
            tok, sec = sum(r["tokens"] for r in m), sum(r["decode_s"] for r in m)
            per = [(r["tokens"] / r["decode_s"]) / (plain[r["id"]]["tokens"] / plain[r["id"]]["decode_s"]) for r in m]
            out[file][mode] = {"cases": len(m), "tokens": tok, "decode_s": sec, "tok_s": tok / sec,
                               "speedup_vs_plain": tok / sec / base, "per_case_min": min(per),
                               "per_case_median": statistics.median(per), "per_case_max": max(per),
                               "identical": f"{sum(r['identical_to_plain'] for r in m)}/{len(m)}"}
    return out


def write(out: Path, rows: list[dict], draft: int, info: dict) -> None:
    summary = summarize(rows)
    (out / "results.json").write_text(json.dumps({
        "machine": info,
        "optiq": f"mlx-optiq 0.7.7, optiq.runtime.ngram_spec.ngram_generate_step, num_draft_tokens={draft}, gate on",
        "summary": summary, "cases": rows}, indent=1))
    names = {"plain": "warmspec plain", "ngram": f"warmspec n-gram (draft ceiling {MAX_DRAFT})",
             "optiq": f"OptiQ 0.7.7 n-gram (draft ceiling {draft})"}
    lines = ["# warmspec and OptiQ's n-gram path, side by side", "",
             (f"- machine: {info['cpu']}, {info['cores']} cores; {info['device']}, {info['blas']}; "
              f"MLX {info['mlx']}, mlx-lm {info['mlx_lm']}, Python {info['python']}"),
             (f"- model: SmolLM2-135M-Instruct, {info['weights']}; greedy; the three modes "
              "alternate per case in one process; decode time excludes prefill"),
             "- speedup: decode tok/s over warmspec plain's on the same cases", "",
             "| file | decoder | cases | tokens | decode s | tok/s | speedup | per case (min / median / max) | identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    for file, modes in summary.items():
        for mode, s in modes.items():
            lines.append(f"| {file} | {names[mode]} | {s['cases']} | {s['tokens']} | {s['decode_s']:.1f} | "
                         f"{s['tok_s']:.1f} | {s['speedup_vs_plain']:.2f}x | {s['per_case_min']:.2f} / "
                         f"{s['per_case_median']:.2f} / {s['per_case_max']:.2f} | {s['identical']} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
