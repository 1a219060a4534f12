"""Builder microVMs: where a Dockerfile's untrusted steps run (never on the host).

A builder VM cold-boots the FROM template's kernel over a qcow2 disk that is an overlay of
the parent layer, in a sandbox-style network namespace (its own slot, confined VMM) whose
firewall has exactly one hole: TCP to the registry proxy
(gateway.builds.registry_proxy) on the slot's
host-side address. ``builder_vm`` yields a ``BuilderVM``; leaving it destroys the VMM, the
proxy and the namespace, also on error or cancellation.

Slots: golden builds use the top ``vmctl.golden.BUILD_SLOTS`` of the pool; builders use
the ``BUILDER_SLOTS`` below them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from gateway.builds.registry_proxy import RegistryProxy
from vmctl import network
from vmctl.agent_client import AgentClient
from vmctl.backend import Backend
from vmctl.disks import create_overlay
from vmctl.driver import Driver
from vmctl.egress import NS_IF
from vmctl.golden import BUILD_SLOTS
from vmctl.spec import VMSpec

BUILDER_SLOTS = 4


@dataclass(frozen=True)
class BootFiles:
    """What a builder VM boots, and its shape: that of the FROM template's golden snapshot,
    so the template it makes restores with the same vCPU count and RAM size."""

    kernel: Path
    initrd: Path | None
    cmdline: str
    mem_mib: int
    vcpus: int


@dataclass
class BuilderVM:
    agent: AgentClient
    driver: Driver
    workdir: Path
    disk: Path
    proxy_url: str
    proxy: RegistryProxy


def builder_ruleset(base: str, host_addr: str, port: int) -> str:
    """The sandbox ruleset (vmctl.egress.ruleset text) plus the one hole to the proxy:
    forward guest -> host_addr:port and masquerade it to the namespace's veth address."""
    hole = (f'    iifname "tap0" oifname "{NS_IF}" ip daddr {host_addr} tcp dport {port} '
            f'accept\n')
    masq = f'    oifname "{NS_IF}" ip daddr {host_addr} tcp dport {port} masquerade\n'
    forward_anchor = "    ct state established,related accept\n"
    post_anchor = "    type nat hook postrouting priority srcnat; policy accept;\n"
    if forward_anchor not in base or post_anchor not in base:
        raise RuntimeError("the sandbox ruleset changed shape; update builder_ruleset")
    out = base.replace(forward_anchor, forward_anchor + hole, 1)
    return out.replace(post_anchor, post_anchor + masq, 1)


async def _open_hole(slot: network.NetSlot, cfg: network.NetworkConfig, port: int) -> None:
    def load() -> None:
        base = network.nft_ruleset(slot, cfg.egress_policy(),
                                   network.host_facts(slot, cfg.pool))
        network._run(["ip", "netns", "exec", slot.netns, "nft", "-f", "-"],
                     builder_ruleset(base, slot.host_addr, port).encode())
    await asyncio.to_thread(load)


@contextlib.asynccontextmanager
async def builder_vm(backend: Backend, boot: BootFiles, parent_disk: Path, workdir: Path,
                     hosts: tuple[str, ...], slot_n: int = 0) -> AsyncIterator[BuilderVM]:
    """A running builder VM whose disk (``workdir/disk.qcow2``) is an overlay of
    ``parent_disk``; its writes stay in that file once the VM is gone."""
    vm_id = f"build-{uuid.uuid4().hex[:8]}"
    cfg = backend.config.network
    slot = network.slot_for(cfg.capacity - 1 - BUILD_SLOTS - slot_n % BUILDER_SLOTS, vm_id, cfg)
    workdir.mkdir(parents=True, exist_ok=True)
    disk = workdir / "disk.qcow2"
    await create_overlay(disk, parent_disk, backing_format=_fmt(parent_disk))
    driver = backend.new_driver()
    proxy = RegistryProxy(hosts)
    confinement = backend.confinement(slot.host_addr, vm_id, workdir / "vm", boot.mem_mib)
    agent: AgentClient | None = None
    try:
        await network.create(slot, cfg, tap_owner=(confinement.uid, confinement.gid)
                             if confinement else None)
        port = await proxy.start(slot.host_addr)
        await _open_hole(slot, cfg, port)
        spec = VMSpec(vm_id=vm_id, workdir=workdir / "vm", kernel=boot.kernel,
                      initrd=boot.initrd, cmdline=boot.cmdline, disk=disk,
                      mem_file=backend.layout.memory(workdir), mem_mib=boot.mem_mib,
                      vcpus=boot.vcpus, netns=slot.netns, accel=backend.accel,
                      confinement=confinement)
        (workdir / "vm").mkdir(exist_ok=True)
        await driver.boot(spec)
        agent = AgentClient(slot.guest_addr)
        await agent.wait_ready(backend.config.ready_timeout)
        yield BuilderVM(agent, driver, workdir, disk, f"http://{slot.host_addr}:{port}", proxy)
    finally:
        if agent is not None:
            await asyncio.shield(agent.aclose())
        await asyncio.shield(driver.destroy())
        await asyncio.shield(proxy.aclose())
        await asyncio.shield(network.destroy(slot))


def _fmt(path: Path) -> str:
    return "qcow2" if path.suffix == ".qcow2" else "raw"


def freeze(disk: Path, dest: Path) -> None:
    """Make a finished step's disk an immutable, root-owned layer at ``dest``."""
    os.chown(disk, 0, 0)
    os.chmod(disk, 0o444)
    os.replace(disk, dest)


def elapsed(start: float) -> float:
    return round(time.monotonic() - start, 1)
