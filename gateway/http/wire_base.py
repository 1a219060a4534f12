"""The machinery of the gateway's wire types (``gateway.http.wire``): declaring, serializing,
parsing.

Theory of operation
-------------------
Each shape the REST API answers or accepts is a keyword-only dataclass, and it is
the only description of that shape: ``gateway.http.openapi`` generates its JSON Schema from the
class (``dataclass_schema``), the handlers build instances of it (``api.json_response``
serializes them with ``encode``), and request bodies are parsed into them by ``parse``.
A field added to a view is therefore a field of its schema; a view cannot emit a key its
type lacks.

Field metadata (``prop``) carries what the Python type does not say: a description, JSON
Schema bounds (``minimum``, ``maximum``, ``pattern``, ``maxItems``, ...), the wire name of a
field that is no identifier (``"text/plain"``, ``"from"``), and ``omit``: a field that is
*left out* when None (the schema then does not allow null), rather than sent as null.

Required or not: a field without a default is required. Response types (``@response``) keep
their schema open to new fields, as a public contract should; request types (``@request``)
are closed (``additionalProperties: false``), their non-None defaults are documented, and
``parse`` checks a body against the same types and bounds the schema shows: an unknown field
or a wrong type is a 400 (code ``bad_request`` unless the field or class names another); a
null is accepted where the type (so the schema) allows None, as "not given" unless the
handler asks ``given``. tests/unit/test_wire.py checks that parser and schema agree.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
import types
import typing
from dataclasses import MISSING, dataclass
from typing import Any, Literal

import orjson

from gateway.errors import BadRequest

# -- the machinery ---------------------------------------------------------------------------

RESPONSE, REQUEST = "response", "request"
T = typing.TypeVar("T")


def _wire(kind: str, description: str | None, extra: bool | None, code: str | None,
          ) -> typing.Callable[[type[T]], type[T]]:
    def wrap(cls: type[T]) -> type[T]:
        # Not frozen: a frozen dataclass's __init__ sets each field through
        # object.__setattr__, 4-7x slower, and a page of sandboxes is 1000 views.
        cls = dataclass(kw_only=True)(cls)
        cls.__wire__ = {"kind": kind, "description": description,  # type: ignore[attr-defined]
                        "extra": extra, "code": code}
        return cls
    return wrap


def response(cls: type[T] | None = None, *, description: str | None = None,
             extra: bool | None = None) -> Any:
    """A response type. ``extra``: True = the schema says more fields may come, False =
    it says none will (``additionalProperties``); None: unsaid (open)."""
    w = _wire(RESPONSE, description, extra, None)
    return w(cls) if cls is not None else w


def request(cls: type[T] | None = None, *, description: str | None = None,
            code: str | None = None) -> Any:
    """A request body type (closed); ``code``: the error code of its 400s."""
    w = _wire(REQUEST, description, False, code)
    return w(cls) if cls is not None else w


def prop(default: Any = MISSING, *, factory: Any = MISSING, description: str | None = None,
         omit: bool = False,
         name: str | None = None, schema: dict[str, Any] | None = None,
         code: str | None = None, message: str | None = None, required_code: str | None = None,
         range_code: str | None = None, **bounds: Any) -> Any:
    """A field with its wire metadata (``factory``: makes a default that is an object).
    ``schema`` replaces the generated schema; ``bounds``
    (minimum, maximum, minLength, maxLength, pattern, maxItems, items) are added to it;
    ``code``/``message``: the 400 a bad value of it gets (message: what it must be);
    ``required_code``: the code when it is missing, ``range_code`` when it is outside its
    minimum/maximum (default: ``code``)."""
    meta = {"description": description, "omit": omit, "name": name, "schema": schema,
            "code": code, "message": message, "bounds": bounds, "required_code": required_code,
            "range_code": range_code}
    if omit and default is MISSING:
        default = None
    if factory is not MISSING:
        return dataclasses.field(default_factory=factory, metadata={"wire": meta})
    return dataclasses.field(default=default, metadata={"wire": meta})


def meta(f: dataclasses.Field[Any]) -> dict[str, Any]:
    return f.metadata.get("wire") or {"description": None, "omit": False, "name": None,
                                      "schema": None, "code": None, "message": None,
                                      "bounds": {}, "required_code": None, "range_code": None}


def is_wire(cls: Any) -> bool:
    return isinstance(cls, type) and hasattr(cls, "__wire__")


@dataclass(frozen=True)
class _Field:
    attr: str
    wire: str
    omit: bool
    hint: Any
    meta: dict[str, Any]
    required: bool
    default: Any


@functools.cache
def fields(cls: type) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        m = meta(f)
        has_default = f.default is not MISSING or f.default_factory is not MISSING
        default = f.default if f.default is not MISSING else None
        out.append(_Field(f.name, m["name"] or f.name, m["omit"], hints[f.name], m,
                          not has_default, default))
    return tuple(out)


def without_none(tp: Any) -> Any:
    """``X | None`` -> ``X`` (a union of several stays a union)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else typing.Union[tuple(args)]  # noqa: UP007
    return tp


