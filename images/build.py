"""``python -m images.build``: build (or confirm up to date) template images.

    python -m images.build                      # the default template (python)
    python -m images.build --template node
    python -m images.build --all --images-dir /var/lib/agentbox/images
    python -m images.build --list               # what is built, no building

Progress lines carry the elapsed time since the command started; stage ends
report their own duration. Exit status is non-zero if any build failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from images.catalog import DEFAULT_IMAGES_DIR, build_template, load_template
from images.templates import TEMPLATES


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m images.build", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--template", "-t", action="append", choices=TEMPLATES,
                       help="template to build (repeatable; default: python)")
    which.add_argument("--all", action="store_true", help="build every template")
    which.add_argument("--list", action="store_true", help="show built templates and exit")
    p.add_argument("--images-dir", type=Path, default=DEFAULT_IMAGES_DIR,
                   help=f"where templates live (default: {DEFAULT_IMAGES_DIR})")
    p.add_argument("--verbose", "-v", action="store_true", help="echo build command output")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.list:
        for name in TEMPLATES:
            image = load_template(name, args.images_dir)
            print(f"{name:20} {image.dir if image else '(not built)'}")
        return 0
    names = list(TEMPLATES) if args.all else (args.template or ["python"])
    start = time.monotonic()

    def progress(msg: str) -> None:
        print(f"{time.monotonic() - start:7.1f}s  {msg}", flush=True)

    failed = []
    for name in names:
        try:
            image = build_template(name, args.images_dir, progress, verbose=args.verbose)
        except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as exc:
            progress(f"[{name}] build failed: {exc}")
            failed.append(name)
            continue
        progress(f"[{name}] ready: {image.dir} (hash {image.hash})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
