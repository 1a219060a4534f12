"""The QMP client and the QEMU driver's command sequences against a scripted fake QMP peer."""

import asyncio
import json
from pathlib import Path

import pytest

from vmctl.errors import VMGoneError, VMProtocolError
from vmctl.qmp import QMPClient


class FakeQMP:
    """A QMP server on a Unix socket that answers from a script and records commands."""

    def __init__(self, path, replies=None):
        self.path, self.replies, self.seen = path, replies or {}, []

    async def start(self):
        self.server = await asyncio.start_unix_server(self._serve, path=str(self.path))

    async def _serve(self, reader, writer):
        try:
            await self._converse(reader, writer)
        finally:
            writer.close()

    async def _converse(self, reader, writer):
        writer.write(b'{"QMP": {"version": {}, "capabilities": []}}\r\n')
        while line := await reader.readline():
            msg = json.loads(line)
            cmd = msg["execute"]
            self.seen.append((cmd, msg.get("arguments")))
            reply = self.replies.get(cmd, {"return": {}})
            if callable(reply):
                reply = reply()
            if cmd == "stop":
                writer.write(b'{"event": "STOP", "timestamp": {}}\r\n')
            writer.write(json.dumps(reply).encode() + b"\r\n")
            await writer.drain()
            if cmd == "quit":
                return

    async def close(self):
        self.server.close()
        await self.server.wait_closed()


async def test_negotiates_and_runs_commands(tmp_path):
    peer = FakeQMP(tmp_path / "q.sock", {"query-status": {"return": {"status": "running"}}})
    await peer.start()
    qmp = QMPClient()
    await qmp.connect(peer.path)
    assert (await qmp.execute("query-status"))["status"] == "running"
    await qmp.execute("stop")
    assert (await qmp.wait_event("STOP", 1))["event"] == "STOP"
    assert [c for c, _ in peer.seen] == ["qmp_capabilities", "query-status", "stop"]
    await qmp.close()
    await peer.close()


async def test_a_file_descriptor_goes_along_with_getfd(tmp_path):
    """``getfd``: QEMU takes the fd from the command's SCM_RIGHTS; what it reads through
    it is the file we opened (a confined QEMU cannot open the snapshot itself)."""
    import os
    import socket

    path = tmp_path / "q.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    got: dict = {}

    def serve():  # a blocking peer, reading the way QEMU does (recvmsg, fds and data)
        conn, _ = server.accept()
        with conn:
            conn.sendall(b'{"QMP": {"version": {}, "capabilities": []}}\r\n')
            buf = b""
            while buf.count(b"\n") < 3:
                data, fds, _, _ = socket.recv_fds(conn, 4096, 4)
                if not data:
                    return
                buf += data
                if fds:
                    got["fds"] = fds
                    got["cmd"] = data
                    got["read"] = os.read(fds[0], 100)
                conn.sendall(b'{"return": {}}\r\n' * data.count(b"\n"))

    state = tmp_path / "vmstate"
    state.write_bytes(b"device state")
    thread = asyncio.get_running_loop().run_in_executor(None, serve)
    qmp = QMPClient()
    await qmp.connect(path)
    fd = os.open(state, os.O_RDONLY)
    try:
        await qmp.execute("getfd", {"fdname": "vmstate"}, fds=(fd,))
    finally:
        os.close(fd)
    await qmp.execute("query-status")  # the connection goes on as before
    await qmp.close()
    await thread
    server.close()
    assert got["read"] == b"device state" and b'"getfd"' in got["cmd"]
    for received in got["fds"]:
        os.close(received)


async def test_errors_become_typed(tmp_path):
    peer = FakeQMP(tmp_path / "q.sock", {"cont": {"error": {"class": "GenericError",
                                                            "desc": "nope"}}})
    await peer.start()
    qmp = QMPClient()
    await qmp.connect(peer.path)
    with pytest.raises(VMProtocolError, match="nope"):
        await qmp.execute("cont")
    await qmp.execute("quit")
    with pytest.raises(VMGoneError):
        await qmp.execute("query-status")
    await qmp.close()
    await peer.close()


