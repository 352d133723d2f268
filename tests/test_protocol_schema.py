"""The protocol's documents cannot drift from its types: ``schema.json`` must be what the Structs
generate now, and every example exchange in PROTOCOL.md must decode into them."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from warmspec_protocol import rpc as wire
from warmspec_protocol.__main__ import SCHEMA_PATH, render

PROTOCOL_MD = Path(wire.__file__).parents[1] / "PROTOCOL.md"


def test_schema_json_is_up_to_date():
    assert SCHEMA_PATH.read_text() == render(), "schema.json is stale: run `python -m warmspec_protocol`"


def test_schema_covers_every_method():
    schema = msgspec.json.decode(SCHEMA_PATH.read_bytes())
    for spec in wire.METHODS.values():
        entry = schema["x-methods"][spec.name]
        for t in (spec.params, spec.result):
            if t is not None:
                assert t.__name__ in schema["$defs"]
                assert entry["params" if t is spec.params else "result"] == {"$ref": f"#/$defs/{t.__name__}"}
    assert set(wire.LSP_REQUESTS | wire.LSP_NOTIFICATIONS) <= set(schema["x-methods"])
    assert schema["x-error-codes"]["PATH_REFUSED"] == -31002


def exchanges() -> list[list[tuple[str, dict]]]:
    blocks = re.findall(r"```\n(.*?)```", PROTOCOL_MD.read_text(), re.S)
    out = []
    for block in blocks:
        lines = [line for line in block.splitlines() if line.startswith(("--> ", "<-- "))]
        if lines:
            out.append([(line[:3], msgspec.json.decode(line[4:])) for line in lines])
    return out


def test_protocol_md_has_examples_for_every_method():
    shown = {msg["method"] for block in exchanges() for _, msg in block if "method" in msg}
    assert set(wire.METHODS) <= shown
    assert wire.LSP_REQUESTS | wire.LSP_NOTIFICATIONS <= shown


@pytest.mark.parametrize("block", exchanges(), ids=lambda b: b[0][1].get("method", "reply"))
def test_protocol_md_examples_decode_into_the_structs(block):
    codes = {int(c) for c in wire.ErrorCode}
    refused = {msg["id"] for _, msg in block if msg.get("error", {}).get("code") == wire.ErrorCode.INVALID_PARAMS}
    methods: dict = {}
    for direction, msg in block:
        env = msgspec.convert(msg, wire.Envelope)
        if env.method is not msgspec.UNSET:
            spec = wire.METHODS.get(env.method)
            assert spec is not None or env.method in wire.LSP_REQUESTS | wire.LSP_NOTIFICATIONS
            assert (direction == "<--") == bool(spec and spec.to_client), env.method
            if env.id is not msgspec.UNSET:
                methods[env.id] = env.method
            if spec is not None and env.id in refused:  # an example of a refusal
                with pytest.raises(msgspec.ValidationError):
                    msgspec.convert(env.params, spec.params)
            elif spec is not None:
                msgspec.convert({} if env.params is msgspec.UNSET else env.params, spec.params)
            elif env.method == "initialize":
                msgspec.convert(env.params, wire.InitializeParams)
            elif env.method == "$/cancelRequest":
                msgspec.convert(env.params, wire.CancelParams)
        else:
            assert direction == "<--" and env.id in methods, msg
            if env.error is not msgspec.UNSET:
                assert env.error.code in codes
            elif (spec := wire.METHODS.get(methods[env.id])) is not None:
                msgspec.convert(env.result, spec.result)


@pytest.mark.parametrize("name", ["GenerationStats", "SourceCount"])
def test_the_decode_cores_stats_and_the_wires_have_the_same_fields(name):
    """The decode core keeps its own stats types (it depends on no wire format) and the servers
    convert them field by field (``to_wire``); a field added to one only broke every HTTP reply
    with a 500 in stop 30's first CI. This says so at once, naming the field."""
    from warmspec.core import types as core
    from warmspec_protocol import types as proto

    ours, theirs = getattr(core, name), getattr(proto, name)
    assert set(ours.__struct_fields__) == set(theirs.__struct_fields__), (
        f"only in the core: {set(ours.__struct_fields__) - set(theirs.__struct_fields__)}; "
        f"only on the wire: {set(theirs.__struct_fields__) - set(ours.__struct_fields__)}")
