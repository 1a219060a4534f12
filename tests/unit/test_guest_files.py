"""/files and /files/stat against the real agent app, on a temp directory of the host."""

from __future__ import annotations

import asyncio
import errno
import os
import stat

import aiohttp
import pytest

from guest import files
from guest.agent import create_app
from guest.errors import AgentError, NoSpace, from_os_error
from guest.protocol import DirListing, FileInfo

pytestmark = pytest.mark.timeout(60)
MiB = 1024 * 1024
ENDPOINTS = [("GET", "/files"), ("PUT", "/files"), ("DELETE", "/files"), ("GET", "/files/stat")]


@pytest.fixture
async def client(aiohttp_client, tmp_path_factory):
    keepawake = tmp_path_factory.mktemp("keepawake")  # not in tmp_path: tests list that
    return await aiohttp_client(create_app(keepawake_dir=str(keepawake)))


async def error_code(resp) -> str:
    return (await resp.json())["error"]["code"]


async def chunks(data: bytes, size: int = 100_000):
    for i in range(0, len(data), size):
        yield data[i : i + size]


async def test_write_and_read_10_mib_streamed(client, tmp_path):
    data = os.urandom(10 * MiB)
    path = tmp_path / "new" / "dir" / "blob.bin"  # parents are created
    resp = await client.put("/files", params={"path": str(path)}, data=chunks(data))
    assert resp.status == 200, await resp.text()
    info = FileInfo.from_dict(await resp.json())
    assert (info.path, info.name, info.type) == (str(path), "blob.bin", "file")
    assert info.size == len(data)
    assert path.read_bytes() == data
    assert os.listdir(path.parent) == ["blob.bin"]  # no temp file left behind

    resp = await client.get("/files", params={"path": str(path)})
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "application/octet-stream"
    assert resp.headers["Content-Length"] == str(len(data))
    received = bytearray()
    async for chunk in resp.content.iter_chunked(64 * 1024):
        received += chunk
    assert received == data


async def test_empty_file_round_trip(client, tmp_path):
    path = str(tmp_path / "empty")
    assert (await client.put("/files", params={"path": path}, data=b"")).status == 200
    resp = await client.get("/files", params={"path": path})
    assert (resp.status, await resp.read()) == (200, b"")


async def test_overwrite_is_atomic_and_keeps_mode(client, tmp_path):
    path = tmp_path / "script.sh"
    path.write_text("old")
    path.chmod(0o755)
    resp = await client.put("/files", params={"path": str(path)}, data=b"new")
    assert resp.status == 200
    assert path.read_text() == "new"
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    assert (await resp.json())["mode"] == 0o755


async def test_new_file_mode(client, tmp_path):
    resp = await client.put("/files", params={"path": str(tmp_path / "f")}, data=b"x")
    assert (await resp.json())["mode"] == 0o644


async def test_put_errors(client, tmp_path):
    (tmp_path / "afile").write_text("x")
    resp = await client.put("/files", params={"path": str(tmp_path)}, data=b"x")
    assert (resp.status, await error_code(resp)) == (400, "is_a_directory")
    resp = await client.put("/files", params={"path": str(tmp_path / "afile" / "x")}, data=b"x")
    assert (resp.status, await error_code(resp)) == (400, "not_a_directory")


async def test_failure_mid_download_drops_the_connection(client, tmp_path, monkeypatch):
    # Once headers promised a length, an error must cut the body short, not append a JSON error.
    async def failing(f, size):
        yield b"x" * 10
        raise AgentError("file shrank while being read")

    monkeypatch.setattr(files, "read_chunks", failing)
    (tmp_path / "f").write_bytes(b"y" * 100)
    resp = await client.get("/files", params={"path": str(tmp_path / "f")})
    assert resp.status == 200
    with pytest.raises(aiohttp.ClientPayloadError):
        await resp.read()


async def test_upload_cut_short_leaves_nothing(client, tmp_path):
    reader, writer = await asyncio.open_connection(client.host, client.port)
    path = tmp_path / "partial"
    head = f"PUT /files?path={path} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n"
    writer.write(head.encode() + b"a" * 300_000)
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.close()
    await writer.wait_closed()
    for _ in range(100):
        if not os.listdir(tmp_path):
            break
        await asyncio.sleep(0.02)
    assert os.listdir(tmp_path) == []


