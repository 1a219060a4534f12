"""Template builds without VMs: the registry proxy (a real listener and upstream), the
builder firewall hole, the build record's transitions and log, and background built-ins
answering 503 template_building with Retry-After while they build."""

from __future__ import annotations

import asyncio

import pytest

from gateway.builds import registry_proxy, builder_vm, builtin
from gateway.http import wire
from gateway.builds.service import Build, BuildState, as_user
from gateway.errors import ERROR_CODES, Unavailable
from images import dockerfile as df
from vmctl import egress
from vmctl.egress import EgressPolicy, HostFacts


def test_parse_target_and_allow_list():
    assert registry_proxy.parse_target("CONNECT pypi.org:443 HTTP/1.1") == (
        "CONNECT", "pypi.org", 443, "")
    assert registry_proxy.parse_target("GET http://deb.debian.org/debian/x HTTP/1.1") == (
        "GET", "deb.debian.org", 80, "/debian/x")
    assert registry_proxy.parse_target("GET /relative HTTP/1.1") is None
    hosts = ("pypi.org", "deb.debian.org")
    assert registry_proxy.allowed(hosts, "CONNECT", "pypi.org", 443)
    assert not registry_proxy.allowed(hosts, "CONNECT", "pypi.org", 22)
    assert not registry_proxy.allowed(hosts, "CONNECT", "evil.example", 443)
    assert not registry_proxy.allowed(hosts, "GET", "pypi.org", 443)


async def _upstream() -> tuple[asyncio.Server, int, list[bytes]]:
    seen: list[bytes] = []

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        seen.append(await r.readuntil(b"\r\n\r\n"))
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await w.drain()
        w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


async def _ask(port: int, head: bytes) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(head)
    await w.drain()
    data = await asyncio.wait_for(r.read(), 10)
    w.close()
    return data


async def test_proxy_forwards_allowed_hosts_and_refuses_the_rest(monkeypatch):
    server, up_port, seen = await _upstream()
    proxy = registry_proxy.RegistryProxy(["localhost"])
    monkeypatch.setattr(registry_proxy, "allowed",
                        lambda hosts, method, host, port: host in hosts and port == up_port)
    port = await proxy.start("127.0.0.1")
    try:
        got = await _ask(port, f"GET http://localhost:{up_port}/x HTTP/1.1\r\nHost: localhost"
                               f"\r\nProxy-Connection: keep-alive\r\n\r\n".encode())
        assert got.endswith(b"ok")
        assert seen[0].startswith(b"GET /x HTTP/1.1\r\n") and b"Proxy-Connection" not in seen[0]
        assert b"Connection: close" in seen[0]
        tunnel = await _ask(port, f"CONNECT localhost:{up_port} HTTP/1.1\r\n\r\n"
                                  f"GET /t HTTP/1.1\r\n\r\n".encode())
        assert tunnel.startswith(b"HTTP/1.1 200 Connection established") and b"ok" in tunnel
        # A host off the list: 403, and no connection reaches the upstream listener.
        denied = await _ask(port, f"CONNECT 127.0.0.1:{up_port} HTTP/1.1\r\n\r\n".encode())
        assert denied.startswith(b"HTTP/1.1 403") and len(seen) == 2
        assert proxy.denied == [f"CONNECT 127.0.0.1:{up_port} HTTP/1.1"]
    finally:
        await proxy.aclose()
        server.close()
        await server.wait_closed()


def test_builder_ruleset_opens_only_the_proxy_port():
    import ipaddress
    facts = HostFacts(addresses=(ipaddress.IPv4Address("169.254.64.1"),),
                      pool=ipaddress.IPv4Network("169.254.64.0/18"))
    base = egress.ruleset("169.254.64.2", EgressPolicy.from_config(False, ()), facts)
    out = builder_vm.builder_ruleset(base, "169.254.64.1", 41234)
    added = [line for line in out.splitlines() if line not in base.splitlines()]
    assert sorted(added) == [
        '    iifname "tap0" oifname "veth0" ip daddr 169.254.64.1 tcp dport 41234 accept',
        '    oifname "veth0" ip daddr 169.254.64.1 tcp dport 41234 masquerade']
    with pytest.raises(RuntimeError):
        builder_vm.builder_ruleset("table inet x {}", "169.254.64.1", 1)


def test_build_transitions_and_log_follow():
    b = Build(id="bld_1", tenant="t", name="n", recipe=df.parse("FROM python\nRUN true\n"))
    assert repr(b) == "<Build bld_1 n QUEUED>"
    with pytest.raises(RuntimeError):
        b.to(BuildState.READY)
    b.to(BuildState.RUNNING)
    b.emit("step", n=1)

    async def follow() -> list[str]:
        return [e["type"] async for e in b.follow()]

    async def scenario() -> list[str]:
        task = asyncio.create_task(follow())
        await asyncio.sleep(0.01)
        b.emit("step_done", n=1)
        b.to(BuildState.FAILED)
        b.emit("done", state="failed")
        return await asyncio.wait_for(task, 5)

    assert asyncio.run(scenario()) == ["step", "step_done", "done"]
    assert b.view().state == "failed" and b.view().steps == 2


