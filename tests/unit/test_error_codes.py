"""One registry of error codes (gateway.errors.ERROR_CODES): it holds every code literal the
server's packages can put into an error answer and no other, the OpenAPI document exports it,
and the SDK (agentbox.exceptions) decides on each code and on no code the server never sends."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from agentbox import exceptions as sdk
from gateway.http import openapi
from gateway.errors import ERROR_CODES

REPO = Path(__file__).resolve().parents[2]
# error_body(code, message), error_response(status, code, ...), error_page(request, status, code)
_CODE_ARG = {"error_body": 0, "error_response": 1, "error_page": 2}


def _strings(node: ast.AST) -> list[str]:
    """The string constants a code expression can evaluate to (f-strings, comparisons and
    subscripts are not codes)."""
    if isinstance(node, ast.Constant):
        return [node.value] if isinstance(node.value, str) else []
    if isinstance(node, ast.IfExp):
        return _strings(node.body) + _strings(node.orelse)
    if isinstance(node, ast.Dict):
        return [s for v in node.values for s in _strings(v)]
    if isinstance(node, ast.Call):  # {...}.get(status, "default") / TABLE.get(...)
        return [s for a in [node.func, *node.args] for s in _strings(a)]
    if isinstance(node, ast.Attribute):
        return _strings(node.value)
    return []


def _codes_in(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and (target.id == "code"
                                                     or target.id.endswith("_CODES")):
                    found.update(_strings(node.value))
                elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    found.update(s for t, v in zip(target.elts, node.value.elts, strict=False)
                                 if isinstance(t, ast.Name) and t.id == "code"
                                 for s in _strings(v))
        elif isinstance(node, ast.keyword) and node.arg == "code":
            found.update(_strings(node.value))
        elif isinstance(node, ast.Call):
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            if name in _CODE_ARG and len(node.args) > _CODE_ARG[name]:
                found.update(_strings(node.args[_CODE_ARG[name]]))
    return found


def server_code_literals() -> set[str]:
    codes: set[str] = set()
    for package in ("gateway", "vmctl", "guest"):
        for path in (REPO / package).rglob("*.py"):
            if path.name == "errors.py" and package == "gateway":
                # the registry itself is a dict named ERROR_CODES: take only the classes' codes
                tree = ast.parse(path.read_text())
                tree.body = [n for n in tree.body if isinstance(n, ast.ClassDef)]
            else:
                tree = ast.parse(path.read_text(), str(path))
            codes |= _codes_in(tree)
    return codes


def test_the_scanner_finds_codes_in_each_form():
    tree = ast.parse('class E:\n    code = "a"\n'
                     'raise X("m", code="b" if y else "c")\n'
                     'code, message = "d", f"no {x}"\n'
                     '_CODES = {1: "e"}\n'
                     'code = {404: "f"}.get(s, "g")\n'
                     'error_response(500, "h", "not a code")\n'
                     'code = str(err["code"])\n')
    assert _codes_in(tree) == set("abcdefgh")


def test_registry_holds_every_code_the_server_sends_and_no_other():
    literals = server_code_literals()
    assert not literals - set(ERROR_CODES), "add to gateway.errors.ERROR_CODES"
    assert not set(ERROR_CODES) - literals, "no server code raises these: remove them"


def test_openapi_exports_the_registry():
    schemas = openapi.build_document()["components"]["schemas"]
    assert schemas["ErrorCode"]["enum"] == sorted(ERROR_CODES)
    assert schemas["Error"]["properties"]["error"] == {
        "$ref": "#/components/schemas/ErrorDetail"}
    assert schemas["ErrorDetail"]["properties"]["code"] == {
        "$ref": "#/components/schemas/ErrorCode"}


def test_sdk_decides_on_every_server_code_and_on_no_other():
    by_code, by_status = set(sdk._BY_CODE), set(sdk._BY_STATUS_CODES)
    assert not by_code & by_status, "a code is in both SDK tables"
    assert not (by_code | by_status) - set(ERROR_CODES), "the SDK maps codes no server sends"
    assert not set(ERROR_CODES) - (by_code | by_status), "the SDK does not map these codes"


def test_each_code_maps_to_a_specific_sdk_exception():
    for code in ERROR_CODES:
        cls = sdk.error_class(404 if code in sdk._BY_CODE else 400, code)
        assert issubclass(cls, sdk.AgentBoxError) and cls is not sdk.AgentBoxError
    assert sdk.error_class(404, "sandbox_not_found") is sdk.SandboxNotFoundError
    assert sdk.error_class(503, "sandbox_limit") is sdk.UnavailableError  # by status
    assert sdk.from_response(409, {"error": {"code": "port_closed", "message": "m"}}).code \
        == "port_closed"  # the code is kept whatever the class


def test_docs_error_table_lists_every_code_and_no_other():
    text = (REPO / "docs" / "api.md").read_text()
    table = text[text.index("## Error codes"):].split("\n\n")[1]
    documented = {code for row in table.splitlines()[2:]
                  for code in re.findall(r"`([a-z][a-z_]*)`", row.split("|")[2])}
    assert documented == set(ERROR_CODES), (sorted(documented - set(ERROR_CODES)),
                                            sorted(set(ERROR_CODES) - documented))