async def test_snapshot_sequence(tmp_path):
    """The driver's save sequence: x-ignore-shared, bandwidth, stop, migrate, poll, rename."""
    from vmctl.drivers.qemu import QemuDriver
    from vmctl.spec import VMSpec

    polls = iter([{"return": {"status": "active"}}, {"return": {"status": "completed"}}])
    streams = []

    def migrate():  # QEMU connects to the driver's socket and streams the device state
        async def stream():
            _, writer = await asyncio.open_unix_connection(str(tmp_path / "migrate.sock"))
            writer.write(b"state")
            await writer.drain()
            writer.close()
        streams.append(asyncio.get_running_loop().create_task(stream()))
        return {"return": {}}

    peer = FakeQMP(tmp_path / "q.sock", {"query-migrate": lambda: next(polls),
                                         "migrate": migrate})
    await peer.start()
    drv = QemuDriver()
    drv.spec = VMSpec(vm_id="x", workdir=tmp_path, kernel=tmp_path / "k", disk=tmp_path / "d",
                      mem_file=tmp_path / "m")
    await drv._qmp.connect(peer.path)

    snap = await drv.snapshot(tmp_path / "snap")
    cmds = [c for c, _ in peer.seen]
    assert peer.seen[4][1] == {"uri": f"unix:{tmp_path / 'migrate.sock'}"}
    assert not (tmp_path / "migrate.sock").exists() and len(streams) == 1
    assert cmds == ["qmp_capabilities", "migrate-set-capabilities", "migrate-set-parameters",
                    "stop", "migrate", "query-migrate", "query-migrate"]
    caps = peer.seen[1][1]["capabilities"]
    assert caps == [{"capability": "x-ignore-shared", "state": True}]
    assert snap.state.read_bytes() == b"state" and snap.memory == tmp_path / "m"
    await drv._qmp.close()
    await peer.close()


def test_argv_is_identical_for_boot_and_restore(tmp_path):
    from vmctl.drivers.qemu import qemu_argv
    from vmctl.spec import Accel, VMSpec

    spec = VMSpec(vm_id="x", workdir=tmp_path, kernel=tmp_path / "k", disk=tmp_path / "d.qcow2",
                  mem_file=tmp_path / "m", initrd=tmp_path / "i", netns="ns", accel=Accel.TCG)
    argv = qemu_argv(spec, tmp_path / "q.sock")
    assert "share=on" in " ".join(argv) and "format=qcow2" in " ".join(argv)
    assert argv[argv.index("-accel") + 1].startswith("tcg")
    assert argv.index("-initrd") < argv.index("-append")
    kvm = qemu_argv(VMSpec(**{**spec.__dict__, "accel": Accel.KVM}), tmp_path / "q.sock")
    assert kvm[kvm.index("-accel") + 1] == "kvm"


def test_control_socket_stays_within_the_unix_socket_limit(tmp_path):
    from vmctl.drivers.qemu import control_socket_path
    from vmctl.spec import VMSpec

    short = VMSpec(vm_id="a", workdir=tmp_path, kernel=tmp_path / "k", disk=tmp_path / "d",
                   mem_file=tmp_path / "m")
    assert control_socket_path(short) == tmp_path / "qmp.sock"
    deep = VMSpec(**{**short.__dict__, "vm_id": "golden-x", "workdir": tmp_path / ("d" * 120)})
    path = control_socket_path(deep)
    assert len(str(path)) < 108 and path.name.startswith("golden-x-")
    assert path.name.endswith(".qmp.sock") and path == control_socket_path(deep)
    # The same id under another daemon's data dir (a sandbox moving between two hosts of
    # one kernel) gets another socket.
    other = VMSpec(**{**deep.__dict__, "workdir": tmp_path / ("e" * 120)})
    assert control_socket_path(other) != path


def test_an_adopted_vmms_console_is_found_beside_its_recorded_qmp_socket(tmp_path):
    from vmctl.drivers.qemu import console_beside

    assert console_beside(tmp_path / "qmp.sock") == tmp_path / "console.sock"
    run = Path("/run/agentbox")
    assert console_beside(run / "abc-0123abcd.qmp.sock") == run / "abc-0123abcd.console.sock"
    assert console_beside(run / "abc.qmp.sock") == run / "abc.console.sock"  # older daemons

