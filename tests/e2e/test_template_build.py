"""Templates built from a Dockerfile through the real daemon (issue 11, part 3).

A Dockerfile that installs a PyPI package (through the builder VM's registry proxy), copies
files, sets an env var and starts an HTTP server is built; a sandbox made from it serves
that server on its preview URL, and the server reports the package, the env var and the
copied file. A second build with nothing changed hits the cache for every step; a failing
RUN reports its exit code and output. Three builder boots and one restore in all.
"""

from __future__ import annotations

import io
import tarfile
import time
from pathlib import Path

import httpx
import orjson
import pytest

from gateway.templates import image_gc
from gateway.store.registry import Registry
from tests.e2e.test_preview import host_for, preview_token, wait_listening

pytestmark = pytest.mark.e2e

PACKAGE, MODULE, VERSION = "tomli-w", "tomli_w", "1.0.0"  # tiny, pure Python, not in Debian's base

APP = b'''
import http.server, json, os, pathlib
import tomli_w

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"path": self.path, "greeting": os.environ.get("GREETING"),
                           "toml": tomli_w.dumps({"a": 1}),
                           "file": pathlib.Path("msg.txt").read_text(),
                           "cwd": os.getcwd()}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
'''

DOCKERFILE = f"""
FROM python
RUN pip install {PACKAGE}=={VERSION} && python3 -c 'import {MODULE}'
COPY app.py msg.txt /srv/app/
ENV GREETING=hello-from-env
WORKDIR /srv/app
EXPOSE 8000
CMD ["python3", "app.py"]
# agentbox: ready http 8000 /health
""".encode()


@pytest.fixture
def web(daemon):
    with httpx.Client(base_url=daemon.url, timeout=120) as client:
        yield client


def context_tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def build(api, name: str, files: dict[str, bytes], timeout: float = 1800) -> tuple[dict, list]:
    r = api.post("/v1/templates/builds", params={"name": name}, content=context_tar(files),
                 headers={"Content-Type": "application/x-tar"})
    assert r.status_code == 202, r.text
    build_id = r.json()["build"]["id"]
    events = []
    with api.stream("GET", f"/v1/templates/builds/{build_id}/log",
                    timeout=timeout) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("application/x-ndjson")
        for line in resp.iter_lines():
            if line:
                events.append(orjson.loads(line))
    r = api.get(f"/v1/templates/builds/{build_id}")
    assert r.status_code == 200, r.text
    return r.json()["build"], events


@pytest.fixture(scope="module")
def built(daemon):
    with daemon.client() as api:
        api.timeout = 1800
        files = {"Dockerfile": DOCKERFILE, "app.py": APP, "msg.txt": b"copied-file-contents\n"}
        started = time.monotonic()
        first, events = build(api, "web-app", files)
        cold = time.monotonic() - started
        assert first["state"] == "ready", (first, events[-5:], daemon.log_tail())
        yield api, files, first, events, cold


def test_dockerfile_build_serves_its_app_on_the_preview_url(built, daemon, web):
    api, _, first, events, cold = built
    steps = [e for e in events if e["type"] == "step"]
    assert [s["cached"] for s in steps] == [False, False, False], steps
    assert events[-1] == {**events[-1], "type": "done", "state": "ready"}
    assert any(t["name"] == "web-app" for t in api.get("/v1/templates").json()["templates"])
    r = api.post("/v1/sandboxes", json={"template": "web-app"})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    try:
        token = preview_token(api, sid)
        # The server was started in the golden snapshot: it answers without being launched.
        resp = wait_listening(web, sid, 8000, token, "/check", timeout=30)
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body == {"path": "/check", "greeting": "hello-from-env", "toml": "a = 1\n",
                        "file": "copied-file-contents\n", "cwd": "/srv/app"}
        r = api.post(f"/v1/sandboxes/{sid}/execute", json={
            "command": f"python3 -c 'import {MODULE}; print({MODULE}.__name__)' && "
                       "echo $GREETING && cat /srv/app/msg.txt"})
        assert r.status_code == 200, r.text
        assert r.json()["stdout"].split() == [MODULE, "hello-from-env", "copied-file-contents"]
        assert host_for(sid, 8000)
    finally:
        api.delete(f"/v1/sandboxes/{sid}")
    print(f"cold build: {cold:.1f}s")


def test_rebuild_with_nothing_changed_hits_the_cache_for_every_step(built):
    api, files, _, _, _ = built
    started = time.monotonic()
    second, events = build(api, "web-app-again", files)
    warm = time.monotonic() - started
    assert second["state"] == "ready", events[-5:]
    steps = [e for e in events if e["type"] == "step"]
    assert len(steps) == 3 and all(s["cached"] for s in steps), steps
    assert second["cached_steps"] == second["steps"] == 3
    assert not [e for e in events if e["type"] == "step_done"]  # nothing ran
    print(f"warm build: {warm:.1f}s")


def test_a_built_template_keeps_the_build_it_stands_on_from_images_gc(built, daemon):
    # Its layers are overlays of the FROM golden's disk: `images gc` must count that build
    # as in use for as long as the template exists.
    rows = [t for t in registry_templates(daemon) if t["name"] == "web-app"]
    assert len(rows) == 1 and rows[0]["base"], rows
    base_build = Path(rows[0]["base"]).parent.resolve()
    assert base_build.parent.name == "python", base_build
    assert base_build in image_gc.in_use([daemon.data_dir])
    assert base_build not in image_gc.plan(base_build.parents[1], image_gc.in_use(
        [daemon.data_dir])).remove


