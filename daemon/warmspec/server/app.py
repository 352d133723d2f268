"""The daemon's state, shared by every transport: the model, its engine and scheduler, the
workspace, limits, and the translation of client requests into engine jobs."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Sequence

import msgspec

import warmspec_protocol as wire
from warmspec_protocol import Message, ModelInfo, Status

from .. import blas, memory
from ..core import Engine, EngineError, SamplingParams
from ..model import LoadedModel
from ..tokenizer import Tokenizer
from ..workspace import UnreadableFile, Workspace, WorkspaceError
from .feedback import InlineMetrics
from .scheduler import PRIORITY_NORMAL, Busy, Job, Scheduler

log = logging.getLogger("warmspec.app")


def to_wire(obj: msgspec.Struct, kind: type) -> Any:
    """A core value as its wire twin (the same fields), at the server's edge."""
    return msgspec.convert(msgspec.to_builtins(obj), kind)


to_core = to_wire  # and a checked wire value as the core's


# Argument names under which coding agents' file tools pass the file they read or write.
PATH_KEYS = ("path", "file_path", "filepath", "filename", "file", "target_file", "notebook_path")


class Limits(msgspec.Struct, kw_only=True):
    """Bounds on what one request, or one client, may ask for."""

    max_body_bytes: int = 16 << 20
    # The most tokens one answer may take, asked for or not. A request without max_tokens writes
    # until the model stops or the context ends, as OpenAI and llama-server do (agents such as
    # aider send none and expect a whole file back; a default of 1024 cut their answers), and this
    # bounds it on models whose context is longer than any answer should be.
    max_tokens: int = 32768
    max_stop: int = 16
    max_stop_len: int = 256
    # JSON-RPC connections (Unix socket and TCP together) served at once; the one over gets a
    # JSON-RPC error and is closed. Editors take one each (plus a moment's probe from `warmspec lsp`).
    max_connections: int = 64
    # The largest frame read from a connection that has not yet presented the api key (daemons with
    # --api-key): enough for an editor's initialize (capabilities run to about 10 KiB), so a client
    # without the key cannot make the daemon buffer a 16 MiB body, and 64 of them hold 4 MiB at most.
    max_preauth_frame_bytes: int = 64 << 10


def longest_token_chars(tok: Tokenizer) -> int:
    """The most characters of text one token can stand for: the longest piece in the vocabulary.

    A piece is spelled in characters that stand for at least one character of text each (byte-level
    BPE spells one byte per character, SentencePiece writes ``\u2581`` for a space, byte fallback
    ``<0x41>`` six for one byte), so a text of ``n`` characters is at least ``n / longest`` tokens.
    Added and special tokens are in the vocabulary with their text."""
    return max((len(piece) for piece in tok.backend.get_vocab(with_added_tokens=True)), default=1)


