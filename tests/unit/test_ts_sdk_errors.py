"""The TypeScript SDK's error table (sdk/typescript/src/errors.ts, ``ERROR_CODES``) against the
server's one registry (gateway.errors.ERROR_CODES) and the Python SDK's choices, read from the
source so that it runs without node: every code the server sends is mapped, no other, and a
code the Python SDK gives its own exception gets the class of the same name in TypeScript.
(sdk/typescript/test/contract.test.ts checks the same against a live server's OpenAPI.)"""

from __future__ import annotations

import re
from pathlib import Path

from agentbox import exceptions as sdk
from gateway.errors import ERROR_CODES

ERRORS_TS = Path(__file__).resolve().parents[2] / "sdk" / "typescript" / "src" / "errors.ts"
_ROW = re.compile(r'codes\((\w+)(?: as ErrorClass)?,\s*(?:`([^`]*)`|"([^"]*)")\)')


def ts_table() -> dict[str, str]:
    """code -> TypeScript class name, from the ERROR_CODES map's ``codes(Class, "...")`` rows."""
    block = ERRORS_TS.read_text().split("export const ERROR_CODES", 1)[1].split("]);", 1)[0]
    table: dict[str, str] = {}
    for match in _ROW.finditer(block):
        for code in (match.group(2) or match.group(3)).split():
            assert code not in table, f"{code} is mapped twice in errors.ts"
            table[code] = match.group(1)
    return table


def test_the_reader_finds_the_rows():
    table = ts_table()
    assert table["sandbox_not_found"] == "SandboxNotFoundError"
    assert table["quota_exceeded"] == "QuotaExceededError"
    assert table["client_closed"] == "AgentBoxError"


def test_typescript_maps_every_server_code_and_no_other():
    table = ts_table()
    assert sorted(set(ERROR_CODES) - set(table)) == [], "codes the TypeScript SDK does not map"
    assert sorted(set(table) - set(ERROR_CODES)) == [], "codes no server sends"


def test_typescript_classes_match_the_python_sdks():
    table = ts_table()
    differ = {code: (cls.__name__, table.get(code)) for code, cls in sdk._BY_CODE.items()
              if cls.__name__ != table.get(code)}
    assert differ == {}, "code: (Python class, TypeScript class)"
