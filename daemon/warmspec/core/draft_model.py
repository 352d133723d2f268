"""A separate small draft model sharing the target's tokenizer (``--draft-model``).

The draft model is loaded like the target (``warmspec.model.load``) and checked at load: the same
number of tokens and the same token string for every id, or a clear error. Its logits are cut or
padded to the target's width (vocabularies padded to different sizes, e.g. 151936 beside 152064
rows for one tokenizer), so a draft is always an id the target scores and ``q`` rows line up with
the target's ``p`` rows.

It keeps its own cache as a ``CacheState``: the tokens the cache holds, prefix reuse (a context that
shares a prefix with what the cache holds rewinds to it, through checkpoints for the layers that
cannot be trimmed) and, beyond the committed tokens, the drafts it fed itself while proposing. Each
of those one-token passes is taken under a ``cache.Checkpoint``, the rollback every cache kind
supports (KV trim; sliding windows and recurrent state restored from the snapshot taken before the
pass). When the next context arrives the drafts it confirms stay, the rest are rolled back newest
first, and the cache again holds exactly the committed tokens before anything new is fed.

Tokens are chosen with the target's own processing (``sampling.distribution``: temperature, top-k,
top-p, min-p), so the exact sampler can use the returned rows as ``q``.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from .types import SamplingParams

from .cache import CacheState, Checkpoint
from ..model import LoadedModel, ModelError, load
from .sampling import host_row, make_rng, probabilities, sample
from ..tokenizer import Tokenizer

PREFILL_CHUNK = 512      # positions per prefill pass: bounds the activations of a long first context
MAX_CHECKPOINTS = 4      # recurrent / sliding-window states kept for prefix reuse, newest first


class DraftError(ModelError):
    """A draft model that cannot serve this target; ``str()`` is one line for the user."""


def logits_width(model: nn.Module) -> int:
    """Rows of the output head: the token ids the model scores (its padded vocabulary)."""
    text = getattr(model, "language_model", model)
    head = getattr(text, "lm_head", None)
    weight = head.weight if head is not None else text.model.embed_tokens.weight
    return int(weight.shape[0])


def _pieces(tok: Tokenizer) -> list[str | None]:
    return [tok.backend.id_to_token(i) for i in range(tok.vocab_size)]


def check_vocab(target: Tokenizer, draft: Tokenizer, *, draft_name: str = "draft model") -> None:
    """Same size and the same token string for every id; otherwise a draft's ids would mean other
    text to the target and nothing it proposes could be trusted."""
    if target.vocab_size != draft.vocab_size:
        raise DraftError(f"{draft_name}: its vocabulary has {draft.vocab_size} tokens, the target's "
                         f"{target.vocab_size}; a draft model must share the target's tokenizer")
    a, b = _pieces(target), _pieces(draft)
    if a != b:
        i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        raise DraftError(f"{draft_name}: token {i} is {b[i]!r}, the target's is {a[i]!r}; a draft "
                         "model must share the target's tokenizer")


class DraftModel:
    """``propose(context_tokens, k, params) -> (tokens, q rows or None)``; ``commit(context_tokens)``
    brings the cache to exactly those tokens without drafting."""

    def __init__(self, lm: LoadedModel, target: LoadedModel):
        check_vocab(target.tokenizer, lm.tokenizer, draft_name=lm.name)
        self.lm = lm
        self.model = lm.model
        self.width = logits_width(target.model)
        self.state = CacheState(self._fresh())
        self._spec: list[tuple[Checkpoint, mx.array]] = []  # per fed draft: (before it, row before)
        self._last: mx.array | None = None  # logits after the last token the cache holds

    @classmethod
    def load(cls, spec: str, target: LoadedModel, *, dequantize: bool | None = None) -> "DraftModel":
        return cls(load(spec, dequantize=dequantize), target)

    def _fresh(self) -> list[Any]:
        return make_prompt_cache(self.model)

    @property
    def tokens(self) -> list[int]:
        """The tokens whose state the cache holds (committed, then any drafts fed since)."""
        return self.state.tokens

    # -- the cache --------------------------------------------------------------------------------

    def _drop_drafts(self, keep: int) -> None:
        """Roll back the fed drafts after the first ``keep``, newest first; the kept ones become
        committed (their checkpoints are no longer needed)."""
        if keep < len(self._spec):
            for cp, _ in reversed(self._spec[keep:]):
                cp.rollback(0)
            self._last = self._spec[keep][1]
            del self.state.tokens[len(self.state.tokens) - len(self._spec) + keep:]
        self._spec = []

    def _feed(self, tokens: Sequence[int]) -> None:
        for i in range(0, len(tokens), PREFILL_CHUNK):
            chunk = list(tokens[i: i + PREFILL_CHUNK])
            logits = self.model(mx.array([chunk]), cache=self.state.cache)
            self._last = logits[0, -1]
            mx.eval(self._last, [c.state for c in self.state.cache])
            self.state.tokens.extend(chunk)
        self.state.checkpoint()
        if len(self.state.checkpoints) > MAX_CHECKPOINTS:
            keep = sorted(self.state.checkpoints)[-MAX_CHECKPOINTS:]
            self.state.checkpoints = {p: self.state.checkpoints[p] for p in keep}

    def _rewind(self, context: Sequence[int]) -> None:
        t = self.state.usable(context)
        if t < len(self.state.tokens):
            self.state.rewind(t, self._fresh)
            self._last = None

    def commit(self, context: Sequence[int]) -> None:
        """Make the cache hold exactly ``context`` (and know the logits after its last token)."""
        if not context:
            raise ValueError("a draft model needs at least one context token")
        held = self.state.tokens
        base = len(held) - len(self._spec)
        n = min(len(held), len(context))
        same = next((i for i in range(n) if held[i] != context[i]), n)
        self._drop_drafts(max(0, same - base))
        self._rewind(context)
        if len(self.state.tokens) == len(context) and self._last is None:
            self._rewind(context[:-1])  # the logits after the last token are needed: refeed it
        if len(context) > len(self.state.tokens):
            self._feed(context[len(self.state.tokens):])

    # -- proposing --------------------------------------------------------------------------------

    def _row(self, row: mx.array) -> mx.array:
        width = row.shape[-1]
        if width > self.width:
            return row[: self.width]
        if width < self.width:
            return mx.concatenate([row, mx.full((self.width - width,), -mx.inf, dtype=row.dtype)])
        return row

    def propose(self, context: Sequence[int], k: int, params: SamplingParams | None = None,
                rng: np.random.Generator | None = None) -> tuple[list[int], list[np.ndarray] | None, float]:
        """``k`` tokens continuing ``context``: greedy (``params`` None or greedy), else sampled from
        ``distribution(logits, params)``, whose rows are returned as the drafts' ``q``. The cache is
        left holding ``context`` plus the first k-1 drafts; the next ``commit``/``propose`` keeps
        those the new context confirms and rolls back the rest."""
        self.commit(context)
        greedy = params is None or params.greedy
        if not greedy and rng is None:
            rng = make_rng(params)
        row = self._row(self._last)
        tokens: list[int] = []
        qs: list[np.ndarray] = []
        first = 0.0
        for j in range(k):
            if greedy:
                best = mx.argmax(row)
                if j == 0:  # the draft model's probability of its first token: the gate's confidence
                    top = mx.softmax(row.astype(mx.float32))[best]
                    mx.eval(best, top)
                    first = top.item()
                tok = int(best.item())
            else:
                q = host_row(probabilities(row[None], params)[0])
                tok = sample(q, rng)
                qs.append(q)
                first = first or float(q[tok])
            tokens.append(tok)
            if j + 1 < k:
                self._spec.append((Checkpoint(self.state.cache, 1), self._last))
                self._last = self.model(mx.array([[tok]]), cache=self.state.cache)[0, -1]
                self.state.tokens.append(tok)
                row = self._row(self._last)
        return tokens, None if greedy else qs, first
