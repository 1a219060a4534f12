"""``agentbox session put|get|ls|rm``: named long-lived sessions from the command line
(added to the client CLI by ``agentbox.client_cli``; same ``--json`` and error rules)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from agentbox import _cli_output as out
from agentbox.client_cli import Command, _client, _pairs
from agentbox.models import Session


def add_commands(session: argparse.ArgumentParser, common: argparse.ArgumentParser,
                 wrap: Callable[[Command], Command]) -> None:
    sub = session.add_subparsers(dest="session_command", metavar="{put,get,ls,rm}",
                                 required=True)

    def cmd(name: str, func: Command, help: str) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, parents=[common], help=help, description=help)
        parser.set_defaults(func=wrap(func))
        return parser

    p = cmd("put", cmd_put, "create a session unless it exists; print it")
    p.add_argument("name")
    p.add_argument("template", nargs="?", help="template (default: the server's)")
    p.add_argument("--port", type=int, help="the app's port in the sandbox (default 8000)")
    p.add_argument("--start", metavar="CMD", help="shell command run once, in the background, "
                                                  "when the session's sandbox is created")
    p.add_argument("--idle-timeout", type=float, help="seconds idle before suspend (0 = never)")
    p.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE")
    cmd("get", cmd_get, "show a session").add_argument("name")
    cmd("ls", cmd_ls, "list sessions")
    cmd("rm", cmd_rm, "delete sessions (and their sandboxes)").add_argument("names", nargs="+")


def _show(session: Session, as_json: bool) -> None:
    if as_json:
        out.print_json(session)
        return
    for key, value in out.to_jsonable(session).items():
        print(f"{key:14} {'-' if value is None else value}")


def cmd_put(args: argparse.Namespace) -> int:
    with _client(args) as box, out.Spinner(f"putting session {args.name}"):
        session = box.sessions.put(args.name, args.template, port=args.port,
                                   idle_timeout=args.idle_timeout, start=args.start,
                                   metadata=_pairs(args.metadata, "--metadata") or None)
    _show(session, args.json)
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    with _client(args) as box:
        session = box.sessions.get(args.name)
    _show(session, args.json)
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    with _client(args) as box:
        sessions = box.sessions.list()
    if args.json:
        out.print_json(sessions)
        return 0
    out.table([(s.name, s.state, s.port, s.start_state, s.sandbox_id, s.url) for s in sessions],
              ("NAME", "STATE", "PORT", "START", "SANDBOX", "URL"))
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    with _client(args) as box:
        return out.remove_each(args.names, box.sessions.delete, "session", args.json)