# -- serializing -----------------------------------------------------------------------------

def encode(value: Any) -> Any:
    """A wire (or protocol) dataclass as JSON-ready data: omitted fields left out."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for f in fields(type(value)):
            item = getattr(value, f.attr)
            if item is None and f.omit:
                continue
            out[f.wire] = encode(item)
        return out
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {k: encode(v) for k, v in value.items()}
    if isinstance(value, enum.Enum):
        return value.value
    return value


def dumps(value: Any) -> bytes:
    """``value`` as JSON bytes, as ``encode`` would make it (orjson walks the lists, dicts and
    enums; each dataclass becomes a dict in ``_as_dict``)."""
    return orjson.dumps(value, default=_as_dict, option=orjson.OPT_PASSTHROUGH_DATACLASS)


def _as_dict(value: Any) -> dict[str, Any]:
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        raise TypeError(f"cannot serialize {type(value).__name__}")
    return {w: v for a, w, omit in _plan(type(value))
            if (v := getattr(value, a)) is not None or not omit}


@functools.cache
def _plan(cls: type) -> tuple[tuple[str, str, bool], ...]:
    return tuple((f.attr, f.wire, f.omit) for f in fields(cls))


# -- parsing ---------------------------------------------------------------------------------

_KINDS = {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}


class _Bad(Exception):
    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.code = message, code


class _OutOfRange(_Bad):
    """The right type, outside its minimum/maximum."""


def parse(cls: type[T], body: Any) -> T:
    """``body`` (parsed JSON) as an instance of the request type ``cls``, or 400. A field
    given as null is None where its type allows None; ``given`` tells which were given."""
    try:
        return _object(cls, body, "")
    except _Bad as exc:
        raise BadRequest(exc.message, code=exc.code or "bad_request") from None


def given(obj: Any) -> frozenset[str]:
    """The wire names of the fields a parsed request body had (null ones too)."""
    return getattr(obj, "_wire_given", frozenset())


def _nullable(tp: Any) -> bool:
    return tp is Any or (typing.get_origin(tp) in (typing.Union, types.UnionType)
                         and type(None) in typing.get_args(tp))


def _object(cls: Any, body: Any, where: str) -> Any:
    code = cls.__wire__["code"]
    if not isinstance(body, dict):
        raise _Bad(f"'{where}' must be a JSON object" if where
                   else "request body must be a JSON object", code)
    known = {f.wire: f for f in fields(cls)}
    unknown = set(body) - set(known)
    if unknown:
        prefix = f"{where}: " if where else ""
        raise _Bad(f"{prefix}unknown field(s): {', '.join(sorted(unknown))[:200]}",
                   code or "bad_request")
    values = {}
    for f in known.values():
        path = f"{where}.{f.wire}" if where else f.wire
        if f.wire not in body:
            if f.required:
                raise _Bad(f"'{path}' is required",
                           f.meta.get("required_code") or f.meta["code"] or code)
            continue
        value = body[f.wire]
        if value is None and _nullable(f.hint) and not f.omit:
            values[f.attr] = None
            continue
        try:
            values[f.attr] = _value(without_none(f.hint), value, path, f.meta)
        except _Bad as exc:
            raise _Bad(exc.message, exc.code or f.meta["code"] or code) from None
    out = cls(**values)
    object.__setattr__(out, "_wire_given", frozenset(body))
    return out


def _value(tp: Any, value: Any, where: str, m: dict[str, Any]) -> Any:
    what = m.get("message")
    try:
        return _checked(tp, value, where, m.get("bounds") or {})
    except _OutOfRange as exc:
        if m.get("range_code"):
            raise _Bad(exc.message, m["range_code"]) from None
        if what and not exc.code:
            raise _Bad(f"'{where}' must be {what}") from None
        raise
    except _Bad as exc:
        if what and not exc.code:
            raise _Bad(f"'{where}' must be {what}") from None
        raise


def _checked(tp: Any, value: Any, where: str, bounds: dict[str, Any]) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if is_wire(tp):
        return _object(tp, value, where)
    if origin is Literal:
        if value not in args:
            raise _Bad(f"'{where}' must be one of {', '.join(map(repr, args))}")
        return value
    if origin in (typing.Union, types.UnionType):
        return _union(args, value, where, bounds)
    if origin is list:
        if not isinstance(value, list):
            raise _Bad(f"'{where}' must be a list")
        if "maxItems" in bounds and len(value) > bounds["maxItems"]:
            raise _Bad(f"'{where}' holds at most {bounds['maxItems']} items")
        item_bounds = bounds.get("items", {})
        return [_checked(args[0], v, f"{where}[{i}]", item_bounds) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _Bad(f"'{where}' must be a JSON object")
        return value
    return _scalar(tp, value, where, bounds)


def _union(args: tuple[Any, ...], value: Any, where: str, bounds: dict[str, Any]) -> Any:
    options = [a for a in args if a is not type(None)]
    errors = []
    for option in options:
        try:
            return _checked(option, value, where, bounds)
        except _Bad as exc:
            errors.append(exc)
    # The option of the value's own JSON kind says best what is wrong with it.
    for option, exc in zip(options, errors, strict=True):
        if (is_wire(option) or typing.get_origin(option) is dict) == isinstance(value, dict):
            raise exc
    raise errors[-1]


def _scalar(tp: Any, value: Any, where: str, bounds: dict[str, Any]) -> Any:
    ok = {str: isinstance(value, str), bool: isinstance(value, bool),
          int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool)}.get(tp)
    if ok is None:
        raise TypeError(f"cannot parse {tp!r}")
    lo, hi = bounds.get("minimum"), bounds.get("maximum")
    if not ok:
        raise _Bad(f"'{where}' must be {_KINDS[tp]}{_range(lo, hi)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise _OutOfRange(f"'{where}' must be {_KINDS[tp]}{_range(lo, hi)}")
    if tp is str and len(value) < bounds.get("minLength", 0):
        raise _Bad(f"'{where}' must be a non-empty string")
    if tp is str and "maxLength" in bounds and len(value) > bounds["maxLength"]:
        raise _Bad(f"'{where}' must be at most {bounds['maxLength']} characters")
    if tp is str and "pattern" in bounds and not re.search(bounds["pattern"], value):
        raise _Bad(f"'{where}' must match {bounds['pattern']}")
    return float(value) if tp is float else value


def _range(lo: Any, hi: Any) -> str:
    if lo is not None and hi is not None:
        return f" from {lo:g} to {hi:g}"
    if lo is not None:
        return f" >= {lo:g}"
    return f" <= {hi:g}" if hi is not None else ""
