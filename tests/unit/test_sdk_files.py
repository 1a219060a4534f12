"""sandbox.files / upload / download against the fake server (sync)."""

from __future__ import annotations

import io
import json

import pytest
from aiohttp import web

from agentbox import AgentBox, exceptions
from tests.unit.test_sdk_fakeserver import (
    KEY,
    FakeServer,
    empty,
    error,
    raw,
    reply,
    sandbox_json,
)

FILES = r"/v1/sandboxes/sb1/files"


def info(path: str, size: int) -> dict:
    return {"path": path, "name": path.rsplit("/", 1)[-1], "type": "file", "size": size,
            "mode": 420, "mtime": 1.0}


async def echo_upload(request: web.Request) -> web.Response:
    body = await request.read()
    return web.json_response(info(request.query["path"], len(body)), status=201)


@pytest.fixture
def sandbox():
    with FakeServer() as srv, AgentBox(api_key=KEY, base_url=srv.url) as box:
        srv.on("GET", "/v1/sandboxes/sb1", reply(sandbox_json()))
        srv.on("POST", FILES, echo_upload)
        sb = box.connect("sb1")
        sb.srv = srv
        yield sb


def test_write_sends_raw_bytes_with_the_path(sandbox):
    fi = sandbox.files.write("/tmp/a b.txt", "héllo")
    assert fi.path == "/tmp/a b.txt" and fi.size == len("héllo".encode())
    seen = sandbox.srv.seen("POST", FILES)[-1]
    assert seen.query == {"path": "/tmp/a b.txt"} and seen.body == "héllo".encode()
    assert seen.headers["Content-Type"] == "application/octet-stream"
    sandbox.files.write("rel/x", b"\x00\x01")
    assert sandbox.srv.seen("POST", FILES)[-1].query == {"path": "/root/rel/x"}


def test_write_streams_a_file_with_its_size_and_progress(sandbox, tmp_path):
    data = bytes(range(256)) * 4096  # 1 MiB
    path = tmp_path / "blob"
    path.write_bytes(data)
    seen_progress = []
    sandbox.upload("/tmp/blob", path, on_progress=lambda d, t: seen_progress.append((d, t)))
    sandbox.files.write("/tmp/blob2", io.BytesIO(data))
    sandbox.files.write("/tmp/blob3", iter([b"ab", b"cd"]))
    first, second, third = sandbox.srv.seen("POST", FILES)
    assert first.body == data and first.headers["Content-Length"] == str(len(data))
    assert second.body == data and second.headers["Content-Length"] == str(len(data))
    assert third.body == b"abcd" and "Content-Length" not in third.headers  # chunked
    assert seen_progress[-1] == (len(data), len(data)) and len(seen_progress) == 4
    with pytest.raises(exceptions.InvalidArgumentError):
        sandbox.files.write("/x", 12)


def test_read_formats(sandbox):
    sandbox.srv.on("GET", FILES + "/tmp/t.txt", raw("žluť".encode()))
    assert sandbox.files.read("/tmp/t.txt") == "žluť"
    assert sandbox.files.read("/tmp/t.txt", format="bytes") == "žluť".encode()
    with sandbox.files.read("/tmp/t.txt", format="stream") as stream:
        assert stream.size == len("žluť".encode())
        assert b"".join(stream) == "žluť".encode()
    assert sandbox.download("/tmp/t.txt") == "žluť".encode()


def test_download_to_a_local_file(sandbox, tmp_path):
    data = b"x" * 700_000
    sandbox.srv.on("GET", FILES + "/tmp/big", raw(data))
    progress = []
    dest = sandbox.download("/tmp/big", tmp_path / "big",
                            on_progress=lambda d, t: progress.append((d, t)))
    assert dest.read_bytes() == data and progress[-1] == (len(data), len(data))


def test_list_and_directory_checks(sandbox):
    listing = {"path": "/tmp", "entries": [info("/tmp/a", 1), {**info("/tmp/d", 0),
                                                                "type": "dir"}]}
    sandbox.srv.on("GET", FILES + "/tmp", raw(json.dumps(listing).encode(), "application/json"))
    sandbox.srv.on("GET", FILES + "/tmp/a", raw(b"1"))
    entries = sandbox.files.list("/tmp")
    assert [(e.name, e.is_dir) for e in entries] == [("a", False), ("d", True)]
    with pytest.raises(exceptions.InvalidArgumentError) as exc:
        sandbox.files.list("/tmp/a")
    assert exc.value.code == "not_a_directory"
    with pytest.raises(exceptions.InvalidArgumentError) as exc:
        sandbox.files.read("/tmp")
    assert exc.value.code == "is_a_directory"


STAT = r"/v1/sandboxes/sb1/stat"


def test_exists(sandbox):
    info = b'{"path": "/yes", "name": "yes", "type": "file", "size": 1, "mode": 420, "mtime": 1}'
    sandbox.srv.on("GET", STAT + "/yes", raw(info, "application/json"))
    sandbox.srv.on("GET", STAT + "/no", error(404, "not_found", "no such file: /no"))
    assert sandbox.files.exists("/yes") is True
    assert sandbox.files.exists("/no") is False
    sandbox.srv.on("GET", STAT + "/no", error(404, "sandbox_not_found"))
    with pytest.raises(exceptions.SandboxNotFoundError):
        sandbox.files.exists("/no")


def test_remove_and_errors(sandbox):
    sandbox.srv.on("DELETE", FILES + "/tmp/x y", empty())
    sandbox.files.remove("/tmp/x y")
    assert sandbox.srv.seen("DELETE")[-1].raw_path == "/v1/sandboxes/sb1/files/tmp/x%20y"
    sandbox.srv.on("GET", FILES + "/missing", error(404, "not_found", "no such file"))
    with pytest.raises(exceptions.NotFoundError):
        sandbox.files.read("/missing")
    sandbox.srv.on("POST", FILES, error(413, "payload_too_large"))
    with pytest.raises(exceptions.PayloadTooLargeError):
        sandbox.files.write("/big", b"x" * 10)
    with pytest.raises(exceptions.InvalidArgumentError):
        sandbox.files.read("")


def test_make_dir_uses_execute(sandbox):
    srv = sandbox.srv
    srv.on("POST", r"/v1/sandboxes/sb1/execute", reply({"stdout": "", "stderr": "",
                                                         "exit_code": 0, "duration_ms": 1}))
    assert sandbox.files.make_dir("/tmp/new dir") is True
    command = srv.seen("POST", r".*/execute")[-1].json["command"]
    assert command.endswith("mkdir -p -- '/tmp/new dir'")
    srv.on("POST", r"/v1/sandboxes/sb1/execute", reply({"stdout": "", "stderr": "",
                                                         "exit_code": 3, "duration_ms": 1}))
    assert sandbox.files.make_dir("/tmp/new dir") is False
    srv.on("POST", r"/v1/sandboxes/sb1/execute", reply({"stdout": "", "stderr": "denied",
                                                         "exit_code": 1, "duration_ms": 1}))
    with pytest.raises(exceptions.InvalidArgumentError, match="denied"):
        sandbox.files.make_dir("/proc/x")
