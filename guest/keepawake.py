#!/usr/bin/python3
"""agentbox-keepawake: keep this sandbox from being suspended while something runs.

Usage:
  agentbox-keepawake CMD [ARGS...]   hold a veto while CMD runs (CMD replaces this process)
  agentbox-keepawake --hold [NAME]    hold a named veto until released (default NAME: default)
  agentbox-keepawake --release [NAME] release it
  agentbox-keepawake --status         print the number of vetoes held

Installed into images as /usr/local/bin/agentbox-keepawake; the guest agent
imports :func:`count_vetoes` from here, so this file is the one owner of the
veto directory's format. Stdlib only: it runs on the guest's python3.

Format: one file per veto in ``VETO_DIR`` (env ``AGENTBOX_KEEPAWAKE_DIR``).
``<pid>`` holds that process's start time (field 22 of /proc/PID/stat), so a
recycled pid is not mistaken for the holder; the veto lasts while that process
lives. ``hold-<NAME>`` is held until removed. Names starting with ``.`` are
files being written and are ignored.
"""

from __future__ import annotations

import os
import sys

DEFAULT_DIR = "/run/agentbox/keepawake"
ENV_DIR = "AGENTBOX_KEEPAWAKE_DIR"
HOLD_PREFIX = "hold-"


def veto_dir() -> str:
    return os.environ.get(ENV_DIR) or DEFAULT_DIR


def ensure_dir(path: str) -> None:
    os.makedirs(path, exist_ok=True)
    try:
        os.chmod(path, 0o1777)  # like /tmp: any user may hold a veto, none may drop another's
    except PermissionError:
        pass  # made by root already; not ours to change


def start_time(pid: int) -> str | None:
    """The start time of a live (non-zombie) ``pid``, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()  # the command name may hold spaces and ')'
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _write(path: str, name: str, content: str) -> None:
    tmp = os.path.join(path, f".{name}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(content)
    os.rename(tmp, os.path.join(path, name))  # readers never see a half-written veto


def register(path: str, pid: int) -> None:
    ensure_dir(path)
    _write(path, str(pid), start_time(pid) or "")


def hold(path: str, name: str) -> None:
    ensure_dir(path)
    _write(path, HOLD_PREFIX + name, "")


def release(path: str, name: str) -> bool:
    try:
        os.unlink(os.path.join(path, HOLD_PREFIX + name))
        return True
    except FileNotFoundError:
        return False


def _alive(path: str, name: str) -> bool:
    try:
        with open(os.path.join(path, name)) as f:
            recorded = f.read().strip()
    except OSError:
        return False
    return start_time(int(name)) == recorded


def count_vetoes(path: str, clean: bool = True) -> int:
    """Held vetoes: named holds plus registered pids still alive (stale files removed)."""
    try:
        names = os.listdir(path)
    except OSError:
        return 0
    count = 0
    for name in names:
        if name.startswith(HOLD_PREFIX):
            count += 1
        elif name.isdigit():
            if _alive(path, name):
                count += 1
            elif clean:
                try:
                    os.unlink(os.path.join(path, name))
                except OSError:
                    pass  # raced with another cleaner
    return count


def main(argv: list[str]) -> int:
    path = veto_dir()
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 0 if argv else 2
    if argv[0] in ("--hold", "--release"):
        name = argv[1] if len(argv) > 1 else "default"
        if "/" in name or not name:
            print("agentbox-keepawake: NAME must not contain '/'", file=sys.stderr)
            return 2
        if argv[0] == "--hold":
            hold(path, name)
            return 0
        return 0 if release(path, name) else 1
    if argv[0] == "--":
        argv = argv[1:]
        if not argv:
            return 2
    elif argv[0] == "--status":
        print(count_vetoes(path, clean=False))
        return 0
    register(path, os.getpid())
    try:
        # exec keeps our pid and start time, so the veto is exactly CMD's lifetime.
        os.execvp(argv[0], argv)
    except OSError as exc:
        os.unlink(os.path.join(path, str(os.getpid())))
        print(f"agentbox-keepawake: {argv[0]}: {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