async def test_put_no_space_is_507_and_cleans_up(client, tmp_path, monkeypatch):
    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files, "_commit", full)
    resp = await client.put("/files", params={"path": str(tmp_path / "f")}, data=b"x" * 1000)
    assert (resp.status, await error_code(resp)) == (507, "no_space")
    assert os.listdir(tmp_path) == []


async def test_directory_listing(client, tmp_path):
    (tmp_path / "b.txt").write_text("hello")
    (tmp_path / "a").mkdir()
    (tmp_path / "c").symlink_to("b.txt")
    resp = await client.get("/files", params={"path": str(tmp_path)})
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("application/json")
    listing = DirListing.from_dict(await resp.json())
    assert listing.path == str(tmp_path)
    assert [(e.name, e.type) for e in listing.entries] == [
        ("a", "dir"),
        ("b.txt", "file"),
        ("c", "symlink"),
    ]
    assert listing.entries[1].size == 5
    assert listing.entries[1].path == str(tmp_path / "b.txt")


async def test_stat(client, tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"abc")
    resp = await client.get("/files/stat", params={"path": str(f)})
    info = FileInfo.from_dict(await resp.json())
    assert (info.type, info.size, info.name) == ("file", 3, "f")
    assert info.mtime == pytest.approx(f.stat().st_mtime)
    resp = await client.get("/files/stat", params={"path": str(tmp_path) + "/"})
    assert (await resp.json())["type"] == "dir"
    resp = await client.get("/files/stat", params={"path": "/"})
    assert (await resp.json())["name"] == "/"


async def test_delete_file_and_directory(client, tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "g").write_text("y")
    for target in (f, d):
        resp = await client.delete("/files", params={"path": str(target)})
        assert resp.status == 204
        assert not target.exists()


async def test_delete_symlink_removes_the_link_only(client, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "keep").write_text("x")
    (tmp_path / "link").symlink_to("real")
    assert (await client.delete("/files", params={"path": str(tmp_path / "link")})).status == 204
    assert (tmp_path / "real" / "keep").exists()


async def test_delete_root_is_refused(client):
    resp = await client.delete("/files", params={"path": "/"})
    assert (resp.status, await error_code(resp)) == (400, "bad_request")


@pytest.mark.parametrize("method,url", ENDPOINTS)
async def test_missing_is_404(client, tmp_path, method, url):
    resp = await client.request(method, url, params={"path": str(tmp_path / "nope" / "x")})
    expected = (200, None) if method == "PUT" else (404, "not_found")  # PUT creates parents
    code = await error_code(resp) if resp.status != 200 else None
    assert (resp.status, code) == expected


@pytest.mark.parametrize("path", ["relative/x", "/tmp/../etc", "/tmp/a\x00b", ""])
@pytest.mark.parametrize("method,url", ENDPOINTS)
async def test_invalid_paths(client, method, url, path):
    resp = await client.request(method, url, params={"path": path})
    assert (resp.status, await error_code(resp)) == (400, "invalid_path")


async def test_path_parameter_required(client):
    resp = await client.get("/files/stat")
    assert (resp.status, await error_code(resp)) == (400, "invalid_path")


async def test_read_of_special_file_is_refused(client, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    resp = await client.get("/files", params={"path": str(fifo)})
    assert (resp.status, await error_code(resp)) == (400, "bad_request")


def test_os_error_mapping():
    assert isinstance(from_os_error(OSError(errno.ENOSPC, "full"), "/x"), NoSpace)
    err = from_os_error(OSError(errno.EACCES, "denied"), "/x")
    assert (err.status, err.code) == (500, "internal")


async def test_download_abandoned_by_the_client(client, tmp_path):
    (tmp_path / "big").write_bytes(b"z" * (32 * MiB))
    resp = await client.get("/files", params={"path": str(tmp_path / "big")})
    await resp.content.readexactly(1024)
    resp.close()  # the server's writes now fail; it must give up quietly and close the file
    await asyncio.sleep(0.5)
    assert (await client.get("/health")).status == 200
