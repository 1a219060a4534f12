"""Code interpreter and commands through the real daemon, against real microVMs (issue 6)."""

from __future__ import annotations

import json
import time

import pytest

pytestmark = pytest.mark.e2e


def run_code(api, sid: str, code: str, **body) -> dict:
    r = api.post(f"/v1/sandboxes/{sid}/run_code", json={"code": code, **body})
    assert r.status_code == 200, r.text
    return r.json()


def main_text(execution: dict) -> str:
    [main] = [r for r in execution["results"] if r["is_main_result"]]
    return main["text/plain"]


def events(lines) -> list[dict]:
    return [json.loads(line) for line in lines if line.strip()]


def test_state_persists_across_run_code_calls(api, sandbox):
    sid = sandbox["id"]
    first = run_code(api, sid, "import json\ncounter = 41\nprint('set')")
    assert first["stdout"] == "set\n" and first["error"] is None
    second = run_code(api, sid, "counter += 1\njson.dumps({'n': counter})")
    assert main_text(second) == "'{\"n\": 42}'" and second["execution_count"] == 2
    # A second context has its own globals.
    r = api.post(f"/v1/sandboxes/{sid}/contexts", json={"name": "other"})
    assert r.status_code == 201, r.text
    other = run_code(api, sid, "'counter' in globals()", context="other")
    assert main_text(other) == "False"
    names = [c["name"] for c in api.get(f"/v1/sandboxes/{sid}/contexts").json()["contexts"]]
    assert sorted(names) == ["default", "other"]
    assert api.delete(f"/v1/sandboxes/{sid}/contexts/other").status_code == 204


def test_exception_comes_back_with_its_traceback(api, sandbox):
    ex = run_code(api, sandbox["id"], "def div(a):\n    return a / 0\nprint('before')\ndiv(1)")
    assert ex["stdout"] == "before\n" and ex["results"] == []
    err = ex["error"]
    assert (err["name"], err["value"]) == ("ZeroDivisionError", "division by zero")
    assert 'line 4, in <module>' in err["traceback"] and "return a / 0" in err["traceback"]


def test_streamed_run_and_timeout(api, sandbox):
    sid = sandbox["id"]
    body = {"code": "import time\nfor i in range(3):\n    print(i, flush=True)\n"
                    "    time.sleep(0.2)\n'done'", "stream": True}
    with api.stream("POST", f"/v1/sandboxes/{sid}/run_code", json=body) as r:
        assert r.status_code == 200
        got = events(r.iter_lines())
    assert "".join(e["data"] for e in got if e["type"] == "stdout") == "0\n1\n2\n"
    assert got[-2]["result"]["text/plain"] == "'done'" and got[-1]["type"] == "end"
    ex = run_code(api, sid, "import time\ntime.sleep(60)", timeout=1)
    assert ex["error"]["name"] == "TimeoutError"
    assert main_text(run_code(api, sid, "'alive'")) == "'alive'"


def test_background_command_reattach_from_an_offset(api, sandbox):
    sid = sandbox["id"]
    r = api.post(f"/v1/sandboxes/{sid}/commands",
                 json={"command": "for i in 1 2 3 4 5 6; do echo line $i; sleep 0.4; done"})
    assert r.status_code == 201, r.text
    pid = r.json()["pid"]
    seen, next_offset = "", 0
    with api.stream("GET", f"/v1/sandboxes/{sid}/commands/{pid}/output",
                    params={"follow": "1"}) as r:
        for line in r.iter_lines():
            event = json.loads(line)
            seen += event["data"]
            next_offset = event["next_offset"]
            if seen.count("\n") >= 2:
                break  # disconnect mid-stream
    listed = api.get(f"/v1/sandboxes/{sid}/commands").json()["commands"]
    assert [c["pid"] for c in listed] == [pid] and listed[0]["running"]
    time.sleep(0.5)
    with api.stream("GET", f"/v1/sandboxes/{sid}/commands/{pid}/output",
                    params={"follow": "1", "offset": str(next_offset)}) as r:
        rest = events(r.iter_lines())
    assert rest[-1] == {"type": "exit", "exit_code": 0, "offset": rest[-1]["offset"],
                        "timed_out": False}
    text = seen + "".join(e["data"] for e in rest if e["type"] == "stdout")
    assert text == "".join(f"line {i}\n" for i in range(1, 7))


def test_command_stdin_signal_and_wait(api, sandbox):
    sid = sandbox["id"]
    r = api.post(f"/v1/sandboxes/{sid}/commands", json={"command": "cat", "stdin": True})
    assert r.status_code == 201, r.text
    pid = r.json()["pid"]
    base = f"/v1/sandboxes/{sid}/commands/{pid}"
    assert api.post(base + "/stdin", content=b"hello ").status_code == 204
    assert api.post(base + "/stdin", params={"eof": "1"}, content=b"world\n").status_code == 204
    done = api.get(base + "/wait", params={"timeout": "30"}).json()
    assert done["exit_code"] == 0 and not done["running"]
    out = events(api.get(base + "/output").iter_lines())
    assert "".join(e["data"] for e in out if e["type"] == "stdout") == "hello world\n"

    r = api.post(f"/v1/sandboxes/{sid}/commands", json={"command": "sleep 300"})
    pid = r.json()["pid"]
    assert api.post(f"/v1/sandboxes/{sid}/commands/{pid}/signal",
                    json={"signal": "SIGTERM"}).status_code == 204
    done = api.get(f"/v1/sandboxes/{sid}/commands/{pid}/wait", params={"timeout": "30"}).json()
    assert done["exit_code"] == -15


def test_foreground_command_streams(api, sandbox):
    body = {"command": "echo out; echo err >&2; exit 4", "background": False}
    with api.stream("POST", f"/v1/sandboxes/{sandbox['id']}/commands", json=body) as r:
        assert r.status_code == 200
        got = events(r.iter_lines())
    assert got[0]["type"] == "start" and got[-1]["exit_code"] == 4
    assert {e["type"]: e["data"] for e in got if "data" in e} == {"stdout": "out\n",
                                                                  "stderr": "err\n"}
