"""Finding the daemon, or starting it in the background, for the commands that are its clients:
``warmspec ask`` and ``warmspec lsp``. One place, so both follow the same rules: the same socket,
the same options for a daemon they start, and the same refusal of a daemon serving another model.

No MLX here: a client should start as fast as Python does.
"""

from __future__ import annotations

import argparse

from warmspec_protocol import rpc as wire

from . import fetch
from .client import Client
from .server import daemon
from .server.daemon import DaemonError, model_key


def connect_daemon(args: argparse.Namespace, err) -> Client:
    """A client of the running daemon, or of one started now in the background (its load progress
    shown on ``err``, a rich Console on stderr, until the socket answers). A daemon started here
    gets the command's ``--model``, ``--max-draft``, ``--mtp``, ``--draft-model``, ``--no-speculate``,
    ``--workspace``, ``--keep-alive`` and ``--prefix-disk(-dir)``, and its api key (``--api-key``,
    ``--api-key-file`` or ``$WARMSPEC_API_KEY``) in its environment."""
    paths = daemon.RuntimePaths.resolve(args.socket)
    try:
        return Client.unix(paths.socket)
    except OSError:
        pass
    if not args.model:
        # Download the default model here, in the foreground, where pip's progress bar reaches the
        # user's terminal; the background daemon would only write it to its log.
        try:
            fetch.pull()
        except fetch.FetchError as e:
            raise DaemonError(str(e)) from None
    serve_args = [*(["--model", args.model] if args.model else []),
                  *(["--max-draft", str(args.max_draft)] if args.max_draft else []),
                  *(["--mtp", str(args.mtp)] if getattr(args, "mtp", None) else []),
                  *(["--draft-model", args.draft_model] if getattr(args, "draft_model", None) else []),
                  *(["--no-speculate"] if args.no_speculate else []),
                  *(["--keep-alive", args.keep_alive.text] if args.keep_alive else []),
                  *(["--prefix-disk", str(args.prefix_disk)] if args.prefix_disk is not None else []),
                  *(["--prefix-disk-dir", str(args.prefix_disk_dir)] if args.prefix_disk_dir else []),
                  *(a for w in args.workspace for a in ("--workspace", str(w)))]
    offset = paths.log.stat().st_size if paths.log.exists() else 0
    proc = daemon.start_background(paths, serve_args, api_key=daemon.api_key_from(args))
    with err.status("Starting the warmspec daemon…") as spinner:
        client = daemon.wait_until_ready(paths, proc, offset,
                                         lambda line: spinner.update(f"Starting the daemon: {line}"))
    err.print(f"[dim]warmspec: daemon started (pid {proc.pid}, log {paths.log}); "
              f"`warmspec stop` ends it[/dim]")
    return client


def check_model(client: Client, model: str | None) -> wire.ModelsResult:
    """The daemon's model, from an initialized ``client``. ``DaemonError`` when ``--model`` names
    another one: answering with a model the user did not ask for would be a silent surprise."""
    models = client.call("warmspec/models", None, wire.ModelsResult)
    if model and model_key(model) != models.requested:
        raise DaemonError(f"the running daemon serves {models.models[0].id} "
                          f"({models.requested or 'the default model'}), not {model}. "
                          "Stop it with `warmspec stop`, use another --socket for a second daemon, "
                          "or run with --in-process.")
    return models
