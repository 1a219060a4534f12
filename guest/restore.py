"""What ``POST /init`` does after a snapshot restore: wall clock, entropy, env, identity.

A restored VM wakes with the clock and RNG state of the moment it was saved,
and every clone of one snapshot shares that RNG state. The host sends the real
time and fresh random bytes; we set the clock and mix the bytes into the
kernel pool. On a sandbox's first start the host also sends its own hostname and
machine-id (every clone of a snapshot would otherwise keep its source's): we set the
hostname and write /etc/machine-id. The system calls are injectable so tests never
touch the host.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from guest.errors import AgentError, BadRequest
from guest.protocol import InitRequest

RNDADDENTROPY = 0x40085203  # _IOW('R', 0x03, int[2]) from <linux/random.h>
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07): reseed the CRNG from the input pool now
MAX_ENTROPY_BYTES = 4096
MACHINE_ID_FILE = "/etc/machine-id"
_HOSTNAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_MACHINE_ID_RE = re.compile(r"^[0-9a-f]{32}$")


def set_realtime_ns(time_ns: int) -> None:
    time.clock_settime_ns(time.CLOCK_REALTIME, time_ns)


def add_entropy(data: bytes, ioctl: Callable[..., object] = fcntl.ioctl) -> None:
    """Mix ``data`` into the kernel pool, crediting it when we may (CAP_SYS_ADMIN), then
    make the CRNG reseed from the pool at once.

    Mixing alone is not enough: once initialised, the kernel (6.1) reseeds its CRNG only
    every 60 s or so, and until then every clone of one snapshot reads the *same* stream
    from getrandom()/urandom (measured: two sandboxes' first ``random.getrandbits(64)``
    were equal). ``RNDRESEEDCRNG`` (CAP_SYS_ADMIN) reseeds now."""
    with open("/dev/urandom", "wb", buffering=0) as f:
        try:
            info = struct.pack("ii", len(data) * 8, len(data)) + data
            ioctl(f.fileno(), RNDADDENTROPY, info)
        except OSError:
            f.write(data)  # uncredited, but it still makes clones' pools diverge
        try:
            ioctl(f.fileno(), RNDRESEEDCRNG)
        except OSError:
            pass  # not root: the next scheduled reseed picks the bytes up


def write_machine_id(machine_id: str, path: str = MACHINE_ID_FILE) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(machine_id + "\n")
    os.chmod(tmp, 0o444)
    os.replace(tmp, path)


@dataclass(frozen=True)
class SystemSetters:
    set_clock: Callable[[int], None] = set_realtime_ns
    add_entropy: Callable[[bytes], None] = add_entropy
    set_hostname: Callable[[str], None] = socket.sethostname
    set_machine_id: Callable[[str], None] = write_machine_id


def check(req: InitRequest) -> bytes:
    """Validate what ``InitRequest`` leaves unchecked; return the entropy bytes."""
    if isinstance(req.time_ns, bool) or not isinstance(req.time_ns, int) or req.time_ns <= 0:
        raise BadRequest("'time_ns' must be a positive integer (ns since the epoch)")
    if not isinstance(req.env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in req.env.items()
    ):
        raise BadRequest("'env' must map strings to strings")
    try:
        entropy = bytes.fromhex(req.entropy_hex)
    except (TypeError, ValueError) as exc:
        raise BadRequest("'entropy_hex' must be a hex string") from exc
    if len(entropy) > MAX_ENTROPY_BYTES:
        raise BadRequest(f"'entropy_hex' is limited to {MAX_ENTROPY_BYTES} bytes")
    if req.hostname and not (isinstance(req.hostname, str) and _HOSTNAME_RE.match(req.hostname)):
        raise BadRequest("'hostname' must be a DNS label")
    if req.machine_id and not (isinstance(req.machine_id, str)
                               and _MACHINE_ID_RE.match(req.machine_id)):
        raise BadRequest("'machine_id' must be 32 lower-case hex digits")
    return entropy


def apply(req: InitRequest, setters: SystemSetters, env: dict[str, str]) -> None:
    """Apply a checked InitRequest: ``env`` (the exec base env) is updated in place.

    Each step is tried even if an earlier one failed, so one missing privilege
    does not leave the rest undone; any failure is then reported as a 500.
    """
    entropy = check(req)
    env.update(req.env)
    failures = []
    if entropy:
        try:
            setters.add_entropy(entropy)
        except OSError as exc:
            failures.append(f"entropy: {exc}")
    try:
        setters.set_clock(req.time_ns)
    except OSError as exc:
        failures.append(f"clock: {exc}")
    for value, setter, what in ((req.hostname, setters.set_hostname, "hostname"),
                                (req.machine_id, setters.set_machine_id, "machine-id")):
        if value:
            try:
                setter(value)
            except OSError as exc:
                failures.append(f"{what}: {exc}")
    if failures:
        raise AgentError("init incomplete: " + "; ".join(failures))
