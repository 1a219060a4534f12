#!/usr/bin/python3
"""PID 1 of an AgentBox guest (installed in images as /sbin/agentbox-init).

Theory of operation: the initramfs mounts the root disk and execs this file.
We set up what a Debian userland expects (pseudo file systems, hostname,
loopback, the fixed guest address on eth0, a sane environment), then
supervise the guest agent (``python3 -m guest.agent`` in /opt/agentbox):
start it, restart it with exponential backoff when it exits, and reap every
orphan that gets re-parented to us. SIGTERM or SIGINT (and ctrl-alt-del)
stop everything, sync and power off so the VMM exits.

If PID 1 dies the kernel panics, so every step is guarded: a failure is
printed to the console and the loop carries on. Stdlib only; this runs on
Debian's python3 before anything else exists.

Optional kernel command line settings (``key=value``):
  agentbox.ip=ADDR/LEN   guest address (default guest.protocol.GUEST_ADDR)
  agentbox.gw=ADDR       default route (default guest.protocol.TAP_ADDR)
  agentbox.dns=ADDR      write /etc/resolv.conf with this name server
  agentbox.iface=NAME    NIC to configure (default eth0)
  agentbox.debug         agent output to the console instead of the log file
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass

AGENT_DIR = "/opt/agentbox"
AGENT_ARGV = ["/usr/bin/python3", "-m", "guest.agent"]
AGENT_LOG = "/var/log/agentbox-agent.log"
LOG_ROTATE_BYTES = 16 * 1024 * 1024
MARKER = "agentbox-init: agent started"
HOSTNAME = "agentbox"
ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "USER": "root",
    "LOGNAME": "root",
    "SHELL": "/bin/bash",
    "LANG": "C.UTF-8",
    "TERM": "xterm-256color",
    "PYTHONUNBUFFERED": "1",
}
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_RDONLY = 2, 4, 8, 32, 1
MOUNTS = (  # (source, target, fstype, flags, options)
    ("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, ""),
    ("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, ""),
    ("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755"),
    ("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "gid=5,mode=0620,ptmxmode=0666"),
    ("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777"),
    ("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755"),
    ("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777"),
    ("cgroup2", "/sys/fs/cgroup", "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, ""),
)
DEV_LINKS = {
    "/dev/fd": "/proc/self/fd",
    "/dev/stdin": "/proc/self/fd/0",
    "/dev/stdout": "/proc/self/fd/1",
    "/dev/stderr": "/proc/self/fd/2",
}
RB_POWER_OFF, RB_DISABLE_CAD = 0x4321FEDC, 0

_libc = ctypes.CDLL(None, use_errno=True)
_console_fd = 2


def log(msg: str) -> None:
    """Write one line to the console; never raises (the console may be gone)."""
    try:
        os.write(_console_fd, f"agentbox-init: {msg}\n".encode(errors="replace"))
    except OSError:
        pass


def uptime() -> str:
    """Seconds since the kernel started, for boot-time diagnosis on the console."""
    try:
        with open("/proc/uptime") as f:
            return f"{float(f.read().split()[0]):.2f}s"
    except (OSError, ValueError, IndexError):
        return "?"


def _protocol_defaults() -> tuple[str, int, str]:
    try:
        sys.path.insert(0, AGENT_DIR)
        from guest import protocol

        return protocol.GUEST_ADDR, protocol.PREFIX_LEN, protocol.TAP_ADDR
    except Exception as exc:  # an image without the protocol module still boots
        log(f"guest.protocol unavailable ({exc!r}); using built-in addresses")
        return "169.254.0.21", 30, "169.254.0.22"


@dataclass(frozen=True)
class Config:
    address: str
    gateway: str
    iface: str = "eth0"
    dns: str = ""
    debug: bool = False

    @classmethod
    def from_cmdline(cls, cmdline: str, defaults: tuple[str, int, str]) -> Config:
        args = dict(arg.partition("=")[::2] for arg in cmdline.split())
        addr, prefix, gateway = defaults
        return cls(
            address=args.get("agentbox.ip") or f"{addr}/{prefix}",
            gateway=args.get("agentbox.gw") or gateway,
            iface=args.get("agentbox.iface") or "eth0",
            dns=args.get("agentbox.dns", ""),
            debug="agentbox.debug" in args and args["agentbox.debug"] in ("", "1", "yes"),
        )


def mount_all() -> None:
    for source, target, fstype, flags, options in MOUNTS:
        try:
            if target != "/proc" and _is_mounted(target):
                continue
            os.makedirs(target, exist_ok=True)
            if (
                _libc.mount(
                    source.encode(),
                    target.encode(),
                    fstype.encode(),
                    flags,
                    options.encode() or None,
                )
                != 0
            ):
                err = ctypes.get_errno()
                if err != 16:  # EBUSY: already mounted, fine
                    log(f"mount {target} ({fstype}) failed: {os.strerror(err)}")
        except OSError as exc:
            log(f"mount {target}: {exc}")
    for link, target in DEV_LINKS.items():
        if not os.path.lexists(link):
            _guard(os.symlink, target, link)


def _is_mounted(target: str) -> bool:
    try:
        with open("/proc/self/mounts") as f:
            return any(line.split()[1] == target for line in f)
    except OSError:
        return False


def _guard(fn, *args):  # type: ignore[no-untyped-def]
    try:
        return fn(*args)
    except Exception as exc:
        log(f"{getattr(fn, '__name__', fn)}{args}: {exc!r}")
        return None


def setup_system(cfg: Config) -> None:
    """Hostname, limits, networking; each step independent of the others' failure."""
    _guard(socket.sethostname, HOSTNAME)
    for path in ("/input", "/output"):  # relative uploads land in /input; see guest/outputs.py
        _guard(os.makedirs, path, 0o777, True)
    _guard(_libc.reboot, RB_DISABLE_CAD)  # ctrl-alt-del becomes SIGINT to us
    _guard(_raise_nofile)
    if cfg.dns:
        _guard(_write, "/etc/resolv.conf", f"nameserver {cfg.dns}\n")
    _guard(setup_network, cfg)


