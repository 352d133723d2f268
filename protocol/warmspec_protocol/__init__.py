"""Wire types of warmspec: the single source of truth for every message in and out.

Every request, notification, result and error that crosses a transport is one of these msgspec
Structs; the JSON Schema in ``schema.json`` is generated from them (``python -m warmspec_protocol``)
and ``PROTOCOL.md`` describes the methods in prose.
"""

from __future__ import annotations

from .types import *  # noqa: F401,F403
from .types import __all__  # noqa: F401
