"""The ``agentbox`` command line.

Server-side commands (``serve``, ``keys``, ``images``) import the daemon's
packages lazily, so the client commands and the SDK never depend on them.
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
    ksub.add_parser("list", help="list keys")
    revoke = ksub.add_parser("revoke", help="revoke a key by id")
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


def _load_config(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from gateway.config import load

    return load(getattr(args, "config", None), listen=getattr(args, "listen", None),
                data_dir=getattr(args, "data_dir", None),
                images_dir=getattr(args, "images_dir", None))


def _cmd_serve(args: argparse.Namespace) -> int:
    from gateway.app import serve

    serve(_load_config(args))
    return 0


def _cmd_keys(args: argparse.Namespace) -> int:
    from gateway.registry import Registry

    config = _load_config(args)
    config.server.data_dir.mkdir(parents=True, exist_ok=True)
    registry = Registry(config.server.data_dir / "registry.sqlite")
    try:
        if args.keys_cmd == "create":
            key, secret = registry.create_key(args.name, admin=args.admin)
            out = {"id": key.id, "name": key.name, "admin": key.admin, "key": secret}
            print(json.dumps(out) if args.json else f"{key.id} {key.name}\n{secret}")
        elif args.keys_cmd == "list":
            rows = [k.__dict__ for k in registry.list_keys()]
            if args.json:
                print(json.dumps(rows))
            for k in rows if not args.json else []:
                print(f"{k['id']}  {k['name']}{'  (admin)' if k['admin'] else ''}")
        elif not registry.revoke_key(args.key_id):
            print(f"no such key: {args.key_id}", file=sys.stderr)
            return 1
    finally:
        registry.close()
    return 0


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
    from gateway import image_gc

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentbox", description="AgentBox microVM sandboxes")
    sub = parser.add_subparsers(dest="command", required=True)
    _server_commands(sub)
    try:
        from agentbox import client_cli
    except ImportError:
        pass
    else:
        client_cli.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
