"""User templates with real VMs: snapshot a running sandbox into a template, start a new
sandbox from it, fork one into two, delete a template a sandbox still uses; and
``result.files`` for /output/, relative uploads landing in /input/.

Four sandboxes in all (the source, one from its template, two forks)."""

from __future__ import annotations

import time

import pytest

from agentbox import AgentBox

SLOW = 600  # snapshot / fork: copies the VM's memory and disk on a loaded TCG host
BG = "sleep 7777"  # the background process every clone must still be running


def _template_dirs(daemon, before: frozenset = frozenset()) -> set:
    """Template directories in the daemon's data dir, less ``before`` (the shared daemon also
    holds other tests' templates, e.g. Dockerfile builds)."""
    root = daemon.data_dir / "templates"
    return {p.name for p in root.iterdir()} - before if root.exists() else set()


def _exec(api, sid: str, command: str) -> dict:
    r = api.post(f"/v1/sandboxes/{sid}/execute", json={"command": command, "timeout": 60})
    assert r.status_code == 200, r.text
    return r.json()


def _code(api, sid: str, code: str) -> dict:
    r = api.post(f"/v1/sandboxes/{sid}/run_code", json={"code": code, "timeout": 60})
    assert r.status_code == 200, r.text
    return r.json()


def _create(api, template: str) -> str:
    r = api.post("/v1/sandboxes", json={"template": template}, timeout=SLOW)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def _has_all_three(api, sid: str, x: int = 41, text: str = "hello") -> None:
    assert _exec(api, sid, "cat /root/state.txt")["stdout"] == text
    assert _exec(api, sid, f"pgrep -f '^{BG}$'")["exit_code"] == 0, "background process lost"
    assert _code(api, sid, "x")["results"][0]["text/plain"] == str(x)


def _identity(api, sid: str) -> tuple[str, str]:
    out = _exec(api, sid, "hostname; cat /etc/machine-id")["stdout"].split()
    return out[0], out[1]


@pytest.fixture(scope="module")
def source(daemon):
    """A sandbox with a file, a background process and an interpreter variable."""
    with daemon.client() as api:
        sid = _create(api, "python")
        _exec(api, sid, "printf hello > /root/state.txt")
        r = api.post(f"/v1/sandboxes/{sid}/commands", json={"command": BG, "background": True})
        assert r.status_code == 201, r.text
        assert _code(api, sid, "x = 41")["error"] is None
        yield sid
        api.delete(f"/v1/sandboxes/{sid}")


def test_output_files_are_listed_and_download_byte_for_byte(api, source):
    res = _exec(api, source, "mkdir -p /output/sub && printf abc > /output/sub/a.txt")
    assert res["files"] == [{"path": "/output/sub/a.txt", "size": 3}]
    payload = bytes(range(256)) * 40
    out = _code(api, source, f"open('/output/b.bin', 'wb').write({payload!r}); 1")
    assert out["files"] == [{"path": "/output/b.bin", "size": len(payload)}]
    assert api.get(f"/v1/sandboxes/{source}/files/output/b.bin").content == payload
    # Unchanged files are not listed again; a modified one is.
    assert _exec(api, source, "true")["files"] == []
    assert [f["path"] for f in _exec(api, source, "echo more >> /output/sub/a.txt")["files"]] \
        == ["/output/sub/a.txt"]


def test_the_briefs_upload_then_read_input_example(daemon, source):
    csv = b"a,b\n1,2\n3,4\n"
    with AgentBox(api_key=daemon.admin_key, base_url=daemon.url) as box:
        sandbox = box.connect(source)
        assert sandbox.upload("data.csv", csv).path == "/input/data.csv"
        result = sandbox.execute("import csv\nrows = list(csv.DictReader(open('/input/data.csv')))"
                                 "\nprint(sum(int(r['b']) for r in rows))\n"
                                 "open('/output/sum.txt', 'w').write('6')")
        assert result.stdout.strip() == "6", result.stderr
        assert [(f.path, f.size) for f in result.files] == [("/output/sum.txt", 1)]
        assert sandbox.download("sum.txt") == b"6"  # relative: from /output/
        execution = sandbox.run_code("open('/output/run.txt', 'w').write('xy')")
        assert [(f.path, f.size) for f in execution.files] == [("/output/run.txt", 2)]