def registry_templates(daemon) -> list[dict]:
    registry = Registry(daemon.data_dir / "registry.sqlite")
    try:
        return registry.list_templates()
    finally:
        registry.close()


def test_failing_run_reports_its_exit_code_and_output(daemon):
    dockerfile = b"FROM python\nRUN echo out-of-the-step && echo err-of-the-step >&2 && exit 7\n"
    with daemon.client() as api:
        api.timeout = 900
        result, events = build(api, "broken", {"Dockerfile": dockerfile})
    assert result["state"] == "failed"
    assert "exited with code 7" in result["error"] and "line 2" in result["error"]
    errors = [e for e in events if e["type"] == "error"]
    assert errors and errors[0]["exit_code"] == 7
    output = "".join(e["text"] for e in events if e["type"] == "output")
    assert "out-of-the-step" in output and "err-of-the-step" in output
    assert events[-1]["type"] == "done" and events[-1]["state"] == "failed"


def test_unsupported_instruction_is_a_400_with_its_line(api):
    r = api.post("/v1/templates/builds", params={"name": "nope"},
                 content=context_tar({"Dockerfile": b"FROM python\nRUN true\nVOLUME /data\n"}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "bad_dockerfile" and "line 3" in err["message"]


def test_a_builtin_still_building_is_listed_and_answers_503_with_retry_after(tmp_path):
    """A daemon serving python (built) and minimal (not built in its images dir): it starts
    at once with python, lists minimal as building, answers a create from minimal (or an
    alias of it) 503 template_building with Retry-After, and stopping it ends the build."""
    import os
    import subprocess
    import sys

    from tests.e2e.conftest import IMAGES_DIR, REPO, _free_port, stop_daemon, Daemon

    images = tmp_path / "images"
    images.mkdir()
    (images / "python").symlink_to(IMAGES_DIR / "python")  # python only: minimal is missing
    config = tmp_path / "agentbox.toml"
    config.write_text('[sandbox]\ntemplates = ["python", "minimal"]\nidle_timeout = 0\n'
                      '[network]\npool = "169.254.32.0/19"\n')
    port, data = _free_port(), tmp_path / "data"
    log_path = tmp_path / "daemon.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config), "--listen",
             f"127.0.0.1:{port}", "--data-dir", str(data), "--images-dir", str(images)],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    d = Daemon(url, (data / "admin.key").read_text().strip(), data, proc, log_path)
    try:
        with d.client() as api:
            listed = {t["name"]: t for t in api.get("/v1/templates").json()["templates"]}
            assert listed["python"]["state"] == "ready"
            assert listed["minimal"]["state"] == "building", listed
            assert set(listed["minimal"]["progress"]) >= {"stage", "elapsed_s"}
            for name in ("minimal", "bash"):
                r = api.post("/v1/sandboxes", json={"template": name})
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "template_building"
                assert r.headers["Retry-After"] == "30"
        builder = subprocess.run(["pgrep", "-f", f"images build minimal.*{images}"],
                                 capture_output=True, text=True).stdout.split()
        assert builder, "no background build process"
    finally:
        stop_daemon(d)
    for _ in range(50):
        if not subprocess.run(["pgrep", "-f", f"images build minimal.*{images}"],
                              capture_output=True).stdout:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the background build outlived the daemon")


PROBE = '''
import os, socket, urllib.parse, urllib.request
proxy = urllib.parse.urlsplit(os.environ["https_proxy"])
def connect(host, port):
    try:
        socket.create_connection((host, port), timeout=5).close()
        return "open"
    except OSError as e:
        return "refused" if isinstance(e, ConnectionRefusedError) else "blocked"
def via_proxy(target):
    s = socket.create_connection((proxy.hostname, proxy.port), timeout=10)
    s.sendall(f"CONNECT {target} HTTP/1.1\\r\\n\\r\\n".encode())
    status = s.recv(200).split(b"\\r\\n")[0].decode()
    s.close()
    return status
print("proxy-port", connect(proxy.hostname, proxy.port))
print("host-listener", connect(proxy.hostname, LISTENER))
print("pypi", via_proxy("pypi.org:443"))
print("other-host", via_proxy("example.com:443"))
print("other-port", via_proxy("pypi.org:22"))
'''


def test_a_builder_vm_reaches_only_the_registry_proxy(daemon):
    """A real listener on the host (all addresses) and hosts/ports off the allow-list: the
    builder's RUN step reaches the proxy, and through it only the registries."""
    import socket

    listener = socket.socket()
    listener.bind(("0.0.0.0", 0))
    listener.listen()
    listener.settimeout(0)
    port = listener.getsockname()[1]
    probe = PROBE.replace("LISTENER", str(port))
    dockerfile = "FROM python\nCOPY probe.py /probe.py\nRUN python3 /probe.py; false\n"
    try:
        with daemon.client() as api:
            api.timeout = 900
            result, events = build(api, f"probe-{port}", {"Dockerfile": dockerfile.encode(),
                                                          "probe.py": probe.encode()})
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing from the guest ever arrived
    finally:
        listener.close()
    out = "".join(e["text"] for e in events if e["type"] == "output")
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    assert "pypi" in lines, (out, events[-4:])
    assert lines["proxy-port"] == "open", out
    assert lines["host-listener"] == "blocked", out
    assert lines["pypi"].startswith("HTTP/1.1 200"), out
    assert lines["other-host"].startswith("HTTP/1.1 403"), out
    assert lines["other-port"].startswith("HTTP/1.1 403"), out
    assert result["state"] == "failed"  # `false`: nothing of the probe is kept as a layer
