"""Tool calls: what a model's chat template does with ``tools``, and the calls in its output.

Templates decide whether a model learns about tools at all (SmolLM2's ignores them), so support is
found by rendering a probe tool rather than assumed from the model's name. Hermes/Qwen-style
``<tool_call>{json}</tool_call>`` blocks are parsed back into calls, as the text streams.
"""

from __future__ import annotations

import re
import secrets
from typing import Any, Literal

import msgspec

from ..tokenizer import Tokenizer, TokenizerError

_encode = msgspec.json.encode

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_BLOCK = re.compile(r"\s*<tool_call>\s*(.*?)\s*</tool_call>\s*", re.S)
_PROBE_TOOL = "warmspec_probe_tool"


class HermesCall(msgspec.Struct):
    """The JSON a Hermes/Qwen-style model writes inside ``<tool_call>`` ... ``</tool_call>``."""

    name: str
    arguments: dict[str, Any] = {}


class ParsedCall(msgspec.Struct, kw_only=True):
    id: str
    name: str
    arguments: str  # JSON text


def tool_format(tokenizer: Tokenizer) -> Literal["hermes", "unparsed", "none"]:
    """What the model's chat template does with ``tools``, found by rendering a probe tool.

    "none": the template ignores tools (SmolLM2's), so the model never learns they exist.
    "unparsed": it renders them, but asks for a call format other than ``<tool_call>`` blocks.
    "hermes": it asks for ``<tool_call>{json}</tool_call>`` (Hermes, Qwen2.5, Qwen3), which
    ``ToolCallSplitter`` parses into tool calls.
    """
    probe = [{"type": "function", "function": {"name": _PROBE_TOOL, "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}]
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=probe)
    except TokenizerError:
        return "none"
    if _PROBE_TOOL not in rendered:
        return "none"
    return "hermes" if TOOL_OPEN in rendered else "unparsed"


def parse_tool_calls(text: str) -> list[ParsedCall] | None:
    """The calls in ``text`` if it is nothing but well-formed ``<tool_call>`` blocks, else None."""
    calls: list[ParsedCall] = []
    pos = 0
    while pos < len(text):
        m = _TOOL_BLOCK.match(text, pos)
        if m is None:
            return None
        try:
            call = msgspec.json.decode(m.group(1), type=HermesCall)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        calls.append(ParsedCall(id=f"call_{secrets.token_hex(12)}", name=call.name,
                                arguments=_encode(call.arguments).decode()))
        pos = m.end()
    return calls or None


class ToolCallSplitter:
    """Separates tool-call blocks from the text a model writes, as it streams.

    Text before the first ``<tool_call>`` streams as usual (a tail that could be the start of the
    tag is held back until it cannot be); from the tag on, everything is held and parsed when the
    generation ends. Held text that is not a clean sequence of calls is returned as text, so the
    model's output is never dropped.
    """

    def __init__(self) -> None:
        self._pending = ""
        self._held: str | None = None

    def feed(self, text: str) -> str:
        if self._held is not None:
            self._held += text
            return ""
        buf = self._pending + text
        i = buf.find(TOOL_OPEN)
        if i >= 0:
            self._held, self._pending = buf[i:], ""
            return buf[:i]
        keep = next((n for n in range(min(len(TOOL_OPEN) - 1, len(buf)), 0, -1)
                     if buf.endswith(TOOL_OPEN[:n])), 0)
        self._pending = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """The text still to emit and the parsed calls."""
        if self._held is None:
            tail, self._pending = self._pending, ""
            return tail, []
        calls = parse_tool_calls(self._held)
        return ("", calls) if calls else (self._held, [])
