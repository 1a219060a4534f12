"""/commands against the real agent app (real processes on the host), and the output ring."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from guest import processes
from guest.agent import create_app
from guest.processes import OutputRing, _utf8_cut
from guest.protocol import Health, ProcessInfo

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def client(aiohttp_client, tmp_path):
    return await aiohttp_client(create_app(keepawake_dir=str(tmp_path / "keepawake")))


async def start(client, command: str, **body) -> ProcessInfo:
    resp = await client.post("/commands", json={"command": command, **body})
    assert resp.status == 201, await resp.text()
    return ProcessInfo.from_dict(await resp.json())


async def wait(client, pid: int, timeout: float = 10) -> ProcessInfo:
    resp = await client.get(f"/commands/{pid}/wait", params={"timeout": str(timeout)})
    assert resp.status == 200, await resp.text()
    return ProcessInfo.from_dict(await resp.json())


async def output(client, pid: int, **params) -> list[dict]:
    resp = await client.get(f"/commands/{pid}/output", params={k: str(v) for k, v in
                                                               params.items()})
    assert resp.status == 200, await resp.text()
    return [json.loads(line) for line in (await resp.text()).splitlines()]


def text(events: list[dict], stream: str = "stdout") -> str:
    return "".join(e["data"] for e in events if e["type"] == stream)


async def error_of(resp) -> tuple[int, str]:
    return resp.status, (await resp.json())["error"]["code"]


async def running(client) -> int:
    return Health.from_dict(await (await client.get("/health")).json()).running


async def test_background_command_start_list_wait_output(client, tmp_path):
    info = await start(client, "echo out; echo err >&2; pwd; echo $GREETING",
                       env={"GREETING": "hi"}, cwd=str(tmp_path))
    assert info.running and info.background and info.exit_code is None and info.cwd == str(
        tmp_path)
    done = await wait(client, info.pid)
    assert (done.running, done.exit_code, done.timed_out) == (False, 0, False)
    assert done.finished_at and done.finished_at >= done.started_at
    events = await output(client, info.pid)
    assert text(events) == f"out\n{tmp_path}\nhi\n" and text(events, "stderr") == "err\n"
    assert events[-1] == {"type": "exit", "exit_code": 0, "offset": done.output_bytes,
                          "timed_out": False}
    listed = (await (await client.get("/commands")).json())["commands"]
    assert [c["pid"] for c in listed] == [info.pid]
    got = ProcessInfo.from_dict(await (await client.get(f"/commands/{info.pid}")).json())
    assert got == done


async def test_offsets_are_absolute_and_contiguous(client):
    info = await start(client, "printf abc; sleep 0.1; printf DE >&2; sleep 0.1; printf fgh")
    await wait(client, info.pid)
    events = [e for e in await output(client, info.pid) if e["type"] != "exit"]
    pos = 0
    for e in events:
        assert e["offset"] == pos
        pos = e["next_offset"]
    assert pos == 8
    tail = await output(client, info.pid, offset=6)
    assert [(e["type"], e.get("data")) for e in tail] == [("stdout", "gh"), ("exit", None)]


async def test_stdin(client):
    info = await start(client, "cat; echo closed", stdin=True)
    assert info.stdin
    assert (await client.post(f"/commands/{info.pid}/stdin", data=b"line 1\n")).status == 204
    assert (await client.post(f"/commands/{info.pid}/stdin", params={"eof": "1"},
                              data=b"line 2\n")).status == 204
    done = await wait(client, info.pid)
    assert done.exit_code == 0 and not done.stdin
    assert text(await output(client, info.pid)) == "line 1\nline 2\nclosed\n"
    resp = await client.post(f"/commands/{info.pid}/stdin", data=b"more")
    assert await error_of(resp) == (409, "stdin_closed")


async def test_stdin_needs_a_pipe(client):
    info = await start(client, "sleep 5")
    resp = await client.post(f"/commands/{info.pid}/stdin", data=b"x")
    assert await error_of(resp) == (409, "stdin_closed")
    await client.post(f"/commands/{info.pid}/signal", json={"signal": "SIGKILL"})


async def test_signal_reaches_the_whole_group(client):
    info = await start(client, "sleep 30 & sleep 31; echo never")
    await asyncio.sleep(0.2)
    resp = await client.post(f"/commands/{info.pid}/signal", json={"signal": "SIGTERM"})
    assert resp.status == 204
    done = await wait(client, info.pid)
    assert done.exit_code == -signal.SIGTERM and "never" not in text(await output(
        client, info.pid))
    resp = await client.post(f"/commands/{info.pid}/signal", json={"signal": "SIGTERM"})
    assert await error_of(resp) == (409, "not_running")
    resp = await client.post(f"/commands/{info.pid}/signal", json={"signal": "SIGBOGUS"})
    assert await error_of(resp) == (400, "bad_request")


async def test_signal_number_and_process_only(client):
    info = await start(client, "trap 'echo got usr1; exit 5' USR1; while :; do sleep 0.05; done")
    await asyncio.sleep(0.3)
    body = {"signal": int(signal.SIGUSR1), "group": False}
    assert (await client.post(f"/commands/{info.pid}/signal", json=body)).status == 204
    done = await wait(client, info.pid)
    assert done.exit_code == 5 and "got usr1" in text(await output(client, info.pid))


async def test_wait_returns_running_after_its_timeout(client):
    info = await start(client, "sleep 5")
    started = time.monotonic()
    still = await wait(client, info.pid, timeout=0.3)
    assert still.running and still.exit_code is None
    assert time.monotonic() - started < 3
    await client.post(f"/commands/{info.pid}/signal", json={"signal": "SIGKILL"})
    assert (await wait(client, info.pid)).exit_code == -signal.SIGKILL


async def test_reattach_from_an_offset_after_disconnect(client):
    info = await start(client, "for i in $(seq 1 8); do echo line $i; sleep 0.15; done")
    resp = await client.get(f"/commands/{info.pid}/output", params={"follow": "1"})
    seen, next_offset = "", 0
    while seen.count("\n") < 3:
        event = json.loads(await asyncio.wait_for(resp.content.readline(), 5))
        seen += event["data"]
        next_offset = event["next_offset"]
    resp.close()  # the client goes away (network blip, sandbox suspended...)
    assert await running(client) == 1  # the command does not care
    await asyncio.sleep(0.4)
    rest = await output(client, info.pid, offset=next_offset, follow=1)
    assert rest[-1]["type"] == "exit" and rest[-1]["exit_code"] == 0
    assert seen + text(rest) == "".join(f"line {i}\n" for i in range(1, 9))


async def test_follow_streams_live_output_until_exit(client):
    info = await start(client, "echo a; sleep 0.5; echo b")
    resp = await client.get(f"/commands/{info.pid}/output", params={"follow": "true"})
    first = json.loads(await asyncio.wait_for(resp.content.readline(), 2))
    assert first["data"] == "a\n"
    rest = [json.loads(line) for line in (await resp.text()).splitlines()]
    assert [e["type"] for e in rest] == ["stdout", "exit"] and rest[0]["data"] == "b\n"


async def test_output_without_follow_ends_at_the_current_end(client):
    info = await start(client, "echo now; sleep 5")
    await asyncio.sleep(0.3)
    events = await output(client, info.pid)
    assert [(e["type"], e["data"]) for e in events] == [("stdout", "now\n")]
    await client.post(f"/commands/{info.pid}/signal", json={"signal": "SIGKILL"})


async def test_foreground_command_streams_and_dies_with_its_client(client):
    resp = await client.post("/commands", json={"command": "echo hi; exit 3",
                                                "background": False})
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("application/x-ndjson")
    events = [json.loads(line) for line in (await resp.text()).splitlines()]
    assert events[0]["type"] == "start" and text(events) == "hi\n"
    assert events[-1]["type"] == "exit" and events[-1]["exit_code"] == 3

    resp = await client.post("/commands", json={"command": "echo go; sleep 30",
                                                "background": False})
    pid = json.loads(await resp.content.readline())["pid"]
    await resp.content.readline()
    resp.close()
    done = await wait(client, pid)
    assert done.exit_code == -signal.SIGKILL


async def test_timeout_kills_the_group(client):
    info = await start(client, "sleep 30", timeout=0.3)
    done = await wait(client, info.pid)
    assert done.timed_out and done.exit_code == -signal.SIGKILL


async def test_running_commands_count_in_health(client):
    assert await running(client) == 0
    info = await start(client, "sleep 30")
    assert await running(client) == 1
    await client.post(f"/commands/{info.pid}/signal", json={"signal": "SIGKILL"})
    await wait(client, info.pid)
    assert await running(client) == 0


async def test_finished_commands_are_evicted_oldest_first(client, monkeypatch):
    monkeypatch.setattr(processes, "MAX_FINISHED", 2)
    pids = []
    for i in range(3):
        info = await start(client, f"echo {i}")
        await wait(client, info.pid)
        pids.append(info.pid)
    listed = [c["pid"] for c in (await (await client.get("/commands")).json())["commands"]]
    assert listed == pids[1:]
    assert await error_of(await client.get(f"/commands/{pids[0]}")) == (404, "process_not_found")


async def test_bad_requests(client):
    assert await error_of(await client.post("/commands", json={})) == (400, "bad_request")
    resp = await client.post("/commands", json={"command": "true", "cwd": "/nonexistent"})
    assert await error_of(resp) == (400, "invalid_cwd")
    assert await error_of(await client.get("/commands/999999999")) == (404, "process_not_found")
    assert (await client.get("/commands/abc")).status == 404
    info = await start(client, "true")
    resp = await client.get(f"/commands/{info.pid}/output", params={"offset": "-1"})
    assert await error_of(resp) == (400, "bad_request")


async def test_commands_are_killed_when_the_agent_stops(aiohttp_client, tmp_path):
    client = await aiohttp_client(create_app(keepawake_dir=str(tmp_path)))
    info = await start(client, "sleep 30")
    await client.close()
    with pytest.raises(ProcessLookupError):
        for _ in range(50):
            os.kill(info.pid, 0)
            await asyncio.sleep(0.1)


def test_ring_keeps_the_newest_bytes_with_absolute_offsets():
    ring = OutputRing(limit=100 + 2 * processes.CHUNK_OVERHEAD)
    for i in range(5):
        ring.append("stdout" if i % 2 == 0 else "stderr", bytes([65 + i]) * 50)
    assert (ring.start, ring.end) == (150, 250)
    assert [(o, s, d[:1]) for o, s, d in ring.read(0)] == [(150, "stderr", b"D"),
                                                          (200, "stdout", b"E")]
    assert ring.read(210) == [(210, "stdout", b"E" * 40)]
    assert ring.read(250) == []


async def test_a_reader_that_fell_behind_is_told_what_it_missed():
    ring_limit = 10 + processes.CHUNK_OVERHEAD

    class Proc:
        pid, stdin = 1, None

    from guest.protocol import CommandRequest

    mp = processes.ManagedProcess(CommandRequest(command="x"), Proc(), "/")  # type: ignore
    mp.ring = OutputRing(limit=ring_limit)
    mp.on_output("stdout", b"0123456789")
    mp.on_output("stdout", b"abcdefghij")
    mp.finish(0)
    events = [e async for e in mp.events(0, follow=False)]
    assert events[0] == {"type": "dropped", "offset": 0, "next_offset": 10}
    assert events[1]["data"] == "abcdefghij" and events[-1]["type"] == "exit"


def test_utf8_is_never_split_inside_a_character():
    euro = "€".encode()  # 3 bytes
    assert _utf8_cut(b"ab" + euro) == 5
    assert _utf8_cut(b"ab" + euro[:1]) == 2
    assert _utf8_cut(b"ab" + euro[:2]) == 2
    assert _utf8_cut(b"ab") == 2 and _utf8_cut(b"") == 0
    assert _utf8_cut(b"\x80\x80\x80\x80") == 4  # not UTF-8: passed through


async def test_multibyte_output_split_across_reads_decodes_whole(client):
    info = await start(client, "printf '\\342\\202'; sleep 0.2; printf '\\254!\\n'")
    await wait(client, info.pid)
    assert text(await output(client, info.pid)) == "€!\n"
