"""CLI for egress policies: ``create --egress/--allow/--deny`` and ``agentbox egress``."""

from __future__ import annotations

import argparse
from typing import Any


def add_rule_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--egress", choices=("deny_all", "allow_all"),
                        help="egress default (with --allow/--deny: the rest)")
    parser.add_argument("--allow", action="append", default=[], metavar="RULE",
                        help="allow a CIDR/address or domain (*.example.com); repeatable")
    parser.add_argument("--deny", action="append", default=[], metavar="RULE",
                        help="deny a CIDR/address or domain; wins over --allow; repeatable")


def policy(args: argparse.Namespace) -> str | dict[str, Any] | None:
    """The ``egress`` value the options describe (None: none given)."""
    if not args.allow and not args.deny:
        return args.egress
    return {"default": "allow" if args.egress == "allow_all" else "deny",
            "allow": args.allow, "deny": args.deny}


def add_commands(cmd: Any, command: Any) -> None:
    p = cmd("egress", command, "show or replace a sandbox's egress policy (applies at once)")
    p.add_argument("sandbox")
    add_rule_options(p)