def _raise_nofile() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (65536, 65536))


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def setup_network(cfg: Config) -> None:
    for _ in range(40):  # virtio_net was loaded by the initramfs; probing may lag
        if os.path.exists(f"/sys/class/net/{cfg.iface}"):
            break
        time.sleep(0.05)
    else:
        log(f"no network interface {cfg.iface}; configuring loopback only")
    script = "link set lo up\n"
    if os.path.exists(f"/sys/class/net/{cfg.iface}"):
        script += (
            f"addr add {cfg.address} dev {cfg.iface}\n"
            f"link set {cfg.iface} up\n"
            f"route add default via {cfg.gateway} dev {cfg.iface}\n"
        )
    proc = subprocess.run(
        ["ip", "-force", "-batch", "-"],
        input=script.encode(),
        capture_output=True,
        env=ENV,
        timeout=20,
        check=False,
    )
    if proc.returncode != 0:
        log(f"ip failed: {proc.stderr.decode(errors='replace').strip()}")
    else:
        log(f"network: {cfg.iface} {cfg.address} via {cfg.gateway} (uptime {uptime()})")


class Supervisor:
    """When to (re)start the agent: a pure state machine, driven by the main loop.

    Backoff doubles from ``BASE`` to ``MAX`` seconds on each quick exit, and
    resets once a run lasted ``STABLE`` seconds, so a crash loop (agent not
    installed, import error) cannot spin the CPU while a rare crash restarts fast.
    """

    BASE, MAX, STABLE = 0.5, 30.0, 30.0

    def __init__(self) -> None:
        self.pid: int | None = None
        self.started_at = 0.0
        self.failures = 0
        self.next_start: float | None = 0.0  # start at once

    def due(self, now: float) -> bool:
        return self.pid is None and self.next_start is not None and now >= self.next_start

    def timeout(self, now: float) -> float | None:
        """Seconds until something is due (None: wait for a signal)."""
        if self.pid is not None or self.next_start is None:
            return None
        return max(0.0, self.next_start - now)

    def started(self, pid: int, now: float) -> None:
        self.pid, self.started_at = pid, now

    def exited(self, now: float) -> float:
        """Record the agent's exit; return the delay before the next start."""
        self.failures = 0 if now - self.started_at >= self.STABLE else self.failures + 1
        delay = min(self.MAX, self.BASE * 2 ** max(0, self.failures - 1))
        self.pid, self.next_start = None, now + delay
        return delay

    def stop(self) -> None:
        self.next_start = None


# Module-level so that a supervisor restarted after an unexpected error still
# knows the running agent instead of starting a second one.
SUPERVISOR = Supervisor()


