"""result.files (guest/outputs.py, and the executor and interpreter around it): files a run
created or changed under /output/ are listed, others not; the scan is bounded."""

from __future__ import annotations

import os

from guest import outputs
from guest.execution import ExecOwner, Executor
from guest.protocol import ExecRequest, ExecResult, Execution, OutputFile


def test_changed_lists_new_and_modified_files_only(tmp_path):
    (tmp_path / "same").write_text("a")
    (tmp_path / "grows").write_text("a")
    before = outputs.scan(str(tmp_path))
    (tmp_path / "grows").write_text("abc")
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "e" / "new").write_bytes(b"12345")
    os.symlink("/etc/passwd", tmp_path / "link")  # not followed, not listed
    after = outputs.scan(str(tmp_path))
    assert outputs.changed(before, after) == [
        OutputFile(str(tmp_path / "d" / "e" / "new"), 5), OutputFile(str(tmp_path / "grows"), 3)]
    assert outputs.changed(after, outputs.scan(str(tmp_path))) == []


def test_a_replaced_file_of_the_same_size_counts(tmp_path):
    (tmp_path / "f").write_text("a")
    before = outputs.scan(str(tmp_path))
    (tmp_path / "g").write_text("b")
    os.replace(tmp_path / "g", tmp_path / "f")  # new inode
    assert [f.path for f in outputs.changed(before, outputs.scan(str(tmp_path)))] == [
        str(tmp_path / "f")]


def test_scan_and_listing_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(outputs, "MAX_SCAN", 50)
    monkeypatch.setattr(outputs, "MAX_FILES", 10)
    for i in range(200):
        (tmp_path / f"f{i:03}").write_text("x")
    after = outputs.scan(str(tmp_path))
    assert len(after) <= 50
    assert len(outputs.changed({}, after)) == 10
    assert outputs.scan(str(tmp_path / "missing")) == {}


async def test_execute_reports_the_files_it_wrote(tmp_path):
    executor = Executor(ExecOwner())
    executor.output_dir = str(tmp_path)
    (tmp_path / "old").write_text("x")
    res = await executor.run(ExecRequest(command=f"printf hello > {tmp_path}/out.txt"))
    assert res.files == [OutputFile(str(tmp_path / "out.txt"), 5)]
    assert ExecResult.from_dict(res.to_dict()) == res  # the wire form round-trips
    assert (await executor.run(ExecRequest(command="true"))).files == []


def test_execution_parses_files_from_the_wire():
    data = {"stdout": "", "stderr": "", "results": [], "error": None, "execution_count": 1,
            "duration_ms": 1.0, "files": [{"path": "/output/a", "size": 1}]}
    assert Execution.from_dict(data).files == [OutputFile("/output/a", 1)]


async def test_run_code_reports_files_plain_and_streamed(aiohttp_client, tmp_path, monkeypatch):
    from guest.agent import create_app

    out = tmp_path / "output"
    out.mkdir()
    monkeypatch.setattr(outputs, "OUTPUT_DIR", str(out))
    client = await aiohttp_client(create_app(keepawake_dir=str(tmp_path / "keepawake")))
    resp = await client.post("/run_code", json={"code": f"open({str(out / 'a')!r}, 'w')"
                                                        ".write('xyz')"})
    assert Execution.from_dict(await resp.json()).files == [OutputFile(str(out / "a"), 3)]
    resp = await client.post("/run_code", json={"code": f"open({str(out / 'b')!r}, 'w')"
                                                        ".write('1')", "stream": True})
    import json

    end = [json.loads(line) for line in (await resp.text()).splitlines()][-1]
    assert end["type"] == "end" and end["files"] == [{"path": str(out / "b"), "size": 1}]


def test_scan_small_gives_up_past_its_limit(tmp_path):
    for i in range(5):
        (tmp_path / f"f{i}").write_text("x")
    assert outputs.scan_small(str(tmp_path), limit=5) == outputs.scan(str(tmp_path))
    assert outputs.scan_small(str(tmp_path), limit=4) is None
    (tmp_path / "d").mkdir()  # an unwalked directory also means "not complete"
    assert outputs.scan_small(str(tmp_path), limit=6) is None
    assert len(outputs.scan_small(str(tmp_path), limit=7)) == 5
