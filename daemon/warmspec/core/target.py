"""The target pass: the model verifying one token and the drafts after it, on its cache.

``verify(inputs, cache) -> Pass`` runs one forward pass and returns the logits of every input
position, the hidden states a drafter conditions on (the final norm's output -- what the output head
scores, and what MTP heads are trained on: see ``mtp.py`` -- when asked for) and the checkpoint that rolls every cache kind back. ``keep(pass, n)`` keeps the
first ``n`` positions; where a cache kind cannot simply drop the rest (recurrent state without
captured per-position states) it restores and replays the kept inputs itself, so the engine never
sees which kind of cache it runs on. Two implementations, chosen at construction: the model's own
forward, and ``hybrid.verify_forward`` for GatedDeltaNet hybrids, which captures the recurrent
state after every position so that a rejection costs no extra pass.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import mlx.core as mx
import mlx.nn as nn

from . import hybrid
from .cache import Checkpoint


class Pass(NamedTuple):
    logits: mx.array  # (positions, vocab), lazy
    hidden: mx.array | None  # (positions, hidden size): the final norm's output, when tapped
    checkpoint: Checkpoint
    inputs: mx.array  # (positions,)


class _Slot:
    """Holds the last output outside the module's tree: an array attribute of an ``nn.Module``
    is a parameter (it was counted in the model's size and would be saved with its weights)."""

    __slots__ = ("value",)

    def __init__(self):
        self.value: mx.array | None = None


class _Tap(nn.Module):
    """Wraps the model's final norm to keep its output: the hidden state drafters condition on."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm
        self.out = _Slot()

    @property
    def last(self) -> mx.array | None:
        return self.out.value

    def __call__(self, x: mx.array) -> mx.array:
        self.out.value = self.norm(x)
        return self.out.value


def _inner(model: nn.Module) -> nn.Module:
    lm = getattr(model, "language_model", model)
    return getattr(lm, "model", lm)


class Target:
    """The model as the decode step sees it. ``capture``: verify hybrids through the capturing
    pass. ``tap_hidden()`` makes passes carry hidden states (once; for model drafters)."""

    def __init__(self, model: nn.Module, *, capture: bool = False):
        self.model = model
        self.capture = capture
        self.replays = 0  # extra passes spent restoring recurrent state after a rejection
        self._tap: _Tap | None = None

    @property
    def vocab_size(self) -> int | None:
        """Rows of the input embedding: the ids a pass may be fed (a lookup past them reads
        outside the table; MLX does not check on the CPU). None for a model without one (the
        bench's replay model reads a script, not an embedding)."""
        embed = getattr(_inner(self.model), "embed_tokens", None)
        return None if embed is None else int(embed.weight.shape[0])

    def tap_hidden(self) -> None:
        inner = _inner(self.model)
        if self._tap is None:
            if isinstance(inner.norm, _Tap):
                self._tap = inner.norm
            else:
                self._tap = inner.norm = _Tap(inner.norm)

    @property
    def hidden_size(self) -> int:
        return _inner(self.model).norm.weight.shape[-1] if self._tap is None else self._tap.norm.weight.shape[-1]

    def verify(self, inputs: mx.array, cache: list[Any]) -> Pass:
        """One pass over ``inputs`` (token ids, possibly not computed yet)."""
        ckpt = Checkpoint(cache, inputs.shape[0])
        if self.capture and inputs.shape[0] > 1:
            logits, ckpt.tape = hybrid.verify_forward(self.model, inputs[None], cache)
        else:
            logits = self.model(inputs[None], cache=cache)
        hidden = self._tap.last[0] if self._tap is not None else None
        return Pass(logits[0], hidden, ckpt, inputs)

    def keep(self, p: Pass, n: int, cache: list[Any], kept: Sequence[int] | None = None) -> int:
        """Keep the first ``n`` positions of ``p``; the extra passes it took (0 or 1).
        ``kept``: those positions' token ids, if already read back."""
        if p.checkpoint.rollback(n) or n == 0:
            return 0
        ids = mx.array(list(kept)) if kept is not None else p.inputs[:n]
        self.model(ids[None], cache=cache)
        mx.eval([c.state for c in cache])
        self.replays += 1
        return 1