def test_the_briefs_datascience_example_through_the_sdk_unchanged(daemon):
    """The product brief's own example, as written (only the key and URL are this test's)."""
    import json

    csv_bytes = b"x,y\n1,10\n2,20\n3,30\n4,40\n"
    box = AgentBox(api_key=daemon.admin_key, base_url=daemon.url)
    try:
        sandbox = box.create(environment="python-datascience")
        try:
            sandbox.upload("data.csv", csv_bytes)   # the brief then reads it as '/input/data.csv'
            result = sandbox.execute("""
import pandas as pd
df = pd.read_csv('/input/data.csv')
print(df.describe().to_json())
""")
            stats = json.loads(result.stdout)  # JSON
            assert stats["x"]["mean"] == 2.5 and stats["y"]["max"] == 40.0, result.stdout
            assert result.files == []  # nothing written to /output/
            # The template's warm packages are there too, and files under /output/ are listed.
            more = sandbox.execute("import sklearn, matplotlib, numpy\n"
                                   "import pandas as pd\n"
                                   "pd.read_csv('/input/data.csv').describe()"
                                   ".to_csv('/output/stats.csv')")
            assert more.error is None, more.stderr
            assert [f.path for f in more.files] == ["/output/stats.csv"]
            assert sandbox.download("stats.csv").startswith(b",x,y")
        finally:
            sandbox.kill()
    finally:
        box.close()


def test_snapshot_template_fork_and_delete(daemon, api, source):
    others = frozenset(_template_dirs(daemon))
    r = api.post(f"/v1/sandboxes/{source}/snapshot", json={"template": "e2e-tpl"}, timeout=SLOW)
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "e2e-tpl" and r.json()["owner"] == "tenant"
    assert api.post(f"/v1/sandboxes/{source}/snapshot", json={"template": "python"}
                    ).json()["error"]["code"] == "template_exists"
    _has_all_three(api, source)  # the source runs on
    names = {t["name"]: t for t in api.get("/v1/templates").json()["templates"]}
    assert names["e2e-tpl"]["source"] == "snapshot" and names["python"]["owner"] == "builtin"

    clone = _create(api, "e2e-tpl")
    try:
        _has_all_three(api, clone)
        assert api.get(f"/v1/sandboxes/{clone}").json()["template"] == "e2e-tpl"
        src_id, clone_id = _identity(api, source), _identity(api, clone)
        assert src_id[0] != clone_id[0] and src_id[1] != clone_id[1], (src_id, clone_id)

        # Delete the template while `clone` uses it: the name goes, the sandbox works on.
        assert api.delete("/v1/templates/e2e-tpl").status_code == 204
        assert "e2e-tpl" not in {t["name"] for t in api.get("/v1/templates").json()["templates"]}
        assert api.post("/v1/sandboxes", json={"template": "e2e-tpl"}).status_code == 404
        assert len(_template_dirs(daemon, others)) == 1  # files kept
        _has_all_three(api, clone)
        _exec(api, clone, "printf changed > /root/state.txt")
        assert _exec(api, clone, "cat /root/state.txt")["stdout"] == "changed"
    finally:
        api.delete(f"/v1/sandboxes/{clone}")
    assert _template_dirs(daemon, others) == set()  # the last dependent went

    r = api.post(f"/v1/sandboxes/{source}/fork", json={"count": 2}, timeout=SLOW)
    assert r.status_code == 201, r.text
    forks = [s["id"] for s in r.json()["sandboxes"]]
    try:
        assert len(forks) == 2
        for fid in forks:
            _has_all_three(api, fid)
        # They diverge: each sees only its own writes (and so does the source).
        for i, fid in enumerate(forks):
            _code(api, fid, f"x = {100 + i}")
            _exec(api, fid, f"printf fork{i} > /root/state.txt")
        for i, fid in enumerate(forks):
            _has_all_three(api, fid, x=100 + i, text=f"fork{i}")
        _has_all_three(api, source)
        assert len({_identity(api, fid) for fid in forks}) == 2
        assert all(t["source"] != "fork" for t in api.get("/v1/templates").json()["templates"])
    finally:
        for fid in forks:
            api.delete(f"/v1/sandboxes/{fid}")
    deadline = time.monotonic() + 10
    while _template_dirs(daemon, others) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _template_dirs(daemon, others) == set()  # the fork's snapshot went


def test_a_sleeping_sandbox_is_woken_and_snapshotted(daemon, api, source):
    others = frozenset(_template_dirs(daemon))
    assert api.post(f"/v1/sandboxes/{source}/suspend").json()["state"] == "suspended"
    r = api.post(f"/v1/sandboxes/{source}/snapshot", json={"template": "e2e-sleep"},
                 timeout=SLOW)
    assert r.status_code == 201, r.text
    assert api.get(f"/v1/sandboxes/{source}").json()["state"] == "running"
    _has_all_three(api, source)
    assert api.delete("/v1/templates/e2e-sleep").status_code == 204
    assert _template_dirs(daemon, others) == set()  # nothing used it


def test_bad_requests(api, source):
    for body, code in (({"template": "Bad Name"}, "bad_template_name"), ({}, "bad_template_name"),
                       ({"template": "x", "y": 1}, "bad_request")):
        r = api.post(f"/v1/sandboxes/{source}/snapshot", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
    for count in (0, 9, "2", True):
        r = api.post(f"/v1/sandboxes/{source}/fork", json={"count": count})
        assert r.status_code == 400, r.text
    assert api.delete("/v1/templates/python").json()["error"]["code"] == "template_builtin"
    assert api.delete("/v1/templates/nope").status_code == 404
