"""A fake ``jailer`` for tests: checks the arguments the real one checks, builds
``<chroot-base-dir>/<exec name>/<id>/root``, and execs the exec file there with
FCSIM_CHROOT set, so the simulator resolves absolute paths inside the jail.

Not emulated: pivot_root/mount namespace, dropping to --uid/--gid, cgroups,
--netns (rejected unless the namespace file exists), copying the binary into
the jail, /dev/kvm and /dev/net/tun nodes.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    cut = argv.index("--") if "--" in argv else len(argv)
    own, extra = argv[:cut], argv[cut + 1:]  # after "--": arguments for firecracker
    parser = argparse.ArgumentParser(prog="jailer", allow_abbrev=False)
    for name in ("--id", "--exec-file", "--uid", "--gid"):
        parser.add_argument(name, required=True)
    parser.add_argument("--chroot-base-dir", default="/srv/jailer")
    parser.add_argument("--cgroup-version", choices=("1", "2"), default="1")
    parser.add_argument("--netns")
    parser.add_argument("--parent-cgroup")
    parser.add_argument("--cgroup", action="append", default=[])
    parser.add_argument("--resource-limit", action="append", default=[])
    args = parser.parse_args(own)
    if not re.fullmatch(r"[A-Za-z0-9-]{1,64}", args.id):
        return _fail(f"invalid id {args.id!r}")
    exec_file = Path(args.exec_file)
    if not (exec_file.is_absolute() and exec_file.is_file() and "firecracker" in exec_file.name):
        return _fail(f"invalid exec file {exec_file}")
    netns = Path(args.netns) if args.netns else None
    if netns is not None and os.environ.get("FCSIM_NETNS_DIR"):  # tests' fake namespaces
        netns = Path(os.environ["FCSIM_NETNS_DIR"]) / netns.name
    if netns is not None and not netns.exists():
        return _fail(f"cannot open netns {args.netns}")
    if any("=" not in c for c in args.cgroup + args.resource_limit):
        return _fail("cgroup and resource-limit values must be NAME=VALUE")
    root = Path(args.chroot_base_dir) / exec_file.name / args.id / "root"
    root.mkdir(parents=True, exist_ok=True)
    os.chdir(root)
    os.environ["FCSIM_CHROOT"] = str(root)
    os.execv(exec_file, [str(exec_file), "--id", args.id, *extra])
    return 1


def _fail(message: str) -> int:
    print(f"jailer: {message}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
