"""The gateway's wire types (gateway.http.wire) against the schemas generated from them.

1. Every view type, built with every optional field set (and with only the required ones),
   encodes to exactly its schema's keys and validates against the strict document
   (tests/contract.py: an undocumented key, a missing required one or a wrong type fails).
2. Request bodies: ``wire.parse`` and the schema agree, field by field, on what is valid
   (a wrong type, a value out of bounds, an unknown field, null), and keep the error codes
   the API documents.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import typing
from typing import Any

import jsonschema
import pytest

from gateway.http import openapi, wire, wire_base
from gateway.errors import ERROR_CODES, BadRequest
from tests.contract import strict_document, validate

RESPONSES = [c for c in wire.SCHEMAS if c.__wire__["kind"] == wire_base.RESPONSE]
REQUESTS = [c for c in wire.SCHEMAS if c.__wire__["kind"] == wire_base.REQUEST]


def _schemas() -> dict[str, Any]:
    return openapi.build_document()["components"]["schemas"]


def sample(tp: Any, field: wire_base._Field | None = None, full: bool = True) -> Any:
    """A valid value of ``tp`` (a wire type: every field set if ``full``)."""
    if field is not None and field.meta["schema"] == wire.ERROR_CODE_REF:
        return sorted(ERROR_CODES)[0]
    tp = wire_base.without_none(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, full)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return next(iter(tp))
    if origin is typing.Literal:
        return args[0]
    if origin in (typing.Union, typing.types.UnionType):  # type: ignore[attr-defined]
        return sample(args[-1], None, full)
    if origin is list:
        return [sample(args[0], None, full)]
    if origin is dict or tp is Any:
        return {"k": "v"}
    minimum = (field.meta["bounds"].get("minimum") if field else None) or 1
    return {str: "s", int: int(minimum), float: float(minimum) + 0.5, bool: True}[tp]


def build(cls: Any, full: bool = True) -> Any:
    """An instance of ``cls``: every field set (``full``), or only the required ones."""
    if not wire_base.is_wire(cls):  # a guest.protocol dataclass
        hints = typing.get_type_hints(cls)
        return cls(**{f.name: sample(hints[f.name]) for f in dataclasses.fields(cls)})
    return cls(**{f.attr: sample(f.hint, f, full) for f in wire_base.fields(cls)
                  if full or f.required})


@pytest.mark.parametrize("cls", RESPONSES, ids=lambda c: c.__name__)
def test_a_view_emits_exactly_its_schemas_keys(cls):
    schema = _schemas()[cls.__name__]
    full = wire.encode(build(cls))
    assert set(full) == set(schema["properties"]), f"{cls.__name__}: view and schema differ"
    validate({"$ref": f"#/components/schemas/{cls.__name__}"}, full, cls.__name__)
    minimal = wire.encode(build(cls, full=False))
    omitted = {f.wire for f in wire_base.fields(cls) if f.omit}
    assert set(minimal) == set(schema["properties"]) - omitted
    assert set(schema.get("required", [])) <= set(minimal)
    validate({"$ref": f"#/components/schemas/{cls.__name__}"}, minimal, cls.__name__)


def test_a_view_with_a_key_its_schema_lacks_fails():
    """The check above can fail: one more key in a Sandbox answer is caught."""
    body = wire.encode(build(wire.Sandbox)) | {"colour": "red"}
    with pytest.raises(AssertionError, match="colour"):
        validate({"$ref": "#/components/schemas/Sandbox"}, body, "Sandbox")


def test_every_wire_type_is_in_the_document():
    declared = {c for _, c in inspect.getmembers(wire, inspect.isclass) if wire_base.is_wire(c)}
    assert declared == set(wire.SCHEMAS)
    assert set(c.__name__ for c in declared) <= set(_schemas())


def test_omitted_fields_are_left_out_and_nulls_kept():
    assert wire.encode(wire.Egress(source="host")) == {"source": "host"}
    sb = wire.encode(build(wire.Sandbox, full=False))
    assert "preview_token" not in sb and sb["idle_timeout"] is None
    assert wire.encode(wire.SandboxEvent(at=1.0, to="running", event="x"))["from"] is None


# -- requests ---------------------------------------------------------------------------------

def _agree(cls: Any, body: Any) -> bool:
    """True if both the schema and the parser accept ``body``; fails if they disagree."""
    doc = strict_document()
    schema = {"$ref": f"#/components/schemas/{cls.__name__}", "components": doc["components"]}
    by_schema = jsonschema.Draft202012Validator(schema).is_valid(body)
    try:
        wire.parse(cls, body)
        by_parser = True
    except BadRequest:
        by_parser = False
    assert by_schema == by_parser, f"{cls.__name__} {body!r}: schema says {by_schema}, " \
                                   f"parser says {by_parser}"
    return by_parser


_WRONG = ["s", 1, 1.5, True, [], {}, ["s"], [1], {"k": 1}, -1, 0, 10**12, "", 8, 9]


@pytest.mark.parametrize("cls", REQUESTS, ids=lambda c: c.__name__)
def test_parser_and_schema_agree_on_every_field(cls):
    base = wire.encode(build(cls, full=False))
    assert _agree(cls, base) and _agree(cls, wire.encode(build(cls)))
    assert not _agree(cls, base | {"x_unknown": 1})
    assert not _agree(cls, [base])
    for f in wire_base.fields(cls):
        for value in _WRONG:
            _agree(cls, base | {f.wire: value})


def test_null_means_not_given_where_the_schema_allows_it():
    assert wire.parse(wire.KeyLimitsUpdate, {"rate": None}) == wire.KeyLimitsUpdate()
    assert _agree(wire.KeyLimitsUpdate, {"rate": None})


@pytest.mark.parametrize(("body", "code", "message"), [
    ({"colour": 1}, "bad_request", "unknown field"),
    ({"template": ""}, "bad_request", "'template' must be a non-empty string"),
    ({"idle_timeout": -1}, "bad_request", "'idle_timeout' must be a number of seconds >= 0"),
    ({"ttl": "1"}, "bad_request", "'ttl' must be a number of seconds from 0"),
    ({"vcpus": "2"}, "invalid_type", "'vcpus' must be an integer"),
    ({"vcpus": True}, "invalid_type", "'vcpus' must be an integer"),
    ({"egress": "deny"}, "invalid_egress", "egress"),
    ({"egress": {"nope": []}}, "invalid_egress", "unknown field"),
    ({"egress": {"allow": "10.0.0.0/8"}}, "invalid_egress", "must be a list"),
    ({"metadata": [1]}, "bad_request", "'metadata' must be a JSON object"),
])
def test_create_refusals_keep_their_codes(body, code, message):
    with pytest.raises(BadRequest, match=message) as info:
        wire.parse(wire.CreateSandboxRequest, body)
    assert info.value.code == code


def test_a_create_parses_into_its_type():
    req = wire.parse(wire.CreateSandboxRequest, {
        "template": "python", "ttl": 60, "vcpus": 2, "egress": {"allow": ["1.1.1.1"]},
        "metadata": {"a": 1}, "idle_timeout": None})
    assert req.ttl == 60.0 and isinstance(req.ttl, float) and req.vcpus == 2
    assert req.egress == wire.EgressRules(allow=["1.1.1.1"]) and req.idle_timeout is None
    assert wire.parse(wire.CreateSandboxRequest, {"egress": "deny_all"}).egress == "deny_all"
    with pytest.raises(BadRequest, match="request body must be a JSON object"):
        wire.parse(wire.UpdateSandboxRequest, [])


@pytest.mark.parametrize(("cls", "body", "code"), [
    (wire.CreateKeyRequest, {"name": "k", "admin": None}, "invalid_type"),
    (wire.CreateKeyRequest, {"name": "k", "admin": "false"}, "invalid_type"),
    (wire.CreateKeyRequest, {"name": "   "}, "invalid_type"),
    (wire.CreateKeyRequest, {"name": "k" * 201}, "invalid_type"),
    (wire.CreateKeyRequest, {}, "bad_request"),
    (wire.CreateKeyRequest, {"name": "k", "limits": None}, "invalid_type"),
    (wire.CreateKeyRequest, {"name": "k", "limits": {"burst": 0}}, "invalid_type"),
    (wire.CreateKeyRequest, {"name": "k", "limits": {"nope": 1}}, "bad_request"),
    (wire.UpdateKeyRequest, {"limits": {"rate": "fast"}}, "invalid_type"),
    (wire.SnapshotRequest, {}, "bad_template_name"),
    (wire.SnapshotRequest, {"template": "Bad Name"}, "bad_template_name"),
    (wire.SnapshotRequest, {"template": "x", "y": 1}, "bad_request"),
    (wire.ForkRequest, {"count": True}, "bad_request"),
    (wire.SessionSpec, {"port": None}, "bad_request"),
    (wire.SessionSpec, {"start": "  "}, "bad_request"),
    (wire.UpdateSandboxRequest, {"public_ports": [0]}, "bad_request"),
    (wire.UpdateSandboxRequest, {"egress": None}, "invalid_egress"),
])
def test_other_refusals_keep_their_codes(cls, body, code):
    with pytest.raises(BadRequest) as info:
        wire.parse(cls, body)
    assert info.value.code == code


def test_given_tells_null_from_absent():
    req = wire.parse(wire.UpdateKeyRequest, {"limits": {"rate": None, "burst": 5}})
    assert wire_base.given(req.limits) == {"rate", "burst"} and req.limits.rate is None
    assert wire_base.given(wire.parse(wire.UpdateKeyRequest, {})) == frozenset()


def test_type_schema_of_enums_and_literals():
    from typing import Literal

    from gateway.sandbox.states import State

    assert openapi.type_schema(State)["enum"][0] == next(iter(State)).value
    assert openapi.type_schema(Literal["a", "b"] | None) == {
        "type": ["string", "null"], "enum": ["a", "b", None]}
    assert openapi.type_schema(wire.Egress) == {"$ref": "#/components/schemas/Egress"}