def spawn_agent(debug: bool) -> int:
    """fork+exec the agent in its own session; output to the log (or console)."""
    if not debug:
        _guard(_rotate_log)
    pid = os.fork()
    if pid == 0:  # child: only async-signal-safe-ish work, then exec or _exit
        try:
            os.setsid()
            os.chdir(AGENT_DIR)
            out = (
                _console_fd
                if debug
                else os.open(AGENT_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            )
            null = os.open("/dev/null", os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(out, 1)
            os.dup2(out, 2)
            # Python ignores SIGPIPE; the agent and its children should not inherit that.
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            os.execve(AGENT_ARGV[0], AGENT_ARGV, ENV)
        finally:
            os._exit(127)
    return pid


def _rotate_log() -> None:
    if os.path.exists(AGENT_LOG) and os.path.getsize(AGENT_LOG) > LOG_ROTATE_BYTES:
        os.replace(AGENT_LOG, AGENT_LOG + ".1")


def _log_tail(lines: int = 6) -> str:
    try:
        with open(AGENT_LOG, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except OSError:
        return ""


def reap() -> list[tuple[int, int]]:
    """Collect every exited child (PID 1 inherits all orphans); return (pid, status)."""
    done = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done.append((pid, status))


def describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"


def shutdown() -> None:
    """Stop every process, flush the disk and power off (the VMM then exits)."""
    log("shutting down")
    _guard(os.kill, -1, signal.SIGTERM)
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        reap()
        if not _has_children():
            break
        time.sleep(0.05)
    try:
        os.kill(-1, signal.SIGKILL)
    except OSError:
        pass
    reap()
    os.sync()
    _libc.mount(b"none", b"/", None, MS_REMOUNT | MS_RDONLY, None)  # best effort
    os.sync()
    _libc.reboot(RB_POWER_OFF)
    log(f"power off failed: {os.strerror(ctypes.get_errno())}")


def _has_children() -> bool:
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        return True
    except ChildProcessError:
        return False


def supervise(cfg: Config) -> None:
    """The main loop: sleep in select() until a signal or a restart is due."""
    rfd, wfd = os.pipe()
    os.set_blocking(rfd, False)
    os.set_blocking(wfd, False)
    signal.set_wakeup_fd(wfd)  # each signal writes its number: no work in handlers
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)
    while True:
        try:
            _step(SUPERVISOR, cfg, rfd)
        except Exception:
            log("error in main loop:\n" + traceback.format_exc())
            time.sleep(1)


def _step(sup: Supervisor, cfg: Config, rfd: int) -> None:
    select.select([rfd], [], [], sup.timeout(time.monotonic()))
    try:
        signals = set(os.read(rfd, 512))
    except BlockingIOError:
        signals = set()
    for pid, status in reap():
        if pid == sup.pid:
            delay = sup.exited(time.monotonic())
            tail = "" if cfg.debug else _log_tail()
            log(
                f"agent exited ({describe(status)}); restarting in {delay:.1f}s"
                + (f"; last output:\n{tail}" if tail else "")
            )
    if signals & {signal.SIGTERM, signal.SIGINT}:
        sup.stop()
        shutdown()
    if sup.due(time.monotonic()):
        pid = spawn_agent(cfg.debug)
        sup.started(pid, time.monotonic())
        log(f"{MARKER.removeprefix('agentbox-init: ')} (pid {pid}, uptime {uptime()})")


def _open_console() -> None:
    global _console_fd
    try:
        _console_fd = os.open("/dev/console", os.O_WRONLY | os.O_NOCTTY)
    except OSError:
        _console_fd = 2


def main() -> None:
    os.environ.clear()
    os.environ.update(ENV)
    os.umask(0o022)
    mount_all()
    _open_console()
    log(f"starting (uptime {uptime()})")
    try:
        with open("/proc/cmdline") as f:
            cmdline = f.read()
    except OSError:
        cmdline = ""
    cfg = Config.from_cmdline(cmdline, _protocol_defaults())
    setup_system(cfg)
    supervise(cfg)


if __name__ == "__main__":
    if os.getpid() != 1:
        sys.exit("agentbox-init must run as PID 1 (it is the guest's init)")
    while True:  # returning or raising from PID 1 would panic the kernel
        try:
            main()
        except BaseException:
            log("fatal error, restarting the supervisor:\n" + traceback.format_exc())
            time.sleep(1)