class App:
    def __init__(self, lm: LoadedModel, engine: Engine, *, workspace_roots: Sequence[Path] = (),
                 api_key: str | None = None, limits: Limits | None = None):
        self.lm = lm
        self.engine = engine
        self.limits = limits or Limits()
        self.api_key = api_key
        # Always there, roots or not: editors add theirs while the daemon runs (Workspace.add_root).
        self.workspace = Workspace(workspace_roots, lm.tokenizer)
        self.scheduler = Scheduler(engine, workspace=self.workspace)
        self.started = time.time()
        self.inline = InlineMetrics()  # ghost text's timings and feedback (owned by the event loop)
        # Measured once here: a prompt longer than this cannot fit, whatever its tokens.
        self.max_prompt_chars = lm.context_length * longest_token_chars(lm.tokenizer) if lm.context_length else None
        self.parameters_bytes = lm.nbytes  # kept: the weights may be unloaded while idle
        self.bandwidth: float | None = None  # bytes/s, measured at startup (roofline.py)

    def start(self) -> None:
        """Start decoding, and watching the workspace: files read earlier are re-indexed when
        they change on disk. Idempotent (the HTTP server calls it again)."""
        self.scheduler.start()
        self.workspace.watch()

    @property
    def keepalive(self):
        return self.scheduler.keepalive

    def stop(self) -> None:
        """Stop decoding, then save every cached prefix to the disk tier (the worker is gone, so
        this thread owns the engine now) and wait for the writes: the next daemon starts warm."""
        self.scheduler.stop()
        self.workspace.stop()
        disk = getattr(self.engine, "disk", None)  # test doubles of the engine have none
        if disk is None:
            return
        if self.scheduler._thread is not None and self.scheduler._thread.is_alive():
            log.warning("the decode thread did not stop: prefix caches not saved to disk")
        elif self.engine.model is not None:
            disk.spill_all(self.engine)
        disk.close()

    # -- requests -> jobs -------------------------------------------------------------------------

    def admit(self) -> None:
        """Refuse a generation now, before its prompt is tokenized, when the queue cannot take it
        (``Busy``); the scheduler checks again when the job is submitted."""
        s = self.scheduler
        if s.queue_depth >= s.max_queue:
            raise Busy(f"queue full ({s.max_queue} requests waiting)")

    def check_fits(self, text: str) -> None:
        """Refuse, without tokenizing it, a prompt (or prediction) text too long to fit the context at the most
        characters per token the vocabulary allows: 16 MiB of text is millions of tokens, seconds of
        CPU to count, and could never be served anyway."""
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise EngineError(f"prompt of {len(text)} characters cannot fit the context of "
                              f"{self.lm.context_length} tokens (at most {self.max_prompt_chars} characters)")

    def chat_text(self, messages: Sequence[Message], tools: list[dict[str, Any]] | None = None) -> str:
        """A chat rendered by the model's template, ready for the assistant's turn, checked to fit.
        (Templates are jinja and read plain dicts: the one conversion happens here.)"""
        if not messages:
            raise EngineError("messages must not be empty")
        text = self.lm.tokenizer.apply_chat_template([msgspec.to_builtins(m) for m in messages], tools=tools)
        self.check_fits(text)
        return text

    def chat_prompt(self, messages: Sequence[Message], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of the chat (see ``chat_text``)."""
        return self.lm.tokenizer.encode(self.chat_text(messages, tools))

    def chat_request(self, messages: Sequence[Message], *, tools: list[dict[str, Any]] | None = None,
                     conversation: str | None = None, note_reads: bool = True) -> tuple[list[int], str]:
        """The prompt's token ids and the conversation's id (the client's, else derived), indexing
        on the way the files the chat's tool calls read -- once the chat is known to fit. Every
        transport's chat comes through here; it encodes for up to a second on long prompts, so
        transports call it in a worker thread."""
        conversation = conversation or self.conversation_of(messages)
        text = self.chat_text(messages, tools)
        if note_reads:
            self.note_tool_reads(messages, conversation)
        return self.lm.tokenizer.encode(text), conversation

    @staticmethod
    def conversation_of(messages: Sequence[Message]) -> str:
        """A stable id for a chat: agents resend the whole conversation every turn, and its
        opening (the system prompt and first user message) stays the same while it grows."""
        head = [[m.role, m.content] for m in messages[:2]]
        return hashlib.sha256(json.dumps(head).encode()).hexdigest()[:16]

    def note_tool_reads(self, messages: Sequence[Message], conversation: str) -> int:
        """Index the workspace files that the chat's tool calls name (``path``, ``file_path``, ...):
        an agent reads a file through a tool and then writes its new version, copying most of it.
        The file is read from disk, not from the tool result, which may be numbered or cut. A path
        the workspace refuses is skipped -- an unreadable file with a warning: agents resend the
        history every turn, so failing the chat for it would fail every later turn too."""
        seen = 0
        for m in messages:
            for call in m.tool_calls or []:
                args = call.function.arguments
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except json.JSONDecodeError:
                        continue
                if not isinstance(args, dict):
                    continue
                for key in PATH_KEYS:
                    if isinstance(args.get(key), str):
                        try:
                            self.workspace.did_read(args[key], conversation=conversation)
                            seen += 1
                        except UnreadableFile as e:
                            log.warning("tool call's file not indexed: %s", e)
                        except WorkspaceError as e:  # outside the roots, ignored, missing...
                            log.debug("tool call's file not indexed: %s", e)
        return seen

    def text_prompt(self, prompt: str) -> list[int]:
        """Token ids of a plain prompt; tokenizes, so transports call it in a worker thread."""
        if not prompt:
            raise EngineError("prompt must not be empty")
        self.check_fits(prompt)
        return self.lm.tokenizer.encode(prompt, add_special_tokens=True)

    def prediction_tokens(self, text: str | None) -> list[int]:
        """Token ids of a client's predicted output (OpenAI's ``prediction``), checked like a
        prompt: refused, before it is tokenized, when it is too long to fit the context, since
        the answer it predicts could not. Tokenizes, so transports call it in a worker thread."""
        if not text:
            return []
        self.check_fits(text)
        tokens = self.lm.tokenizer.encode(text)
        ctx = self.lm.context_length
        if ctx and len(tokens) >= ctx:
            raise EngineError(f"prediction of {len(tokens)} tokens does not fit the context of {ctx}")
        return tokens

    def sampling(self, **given: Any) -> SamplingParams:
        """The model's defaults overridden by whatever the client set (None = not set)."""
        changes = {k: v for k, v in given.items() if v is not None}
        try:
            checked = msgspec.convert(msgspec.to_builtins(self.lm.defaults) | changes, wire.SamplingParams)
        except msgspec.ValidationError as e:
            raise EngineError(f"invalid sampling parameter: {e}") from None
        return to_core(checked, SamplingParams)

    def job(self, prompt: list[int], params: SamplingParams, *, max_tokens: int | None,
            stop: Sequence[str] | str | None = None, speculate: bool = True,
            priority: int = PRIORITY_NORMAL, conversation: str | None = None, label: str = "",
            prediction: Sequence[int] = ()) -> Job:
        lim = self.limits
        ctx = self.lm.context_length
        if ctx and len(prompt) >= ctx:
            raise EngineError(f"prompt of {len(prompt)} tokens does not fit the context of {ctx}")
        if max_tokens is None:  # the rest of the context (see Limits.max_tokens)
            max_tokens = min(lim.max_tokens, ctx - len(prompt)) if ctx else lim.max_tokens
        if not 0 < max_tokens <= lim.max_tokens:
            raise EngineError(f"max_tokens must be between 1 and {lim.max_tokens}")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > lim.max_stop or any(len(s) > lim.max_stop_len for s in stops):
            raise EngineError(f"at most {lim.max_stop} stop strings of {lim.max_stop_len} characters")
        return Job(prompt=prompt, params=params, max_tokens=max_tokens, stop=stops,
                   speculate=speculate and self.engine.speculate, priority=priority,
                   conversation=conversation, label=label, prediction=list(prediction))

    # -- introspection ----------------------------------------------------------------------------

    def model_info(self) -> ModelInfo:
        lm = self.lm
        return ModelInfo(id=lm.name, source=lm.source, device=lm.device, quantized=lm.quantized,
                         context_length=lm.context_length, parameters_bytes=self.parameters_bytes,
                         defaults=lm.defaults)

    def prefix_stats(self) -> wire.PrefixCacheStats:
        """The memory tier's statistics, and the disk tier's when there is one."""
        pc = to_wire(self.engine.prefix_stats(), wire.PrefixCacheStats)
        disk = getattr(self.engine, "disk", None)  # test doubles of the engine have none
        if disk is None:
            return pc
        d = disk.describe()
        return msgspec.structs.replace(pc, disk_entries=d.entries, disk_bytes=d.bytes,
                                       disk_budget_bytes=d.budget_bytes, disk_hits=d.hits,
                                       disk_tokens_loaded=d.tokens_loaded, disk_writes=d.writes,
                                       disk_dropped=d.dropped)

    def status(self) -> Status:
        s = self.scheduler
        ws = self.workspace
        return Status(model=self.model_info(), blas=blas.describe(), uptime_s=time.time() - self.started,
                      queue=s.queue_depth, active=s.active is not None,
                      requests_completed=s.completed, requests_failed=s.failed,
                      totals=to_wire(self.engine.totals, wire.GenerationStats),
                      workspace_files=len(ws.files), workspace_bytes=ws.nbytes,
                      workspace_roots=[str(r) for r in ws.roots], pid=os.getpid(),
                      prefix_cache=self.prefix_stats(), engine_resets=self.engine.resets,
                      memory=memory.stats(), inline=self.inline.status(), **self._keepalive_status())

    def _keepalive_status(self) -> dict[str, Any]:
        ka = self.keepalive
        if ka is None:
            return {}
        idle = 0.0 if self.scheduler.active is not None else ka.idle_for
        return {"model_state": ka.state, "keep_alive_s": ka.idle_s, "idle_s": idle, "loads": ka.loads}
