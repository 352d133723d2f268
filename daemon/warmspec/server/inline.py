"""Ghost text for ``textDocument/inlineCompletion``: which part of the buffer the model sees, the
prompt and the job, and a cache that makes typing through a suggestion free.

Editors ask on every keystroke, so a suggestion must be cheap: a bounded window around the cursor
(characters, not tokens -- counting tokens would mean tokenizing the buffer per keystroke), greedy
decoding (deterministic, so cacheable), interactive priority, and a short length.
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from warmspec_protocol.rpc import InlineCompletionSettings

from ..tokenizer import Tokenizer
from .app import App
from .scheduler import PRIORITY_INTERACTIVE, Job


# Where a window cut from a long document starts moves in steps of prefix_chars / 8 (512 of the
# default 4096 characters), not with every line typed. The prompt then keeps its beginning -- and
# the engine its cached prefill -- while the cursor moves on: with a start one line behind the
# cursor's budget, every line typed in a file longer than the window changed the prompt's first
# tokens and cost a prefill of the whole window (~1000 tokens of the default model).
ANCHOR_STEPS = 8


def cursor_context(text: str, offset: int, prefix_chars: int, suffix_chars: int) -> tuple[str, str]:
    """The text before and after the cursor within the budget, cut at line boundaries so the
    model never starts mid-line. The start moves in steps (``ANCHOR_STEPS``), so the window holds
    between 7/8 of ``prefix_chars`` and all of it."""
    step = max(1, prefix_chars // ANCHOR_STEPS)
    start = max(0, -(-(offset - prefix_chars) // step) * step)
    if start > 0 and (nl := text.find("\n", start, offset)) != -1:
        start = nl + 1
    end = min(len(text), offset + suffix_chars)
    if end < len(text) and (nl := text.rfind("\n", offset, end)) != -1:
        end = nl
    return text[start:offset], text[offset:end]


class Window(msgspec.Struct, frozen=True):
    """Everything one suggestion's job depends on: the document, the exact text before and after
    the cursor that goes into the prompt, and the settings that shape the job. Two requests with
    equal windows get the same greedy answer, so the window is the cache's key."""

    uri: str
    prefix: str
    suffix: str
    model: str
    max_tokens: int
    stop: tuple[str, ...]

    def same_job_but_prefix(self, other: "Window") -> bool:
        return (self.uri, self.suffix, self.model, self.max_tokens, self.stop) == (
            other.uri, other.suffix, other.model, other.max_tokens, other.stop)


class CompletionCache:
    """Recent suggestions, keyed by their whole ``Window``.

    Typing the suggestion's own characters moves the cursor into it; the rest of the suggestion
    is still the model's greedy answer there, so it is served without running the model: a
    window whose prefix is a cached window's prefix plus the start of its suggestion (same
    document, suffix and settings) is a hit. Any other difference in what the prompt holds -- an
    edit anywhere in the window, another document -- is a miss. (The key used to be the last 512
    characters of the prefix and the first 512 of the suffix, while the prompt holds 4096 and
    1024: an edit further up, or another file ending the same way, got a stale or foreign answer.)
    """

    def __init__(self, size: int = 64):
        self.size = size
        self._entries: OrderedDict[Window, str] = OrderedDict()
        self.hits = 0

    def lookup(self, want: Window) -> str | None:
        for window, text in reversed(self._entries.items()):
            if not window.same_job_but_prefix(want) or not want.prefix.startswith(window.prefix):
                continue
            typed = len(want.prefix) - len(window.prefix)
            if (typed < len(text) or typed == 0) and text.startswith(want.prefix[len(window.prefix):]):
                self._entries.move_to_end(window)
                self.hits += 1
                return text[typed:]
        return None

    def store(self, window: Window, text: str) -> None:
        self._entries[window] = text
        self._entries.move_to_end(window)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)


class GhostText:
    """Suggestion jobs for one model, and the cache every connection shares."""

    def __init__(self, app: App):
        self.app = app
        self.cache = CompletionCache()
        self.fim = fim_markers(app.lm.tokenizer)

    def window(self, uri: str, source: str, offset: int, settings: InlineCompletionSettings,
               max_tokens: int | None = None) -> Window:
        """The window at ``offset`` of document ``uri``, for a suggestion of ``max_tokens`` (the
        settings' when None). Mid-line a suggestion finishes the line; at a line's end it may run
        to a blank line."""
        prefix, suffix = cursor_context(source, offset, settings.prefix_chars, settings.suffix_chars)
        stop = ("\n",) if suffix.split("\n", 1)[0].strip() else ("\n\n",)
        return Window(uri=uri, prefix=prefix, suffix=suffix, model=self.app.lm.name,
                      max_tokens=max_tokens or settings.max_tokens, stop=stop)

    def prompt_text(self, w: Window) -> str:
        """The model continues the prefix (given the suffix too, when it knows fill-in-the-middle)."""
        if self.fim is None:
            return w.prefix
        pre, suf, mid = self.fim
        return f"{pre}{w.prefix}{suf}{w.suffix}{mid}"

    def job(self, w: Window, *, label: str, temperature: float = 0.0, seed: int | None = None) -> Job:
        """The job for ``w``: greedy (cacheable), or sampled at ``temperature`` with ``seed`` for
        alternatives. Tokenizes the window: call it off the event loop. Raises ``EngineError`` for a
        prompt the engine refuses."""
        app = self.app
        params = app.sampling(temperature=temperature, seed=seed) if temperature else app.sampling(temperature=0.0)
        return app.job(app.text_prompt(self.prompt_text(w)), params,
                       max_tokens=w.max_tokens, stop=list(w.stop), priority=PRIORITY_INTERACTIVE, label=label)


def fim_markers(tok: Tokenizer) -> tuple[str, str, str] | None:
    """Fill-in-the-middle markers, when the tokenizer has them as single special tokens."""
    for names in (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
                  ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")):
        ids = [tok.encode(n) for n in names]
        if all(len(i) == 1 and i[0] in tok.special_ids for i in ids):
            return names
    return None
