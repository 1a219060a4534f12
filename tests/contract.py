"""Checking answers against the OpenAPI document (gateway.http.openapi), strictly.

The document's object schemas leave ``additionalProperties`` open, as a public contract
should (clients must tolerate new fields). A *server* test must not: an answer with a field
the document does not describe is drift. ``strict_document`` closes every object schema that
does not say otherwise, so ``check_answer`` fails on an undocumented field, a missing required
one, a wrong type or an error code outside the registry. Used by tests/unit/test_contract.py
(the real handlers, fake VMs) and tests/e2e/test_contract.py (a real daemon).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import jsonschema

from gateway.http import openapi

JSON = "application/json"
NDJSON = "application/x-ndjson"


def _close(schema: Any) -> None:
    if isinstance(schema, dict):
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        for value in schema.values():
            _close(value)
    elif isinstance(schema, list):
        for value in schema:
            _close(value)


@functools.cache
def strict_document() -> dict[str, Any]:
    doc = copy.deepcopy(openapi.build_document())
    _close(doc["components"]["schemas"])
    return doc


def _resolve(doc: dict[str, Any], obj: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in obj:
        node: Any = doc
        for part in obj["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        obj = node
    return obj


def response_content(method: str, path: str, status: int) -> dict[str, Any]:
    """The documented content of ``method path`` answering ``status`` (``path`` as in the
    document, e.g. ``/v1/sandboxes/{id}``): media type -> schema ({} for no body)."""
    doc = strict_document()
    op = doc["paths"][path][method.lower()]
    resp = op["responses"].get(str(status))
    assert resp is not None, f"{method} {path}: status {status} is not documented"
    return {media: c["schema"] for media, c in _resolve(doc, resp).get("content", {}).items()}


def validate(schema: dict[str, Any], value: Any, what: str) -> None:
    doc = strict_document()
    validator = jsonschema.Draft202012Validator({**schema, "components": doc["components"]})
    errors = sorted(validator.iter_errors(value), key=lambda e: list(e.absolute_path))
    assert not errors, f"{what}: " + "; ".join(
        f"{'/'.join(map(str, e.absolute_path)) or '<body>'}: {e.message}" for e in errors[:5])


def check_answer(method: str, path: str, status: int, body: Any,
                 media_type: str = JSON) -> None:
    """Fail (AssertionError) unless ``body`` is what the document says ``method path``
    answers with ``status``. ``body``: parsed JSON, a list of parsed NDJSON lines, or bytes."""
    content = response_content(method, path, status)
    what = f"{method} {path} {status}"
    if not content:
        assert body in (None, b"", ""), f"{what}: a body the spec does not describe"
        return
    media = media_type if media_type in content else "*/*"
    assert media in content, f"{what}: answered {media_type}, documented {sorted(content)}"
    if media == NDJSON:
        for i, line in enumerate(body):
            validate(content[media], line, f"{what} line {i}")
    elif media == JSON:
        validate(content[media], body, what)
