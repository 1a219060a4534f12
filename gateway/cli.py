"""``agentbox-server``: the daemon's command line (``serve``, ``keys``, ``images``, ``drain``).

The client commands (``agentbox create|ls|exec|...``) live in the SDK's own
distribution (``sdk/python``, ``agentbox.cli``); this module imports nothing
from it. Subcommands import the server packages they need lazily, so
``agentbox-server --help`` is fast.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path


def _server_commands(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="run the daemon in the foreground")
    serve.add_argument("--config", type=Path, help="TOML config file")
    serve.add_argument("--listen", help="HOST:PORT (default 127.0.0.1:8080)")
    serve.add_argument("--data-dir", type=Path, help="registry, sandboxes, admin.key")
    serve.add_argument("--images-dir", type=Path, help="built templates (default DATA_DIR/images)")
    serve.set_defaults(func=_cmd_serve)

    keys = sub.add_parser("keys", help="manage API keys (on this host's registry)")
    keys.add_argument("--config", type=Path)
    keys.add_argument("--data-dir", type=Path)
    ksub = keys.add_subparsers(dest="keys_cmd", required=True)
    create = ksub.add_parser("create", help="mint a key (printed once)")
    create.add_argument("--name", required=True)
    create.add_argument("--admin", action="store_true")
    _limit_flags(create)
    ksub.add_parser("ls", aliases=["list"], help="list keys and their limits")
    limit = ksub.add_parser("set", help="change a key's limits ('default' = the config's)")
    limit.add_argument("key_id")
    _limit_flags(limit)
    revoke = ksub.add_parser("revoke", help="revoke a key by id (its sandboxes stay: an "
                                            "admin lists them with ?tenant=KEY_ID)")
    revoke.add_argument("key_id")
    keys.add_argument("--json", action="store_true")
    keys.set_defaults(func=_cmd_keys)

    images = sub.add_parser("images", help="build templates and their golden snapshots")
    isub = images.add_subparsers(dest="images_cmd", required=True)
    build = isub.add_parser("build", help="build (cached by content hash)")
    build.add_argument("templates", nargs="*", help="default: the config's templates")
    build.add_argument("--config", type=Path)
    build.add_argument("--images-dir", type=Path)
    build.add_argument("--no-golden", action="store_true", help="skip the golden snapshot")
    gc = isub.add_parser("gc", help="delete old template builds no sandbox uses (dry run "
                                     "unless --apply)")
    gc.add_argument("--config", type=Path)
    gc.add_argument("--images-dir", type=Path)
    gc.add_argument("--data-dir", dest="data_dirs", type=Path, action="append", default=[],
                    help="a data dir whose sandboxes use these images (repeat for each "
                         "daemon sharing the images dir; default: the config's)")
    gc.add_argument("--apply", action="store_true", help="really delete")
    images.set_defaults(func=_cmd_images)

    drain = sub.add_parser("drain", help="move every sandbox off a fleet host (running ones by "
                                         "live migration, suspended ones by their shipped "
                                         "snapshot); placement skips it from now on")
    drain.add_argument("host", help="the host's [cluster] host name")
    drain.add_argument("--config", type=Path, help="a config with the fleet's [cluster]")
    drain.add_argument("--undo", action="store_true", help="unmark: the host takes sandboxes "
                                                           "again")
    drain.add_argument("--wait", type=float, default=600.0, metavar="SECONDS",
                       help="wait until the host is empty (no running or suspended sandbox "
                            "left on it), exit 1 after SECONDS saying what is left and why "
                            "(0: mark and exit)")
    drain.set_defaults(func=_cmd_drain)


def _load_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from gateway.config import load

    return load(getattr(args, "config", None), listen=getattr(args, "listen", None),
                data_dir=getattr(args, "data_dir", None),
                images_dir=getattr(args, "images_dir", None))


def _cmd_serve(args: argparse.Namespace) -> int:
    from gateway.http.app import serve

    serve(_load_config(args))
    return 0


_LIMITS = {"max_sandboxes": int, "max_awake": int, "max_disk_mib": int, "rate": float,
           "burst": int, "max_vcpus": int, "max_memory_mib": int, "max_sandbox_disk_mib": int}


def _limit_flags(parser: argparse.ArgumentParser) -> None:
    for name, kind in _LIMITS.items():
        parser.add_argument("--" + name.replace("_", "-"), dest=name, metavar="N",
                            type=lambda v, kind=kind: None if v == "default" else kind(v),
                            default=argparse.SUPPRESS, help=f"{kind.__name__}; 0 = no limit")


def _cmd_keys(args: argparse.Namespace) -> int:
    from gateway.tenancy import quotas
    from gateway.errors import ApiError
    from gateway.store.registry import Registry

    config = _load_config(args)
    config.server.data_dir.mkdir(parents=True, exist_ok=True)
    registry = Registry(config.server.data_dir / "registry.sqlite")
    changes = {name: getattr(args, name) for name in _LIMITS if hasattr(args, name)}
    try:
        limits = quotas.parse_overrides(changes)
        if args.keys_cmd == "create":
            key, secret = registry.create_key(args.name, admin=args.admin,
                                              limits=quotas.apply_overrides({}, limits))
            out = {"id": key.id, "name": key.name, "admin": key.admin, "key": secret}
            print(json.dumps(out) if args.json else f"{key.id} {key.name}\n{secret}")
        elif args.keys_cmd in ("ls", "list"):
            _print_keys(registry.list_keys(), config.tenancy.limits, args.json)
        elif args.keys_cmd == "set":
            key = registry.get_key(args.key_id)
            if key is None:
                print(f"no such key: {args.key_id}", file=sys.stderr)
                return 1
            registry.set_key_limits(key.id, quotas.apply_overrides(key.limits, limits))
            _print_keys([registry.get_key(key.id)], config.tenancy.limits, args.json)
        elif not registry.revoke_key(args.key_id):
            print(f"no such key: {args.key_id}", file=sys.stderr)
            return 1
    except ApiError as exc:  # a bad limit (gateway.tenancy.quotas.parse_overrides)
        print(f"agentbox-server keys: {exc}", file=sys.stderr)
        return 2
    finally:
        registry.close()
    return 0


def _print_keys(keys, defaults, as_json: bool) -> None:  # type: ignore[no-untyped-def]
    rows = [k.__dict__ | {"limits": defaults.merged(k.limits).as_dict(),
                          "overrides": k.limits} for k in keys]
    if as_json:
        print(json.dumps(rows))
        return
    for k in rows:
        limits = " ".join(f"{n}={v:g}" + ("*" if n in k["overrides"] else "")
                          for n, v in k["limits"].items())
        print(f"{k['id']}  {k['name']}{'  (admin)' if k['admin'] else ''}  {limits}")


def _cmd_images(args: argparse.Namespace) -> int:
    if args.images_cmd == "gc":
        return _cmd_images_gc(args)
    from images.catalog import build_template

    config = _load_config(args)
    names = args.templates or list(config.sandbox.templates)
    built = [build_template(n, config.server.images_dir) for n in names]
    if not args.no_golden:
        asyncio.run(_build_goldens(config, built))
    return 0


def _cmd_images_gc(args: argparse.Namespace) -> int:
    from gateway.templates import image_gc

    config = _load_config(args)
    gc = image_gc.plan(config.server.images_dir,
                       image_gc.in_use(args.data_dirs or [config.server.data_dir]))
    for build in gc.keep_in_use:
        print(f"keep (used by sandboxes): {build}")
    for build in gc.remove:
        print(f"{'removing' if args.apply else 'would remove'}: {build}")
    if args.apply:
        print(f"freed {image_gc.apply(gc) / 2**30:.1f} GiB")
    elif gc.remove:
        print("dry run: add --apply to delete")
    return 0


async def _build_goldens(config, images) -> None:  # type: ignore[no-untyped-def]
    from vmctl.backend import select
    from vmctl.golden import ensure_golden

    backend = (await select(config.vm, images[0].kernel)).for_daemon(config.server.images_dir)
    print(f"backend: {backend.driver_name}/{backend.accel.value} ({backend.reason})", flush=True)
    for i, image in enumerate(images):
        golden = await ensure_golden(image, backend, progress=lambda m: print(m, flush=True),
                                     build_slot=i)
        print(f"golden[{image.name}]: {golden.dir}", flush=True)


def _cmd_drain(args: argparse.Namespace) -> int:
    config = _load_config(args).cluster
    if not config.enabled:
        print("drain needs a config with [cluster] enabled (the fleet's etcd endpoints)",
              file=sys.stderr)
        return 2
    return asyncio.run(_drain(config, args.host, args.undo, args.wait))


async def _drain(config, host: str, undo: bool, wait: float) -> int:  # type: ignore[no-untyped-def]
    import time

    from gateway.cluster import drain
    from gateway.cluster.etcd import EtcdClient
    from gateway.cluster.ownership import Ownership
    from gateway.sandbox.states import State

    client = EtcdClient(config.endpoints, timeout=config.timeout)
    try:
        await drain.mark(client, config.keys, host, draining=not undo)
        print(f"{host}: {'unmarked' if undo else 'marked draining'}")
        if undo or wait <= 0:
            return 0
        ownership, deadline = Ownership(client, config.keys), time.monotonic() + wait
        first: dict[str, State] | None = None
        while True:
            _, records = await ownership.list()
            mine = {v.record.id: v.record for v in records.values() if v.record.host == host
                    and v.record.state is not State.DESTROYED}
            if first is None:
                first = {sid: r.state for sid, r in mine.items()}
            left = {sid: drain.why_left(r) for sid, r in mine.items()
                    if r.state is not State.FAILED}
            if not left:
                moved = [first[sid] for sid in first if sid not in mine]
                print(f"{host}: empty: {moved.count(State.RUNNING)} running and "
                      f"{moved.count(State.SUSPENDED)} suspended sandbox(es) moved off it "
                      f"(of {len(moved)} gone)")
                failed = sorted(sid for sid, r in mine.items() if r.state is State.FAILED)
                if failed:
                    print(f"{host}: {len(failed)} FAILED record(s) stay on its name (a drain "
                          f"does not move them): {', '.join(failed[:20])}")
                return 0
            if time.monotonic() > deadline:
                print(f"{host}: not empty after {wait:g}s; {len(left)} sandbox(es) left:",
                      file=sys.stderr)
                for sid, why in sorted(left.items())[:50]:
                    print(f"  {sid}: {why}", file=sys.stderr)
                return 1
            await asyncio.sleep(1.0)
    finally:
        await client.aclose()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentbox-server",
                                     description="the AgentBox daemon and its host-side tools "
                                                 "(the client CLI is `agentbox`, from the SDK)")
    sub = parser.add_subparsers(dest="command", required=True)
    _server_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
