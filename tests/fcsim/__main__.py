"""Run the simulator as a fake ``firecracker`` process.

    python -m tests.fcsim --api-sock PATH [--id ID] [other firecracker flags ignored]
    python -m tests.fcsim --version

Like the real binary: refuses to bind over an existing socket path, serves until
killed, and exits (status 1, socket left behind, as a crashed VMM leaves it)
after answering a failed snapshot load. FCSIM_VERSION overrides the version;
FCSIM_CHROOT (set by the fake jailer) is where absolute paths resolve.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from aiohttp import web

from tests.fcsim.server import DEFAULT_VERSION, Simulator, make_app


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="firecracker", allow_abbrev=False)
    parser.add_argument("--api-sock", default="/run/firecracker.socket")
    parser.add_argument("--id", default="anonymous-instance")
    parser.add_argument("--version", action="store_true")
    known, _ignored = parser.parse_known_args(argv)  # --seccomp-level, --start-time-us, ...
    return known


async def _serve(sock: str, version: str, instance_id: str) -> int:
    chroot = os.environ.get("FCSIM_CHROOT")
    sim = Simulator(version=version, instance_id=instance_id, cwd=Path.cwd(),
                    chroot=Path(chroot) if chroot else None)
    sock = str(sim.host_path(sock))
    if os.path.lexists(sock):
        print(f"Failed to open the API socket at {sock}: Address in use", flush=True)
        return 1
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()
    app = make_app(sim, on_fatal=lambda: done.done() or done.set_result(1))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.UnixSite(runner, sock).start()
    print(f"Running Firecracker v{version} (fcsim, no guest)", flush=True)
    code = await done
    print("Load snapshot failed: exiting", flush=True)
    await asyncio.sleep(0.05)  # let the 400 leave the socket buffer
    return code


def main(argv: list[str]) -> int:
    args = _args(argv)
    version = os.environ.get("FCSIM_VERSION", DEFAULT_VERSION)
    if args.version:
        print(f"Firecracker v{version}")
        return 0
    return asyncio.run(_serve(args.api_sock, version, args.id))


if __name__ == "__main__":
    # os._exit: no cleanup, so the API socket stays behind like after a real crash.
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)
