"""Tokenizer, chat template and streaming text for every model warmspec loads.

One small class over the ``tokenizers`` library, built either from a GGUF file's metadata or from a
Hugging Face model directory (``tokenizer.json`` + ``tokenizer_config.json``). It avoids importing
``transformers`` (1.2 s of start-up here) and gives the engine what it needs and nothing else:
encode, the raw bytes of every token (so streaming never splits a UTF-8 character), the special and
end-of-sequence ids, and the chat template.
"""

from __future__ import annotations

import codecs
import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Tokenizer as _HFTokenizer, decoders, models, pre_tokenizers

# ChatML, used when a model ships no chat template of its own.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TokenizerError(ValueError):
    pass


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's reversible map from the printable characters of byte-level BPE back to bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _bytes_byte_level(piece: str) -> bytes:
    table = _byte_decoder()
    try:
        return bytes(table[ch] for ch in piece)
    except KeyError:
        return piece.encode("utf-8")


def _bytes_sentencepiece(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


def _template_env() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )

    def raise_exception(message: str) -> None:
        raise TokenizerError(f"chat template: {message}")

    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class Tokenizer:
    """Encode text, know every token's bytes, and format chats."""

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        token_bytes: list[bytes],
        special_ids: Iterable[int],
        eos_ids: Iterable[int],
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
    ):
        self.backend = backend
        self.token_bytes = token_bytes
        self.special_ids = frozenset(special_ids)
        self.eos_ids = frozenset(eos_ids)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template_source = chat_template or DEFAULT_CHAT_TEMPLATE
        self._template = _template_env().from_string(self.chat_template_source)
        # Special tokens print as nothing: like skip_special_tokens in transformers.
        for i in self.special_ids:
            if i < len(self.token_bytes):
                self.token_bytes[i] = b""

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        # encode_batch releases the GIL (encode does not): 1 MB of text takes ~0.7 s here, which
        # would otherwise stall the daemon's event loop.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.token_bytes[i] for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        return self._template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def detokenizer(self) -> "StreamingDetokenizer":
        return StreamingDetokenizer(self.token_bytes)

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> "Tokenizer":
        """Byte-level BPE from ``tokenizer.ggml.*`` (vocab, merges, token types, template)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(
                f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')"
            )
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        types = meta.get("tokenizer.ggml.token_type")
        types = types.tolist() if types is not None else [1] * len(tokens)
        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
        backend = _HFTokenizer(bpe)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        # llama.cpp's "smollm"/"starcoder" pre-tokenizers split every digit on its own, then
        # apply GPT-2's regex; plain "gpt2" applies the regex only.
        pre = meta.get("tokenizer.ggml.pre", "gpt2")
        if pre in ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"):
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        else:
            backend.pre_tokenizer = byte_level
        backend.decoder = decoders.ByteLevel()
        control = [i for i, t in enumerate(types) if t in (3, 4)]  # control, user-defined
        backend.add_special_tokens(
            [AddedToken(tokens[i], special=True, normalized=False) for i in control]
        )

        def scalar(key: str) -> int | None:
            v = meta.get(key)
            return None if v is None else int(v.item() if hasattr(v, "item") else v)

        eos = scalar("tokenizer.ggml.eos_token_id")
        bos = scalar("tokenizer.ggml.bos_token_id")
        eos_ids = {eos} if eos is not None else set()
        # ChatML models end a turn with <|im_end|> and a document with <|endoftext|>: stop on both.
        for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>"):
            if name in tokens:
                eos_ids.add(tokens.index(name))
        return cls(
            backend,
            token_bytes=[_bytes_byte_level(t) for t in tokens],
            special_ids=control,
            eos_ids=eos_ids,
            bos_token=tokens[bos] if bos is not None else None,
            eos_token=tokens[eos] if eos is not None else None,
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_dir(cls, path: Path, extra_eos_ids: Iterable[int] = ()) -> "Tokenizer":
        """From a Hugging Face model directory's ``tokenizer.json`` and ``tokenizer_config.json``."""
        tj = path / "tokenizer.json"
        if not tj.exists():
            raise TokenizerError(f"{path} has no tokenizer.json")
        backend = _HFTokenizer.from_file(str(tj))
        spec = json.loads(tj.read_text())
        config = _read_json(path / "tokenizer_config.json")
        vocab = backend.get_vocab(with_added_tokens=True)
        size = max(vocab.values()) + 1
        pieces = [""] * size
        for piece, i in vocab.items():
            pieces[i] = piece
        decoder = json.dumps(spec.get("decoder") or {})
        to_bytes = _bytes_byte_level if "ByteLevel" in decoder else _bytes_sentencepiece
        token_bytes = [to_bytes(p) for p in pieces]
        special = set()
        for added in spec.get("added_tokens", []):
            token_bytes[added["id"]] = added["content"].encode("utf-8")
            if added.get("special"):
                special.add(added["id"])

        def token_text(value: Any) -> str | None:
            return value.get("content") if isinstance(value, dict) else value

        eos_token = token_text(config.get("eos_token"))
        bos_token = token_text(config.get("bos_token"))
        eos_ids = set(extra_eos_ids)
        if eos_token in vocab:
            eos_ids.add(vocab[eos_token])
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text()
        return cls(
            backend,
            token_bytes=token_bytes,
            special_ids=special,
            eos_ids=eos_ids,
            bos_token=bos_token,
            eos_token=eos_token,
            chat_template=template,
        )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def byte_tokenizer(size: int = 256) -> Tokenizer:
    """One token per byte, no merges, no special tokens: for random-weight models in tests and
    probes, where text round-trips exactly (``encode(s) == list(s.encode())``)."""
    table = {b: c for c, b in _byte_decoder().items()}
    pieces = [table[i] for i in range(size)]
    backend = _HFTokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return Tokenizer(backend, token_bytes=[bytes([i]) for i in range(size)], special_ids=(), eos_ids=())


class StreamingDetokenizer:
    """Token ids in, text out, never splitting a UTF-8 character across two pieces."""

    def __init__(self, token_bytes: list[bytes]):
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token: int) -> str:
        return self._decoder.decode(self._token_bytes[token])

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class TextStream:
    """Turns accepted tokens into text deltas, stopping at stop strings.

    Text that could still grow into a stop string is held back until it cannot, so a client never
    sees part of a stop string; the stop string itself is never emitted.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        self._detok = tokenizer.detokenizer()
        self._stop = [s for s in stop if s]
        self._pending = ""
        self.text = ""  # everything emitted so far
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, token: int) -> str:
        """Add one token; return the text now safe to emit ('' if none)."""
        if self.stopped:
            return ""
        self._pending += self._detok.add(token)
        return self._release(final=False)

    def finish(self) -> str:
        if not self.stopped:
            self._pending += self._detok.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        if self._stop:
            # Emitted text never ends in a proper prefix of a stop string (that part is held
            # back), so a match can only start inside the pending text.
            hits = [(i, s) for i, s in ((self._pending.find(s), s) for s in self._stop) if i >= 0]
            if hits:
                i, self.matched = min(hits)
                out = self._pending[:i]
                self.text += out
                self._pending = ""
                self.stopped = True
                return out
        if final or not self._stop:
            out, self._pending = self._pending, ""
        else:
            keep = self._partial_stop_suffix(self._pending)
            out = self._pending[: len(self._pending) - keep]
            self._pending = self._pending[len(out) :]
        self.text += out
        return out

    def _partial_stop_suffix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
