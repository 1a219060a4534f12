"""Growing a sandbox's disk to the size it was created with.

A golden snapshot is saved with its template's disk (the rootfs size): one golden
per (vCPUs, RAM) serves every disk size. A sandbox asking for more gets its own
qcow2 overlay over that golden disk; after the restore, the overlay's virtual size
is raised with QMP ``block_resize``, which also tells the running guest (virtio-blk
config change: the kernel logs "new size" and updates /sys/block/vda/size), and the
guest's ext4 root is grown online with ``resize2fs``. The overlay stays sparse: only
blocks the guest writes take host space.

After that the size is the disk's own: a suspend's device state and a cold boot
both see the grown overlay and the grown file system, so nothing is repeated.
"""

from __future__ import annotations

from guest.protocol import ExecRequest
from vmctl.agent_client import AgentClient
from vmctl.disks import DiskError
from vmctl.driver import Driver

ROOT_DEVICE = "vda"  # the root disk both drivers give the guest (cmdline root=/dev/vda)
GROW_TIMEOUT_S = 120.0


def grow_command(size_bytes: int, device: str = ROOT_DEVICE) -> str:
    """Guest shell: wait for the kernel to see the new capacity, then grow the file system."""
    sectors = size_bytes // 512
    return (f"for i in $(seq 200); do [ \"$(cat /sys/block/{device}/size)\" -ge {sectors} ] "
            f"&& break; sleep 0.05; done; "
            f"[ \"$(cat /sys/block/{device}/size)\" -ge {sectors} ] || "
            f"{{ echo 'guest did not see the new disk size' >&2; exit 3; }}; "
            f"resize2fs /dev/{device} 2>&1")


async def grow(agent: AgentClient, driver: Driver | None, disk_mib: int) -> None:
    if driver is None:
        raise DiskError("cannot grow the disk: the VM is not running")
    size = disk_mib << 20
    await driver.resize_disk(size)
    res = await agent.execute(ExecRequest(command=grow_command(size), timeout=GROW_TIMEOUT_S))
    if res.exit_code != 0:
        raise DiskError(f"growing the guest's file system to {disk_mib} MiB failed: "
                        f"{(res.stderr or res.stdout)[-300:]}")
