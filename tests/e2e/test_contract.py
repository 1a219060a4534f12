"""Every operation of a real daemon (real VMs) answers what the OpenAPI document says, strictly
(tests/contract.py: an undocumented field, a missing required one or an unregistered error
code fails). The gateway-only operations are also checked without VMs, in
tests/unit/test_contract.py; here are the ones the guest agent answers."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.contract import NDJSON, check_answer

pytestmark = pytest.mark.e2e
SB = "/v1/sandboxes/{id}"


def call(api: httpx.Client, method: str, spec_path: str, status: int, url: str | None = None,
         **kwargs: Any) -> Any:
    resp = api.request(method, url or spec_path, **kwargs)
    media = resp.headers.get("content-type", "").split(";")[0]
    if media == "application/json":
        body: Any = resp.json()
    elif media == NDJSON:
        body = [json.loads(line) for line in resp.text.splitlines() if line.strip()]
    else:
        body = resp.content
    assert resp.status_code == status, (method, url or spec_path, resp.status_code, body)
    check_answer(method, spec_path, status, body, media)
    return body


def test_every_guest_backed_operation_answers_what_the_spec_says(api):
    call(api, "GET", "/healthz", 200)
    call(api, "GET", "/v1/info", 200)
    call(api, "GET", "/v1/templates", 200)
    sb = call(api, "POST", "/v1/sandboxes", 201, json={"template": "python"})
    p = f"/v1/sandboxes/{sb['id']}"
    try:
        _files_and_execute(api, p)
        _interpreter(api, p)
        _commands(api, p)
        call(api, "GET", SB + "/preview", 200, p + "/preview")
        call(api, "PATCH", SB + "/preview", 200, p + "/preview", json={"public_ports": [8000]})
        call(api, "POST", SB + "/preview-token", 200, p + "/preview-token")
        _controls(api, p, sb["id"])
        call(api, "POST", SB + "/suspend", 200, p + "/suspend")
        call(api, "POST", SB + "/resume", 200, p + "/resume")
        call(api, "GET", SB, 200, p)
    finally:
        call(api, "DELETE", SB, 204, p)
    call(api, "POST", SB + "/execute", 404, p + "/execute", json={"command": "true"})


def _controls(api: httpx.Client, p: str, sid: str) -> None:
    """Lifetimes, listing, usage, metrics and logs (issue 13) with a real VM behind them."""
    call(api, "PATCH", SB, 200, p, json={"ttl": 3600, "auto_delete_after": 3600})
    page = call(api, "GET", "/v1/sandboxes", 200, "/v1/sandboxes",
                params={"state": "running", "template": "python", "limit": 1000})
    assert sid in [s["id"] for s in page["sandboxes"]]
    call(api, "GET", "/v1/sandboxes", 400, "/v1/sandboxes", params={"cursor": "x"})
    call(api, "GET", SB + "/metrics", 200, p + "/metrics")
    call(api, "GET", SB + "/logs", 200, p + "/logs", params={"tail": 20})
    call(api, "GET", "/v1/usage", 200, "/v1/usage", params={"key": "*"})


def _files_and_execute(api: httpx.Client, p: str) -> None:
    call(api, "POST", SB + "/execute", 200, p + "/execute", json={"command": "echo hi"})
    call(api, "POST", SB + "/execute", 200, p + "/execute", json={"code": "print(1)"})
    call(api, "POST", SB + "/execute", 400, p + "/execute", json={"colour": 1})
    call(api, "POST", SB + "/files", 201, p + "/files", params={"path": "/root/a.txt"},
         content=b"abc")
    call(api, "PUT", SB + "/files", 201, p + "/files", params={"path": "/root/b.txt"},
         content=b"abc")
    call(api, "GET", SB + "/stat/{path}", 200, p + "/stat/root/a.txt")
    call(api, "GET", SB + "/files/{path}", 200, p + "/files/root/a.txt")
    call(api, "GET", SB + "/files/{path}", 200, p + "/files/root")  # a directory listing
    call(api, "DELETE", SB + "/files/{path}", 204, p + "/files/root/a.txt")
    call(api, "GET", SB + "/stat/{path}", 404, p + "/stat/root/a.txt")


def _interpreter(api: httpx.Client, p: str) -> None:
    call(api, "POST", SB + "/run_code", 200, p + "/run_code",
         json={"code": "x = 2\nx * 21"})
    call(api, "POST", SB + "/run_code", 200, p + "/run_code",
         json={"code": "print(1)\n1/0", "stream": True})
    call(api, "POST", SB + "/contexts", 201, p + "/contexts", json={"name": "c1"})
    call(api, "GET", SB + "/contexts", 200, p + "/contexts")
    call(api, "DELETE", SB + "/contexts/{name}", 204, p + "/contexts/c1")


def _commands(api: httpx.Client, p: str) -> None:
    proc = call(api, "POST", SB + "/commands", 201, p + "/commands",
                json={"command": "cat", "background": True, "stdin": True})
    c = f"{p}/commands/{proc['pid']}"
    pid = SB + "/commands/{pid}"
    call(api, "GET", SB + "/commands", 200, p + "/commands")
    call(api, "GET", pid, 200, c)
    call(api, "POST", pid + "/stdin", 204, c + "/stdin", content=b"hello\n")
    call(api, "POST", pid + "/stdin", 204, c + "/stdin", params={"eof": "1"}, content=b"")
    call(api, "GET", pid + "/wait", 200, c + "/wait", params={"timeout": "30"})
    call(api, "GET", pid + "/output", 200, c + "/output", params={"offset": "0"})
    call(api, "POST", SB + "/commands", 200, p + "/commands",
         json={"command": "echo streamed", "background": False})
    sleeper = call(api, "POST", SB + "/commands", 201, p + "/commands",
                   json={"command": "sleep 60", "background": True})
    call(api, "POST", pid + "/signal", 204, f"{p}/commands/{sleeper['pid']}/signal",
         json={"signal": "SIGTERM"})
    call(api, "GET", pid, 404, f"{p}/commands/999999")


def test_sessions_answer_what_the_spec_says(api):
    name = "contract-e2e"
    call(api, "PUT", "/v1/sessions/{name}", 201, f"/v1/sessions/{name}", json={})
    try:
        call(api, "GET", "/v1/sessions/{name}", 200, f"/v1/sessions/{name}")
        call(api, "GET", "/v1/sessions", 200)
    finally:
        call(api, "DELETE", "/v1/sessions/{name}", 204, f"/v1/sessions/{name}")
    call(api, "GET", "/v1/sessions/{name}", 404, f"/v1/sessions/{name}")