def test_as_user():
    assert as_user("root", "id") == "/bin/sh -c id"
    assert as_user("1000:1000", "id").startswith("setpriv --reuid=1000 --regid=1000")
    assert as_user("app", "id").startswith("runuser -u app -- /bin/sh -c")


async def test_background_builtins_answer_503_with_retry_after_then_serve(monkeypatch):
    release = asyncio.Event()
    ready: dict[str, object] = {}

    async def fake_image(self, name, progress):  # the child-process build, scripted
        self._note(progress, f"  1.0s  [{name}] packages ...")
        await release.wait()
        return object()

    async def make_golden(image, progress):
        progress("golden[node]: booting")
        return "GOLDEN"

    monkeypatch.setattr(builtin.BuiltinBuilds, "_image", fake_image)
    bb = builtin.BuiltinBuilds(["node", "minimal"], None, None, make_golden,
                                      lambda n, g: ready.__setitem__(n, g))
    bb.start()
    await asyncio.sleep(0.05)
    with pytest.raises(Unavailable) as info:
        bb.check("node")
    assert info.value.code == "template_building" and info.value.status == 503
    assert info.value.headers == {"Retry-After": "30"} and "packages" in str(info.value)
    views = {v["name"]: v for v in map(wire.encode, bb.views())}
    assert views["node"]["state"] == "building"
    assert views["node"]["progress"]["stage"] == "packages"
    assert views["minimal"]["progress"]["stage"] == "queued"
    release.set()
    for _ in range(100):
        if len(ready) == 2:
            break
        await asyncio.sleep(0.01)
    assert ready == {"node": "GOLDEN", "minimal": "GOLDEN"} and bb.views() == []
    bb.check("node")  # servable: no error
    await bb.aclose()


async def test_a_failed_background_build_is_listed_and_answers_its_own_code(monkeypatch):
    async def broken(self, name, progress):
        raise RuntimeError("debootstrap exploded")

    monkeypatch.setattr(builtin.BuiltinBuilds, "_image", broken)
    bb = builtin.BuiltinBuilds(["node"], None, None, None, lambda n, g: None)
    bb.start()
    await asyncio.sleep(0.05)
    assert wire.encode(bb.views()) == [
        {"name": "node", "state": "failed", "error": "debootstrap exploded"}]
    with pytest.raises(Unavailable) as info:
        bb.check("node")
    assert info.value.code == "template_build_failed"
    await bb.aclose()


def test_error_codes_are_registered_and_priority_argv_is_niced():
    for code in ("template_building", "template_build_failed", "bad_dockerfile", "bad_context",
                 "build_not_found", "build_running", "builds_unavailable"):
        assert code in ERROR_CODES
    argv = builtin.priority_argv(["x"])
    assert argv[:3] == ["nice", "-n", "19"] and argv[-1] == "x"
    assert builtin.stage_of("  3.0s  [node] base (debootstrap) ...") == "base (debootstrap)"


@pytest.mark.parametrize("vcpus", [1, 2])
def test_a_built_template_restores_with_the_shape_it_was_saved_with(tmp_path, vcpus):
    """A Dockerfile build's golden snapshot records its builder VM's vCPU count (its FROM
    template's), and loading it reads that count back, whatever the directory is named;
    the finished step's cache key differs per vCPU count, and a 1-vCPU key is the old one."""
    from gateway.builds.service import _seal
    from gateway.builds.builder_vm import BootFiles
    from vmctl.golden import load_golden_dir
    from vmctl.spec import Accel, SnapshotFiles

    tmp, final = tmp_path / ".golden-x", tmp_path / "golden-0123abcd"
    tmp.mkdir()
    for name in ("vmstate", "memory", "disk.qcow2"):
        (tmp / name).write_bytes(name.encode())
    snap = SnapshotFiles(state=tmp / "vmstate", memory=tmp / "memory",
                         disk=tmp / "disk.qcow2", accel=Accel.TCG, driver="qemu")
    boot = BootFiles(tmp_path / "vmlinuz", None, "console=ttyS0", 512, vcpus)
    build = Build(id="bld_1", tenant="t", name="web", recipe=df.parse("FROM python\n"))
    _seal(snap, build, boot, tmp, final)
    golden = load_golden_dir(final)
    assert (golden.vcpus, golden.mem_mib) == (vcpus, 512)

    recipe = df.parse("FROM python\n")
    assert df.final_key("k", recipe, 512, 2) != df.final_key("k", recipe, 512, 1)
    assert df.final_key("k", recipe, 512, 1) == df.final_key("k", recipe, 512) == \
        df._h("final", "k", recipe.config_dict(), 512)
