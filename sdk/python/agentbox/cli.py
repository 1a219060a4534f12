"""The ``agentbox`` command line (the SDK's client CLI; also ``python -m agentbox``).

Commands are in ``agentbox.client_cli``. The daemon's own commands (``serve``,
``keys``, ``images``) are ``agentbox-server``, shipped with the server, not here.
"""

from __future__ import annotations

import argparse
import sys

from agentbox import client_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentbox", description="AgentBox microVM sandboxes "
                                     "(client; the daemon is `agentbox-server`)")
    sub = parser.add_subparsers(dest="command", required=True)
    client_cli.add_commands(sub)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Like ``parse_args``, except that a command with a ``words`` list (``templates``) also
    takes positionals after its options (``templates build -t NAME CONTEXT``), which
    argparse cannot match to optional positionals on its own."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not isinstance(getattr(args, "words", None), list):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.words = [*args.words, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ImportError as exc:
        if "pip install" not in str(exc):  # ours, naming the missing extra; else a bug
            raise
        print(f"agentbox: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
