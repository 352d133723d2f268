"""Ghost text for ``textDocument/inlineCompletion``: which part of the buffer the model sees, the
prompt and the job, and a cache that makes typing through a suggestion free.

Editors ask on every keystroke, so a suggestion must be cheap: a bounded window around the cursor
(characters, not tokens -- counting tokens would mean tokenizing the buffer per keystroke), greedy
decoding (deterministic, so cacheable), interactive priority, and a short length.
"""

from __future__ import annotations

from collections import OrderedDict

from ..tokenizer import Tokenizer
from .app import App
from .scheduler import PRIORITY_INTERACTIVE, Job


def cursor_context(text: str, offset: int, prefix_chars: int, suffix_chars: int) -> tuple[str, str]:
    """The text before and after the cursor within the budget, cut at line boundaries so the
    model never starts mid-line."""
    start = max(0, offset - prefix_chars)
    if start > 0 and (nl := text.find("\n", start, offset)) != -1:
        start = nl + 1
    end = min(len(text), offset + suffix_chars)
    if end < len(text) and (nl := text.rfind("\n", offset, end)) != -1:
        end = nl
    return text[start:offset], text[offset:end]


class CompletionCache:
    """Recent suggestions, keyed by the text around the cursor.

    Typing the suggestion's own characters moves the cursor into it; the rest of the suggestion
    is still the model's greedy answer there, so it is served without running the model. Only a
    tail of the prefix is kept and compared, since the budget window slides as the user types.
    """

    TAIL = 512

    def __init__(self, size: int = 64):
        self.size = size
        self._entries: OrderedDict[tuple[str, str], str] = OrderedDict()
        self.hits = 0

    def lookup(self, prefix: str, suffix: str) -> str | None:
        head = suffix[: self.TAIL]
        for (tail, entry_head), text in reversed(self._entries.items()):
            if entry_head != head:
                continue
            for typed in range(len(text)) if text else (0,):
                if prefix.endswith(text[:typed]) and prefix[: len(prefix) - typed].endswith(tail):
                    self._entries.move_to_end((tail, entry_head))
                    self.hits += 1
                    return text[typed:]
        return None

    def store(self, prefix: str, suffix: str, text: str) -> None:
        self._entries[(prefix[-self.TAIL:], suffix[: self.TAIL])] = text
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)


class GhostText:
    """Suggestion jobs for one model, and the cache every connection shares."""

    def __init__(self, app: App):
        self.app = app
        self.cache = CompletionCache()
        self.fim = fim_markers(app.lm.tokenizer)

    def job(self, prefix: str, suffix: str, *, max_tokens: int, label: str) -> Job:
        """The model continues ``prefix`` (given ``suffix`` too, when it knows fill-in-the-middle).
        Mid-line a suggestion finishes the line; at a line's end it may run to a blank line.
        Raises ``EngineError`` for a prompt the engine refuses."""
        app = self.app
        if self.fim is not None:
            pre, suf, mid = self.fim
            text = f"{pre}{prefix}{suf}{suffix}{mid}"
        else:
            text = prefix
        stop = ["\n"] if suffix.split("\n", 1)[0].strip() else ["\n\n"]
        return app.job(app.text_prompt(text), app.sampling(temperature=0.0), max_tokens=max_tokens,
                       stop=stop, priority=PRIORITY_INTERACTIVE, label=label)


def fim_markers(tok: Tokenizer) -> tuple[str, str, str] | None:
    """Fill-in-the-middle markers, when the tokenizer has them as single special tokens."""
    for names in (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
                  ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")):
        ids = [tok.encode(n) for n in names]
        if all(len(i) == 1 and i[0] in tok.special_ids for i in ids):
            return names
    return None
