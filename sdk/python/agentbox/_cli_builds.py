"""``agentbox templates build -f Dockerfile -t NAME [CONTEXT]`` (added to the ``templates``
command by ``agentbox.client_cli``): streams the build log, exits 1 if the build fails."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from agentbox import _cli_output as out
from agentbox.client import AgentBox
from agentbox.exceptions import TemplateBuildError


def add_arguments(p: argparse.ArgumentParser) -> None:
    # One positional list: argparse cannot give two optional positionals around options.
    p.add_argument("words", nargs="*", metavar="ls | rm NAME... | build [CONTEXT]",
                   help="rm: templates to delete; build: the context directory (default .)")
    p.add_argument("-f", "--file", dest="dockerfile", help="build: the Dockerfile "
                                                           "(default CONTEXT/Dockerfile)")
    p.add_argument("-t", "--tag", dest="name", help="build: the template's name")
    p.add_argument("-q", "--quiet", action="store_true", help="build: no step output")


def action(args: argparse.Namespace) -> str:
    words = getattr(args, "words", None) or ["ls"]
    if words[0] not in ("ls", "build") or len(words) > (2 if words[0] == "build" else 1):
        raise SystemExit("agentbox: templates [ls] | templates rm NAME... | "
                         "templates build [-f FILE] -t NAME [CONTEXT]")
    args.context = words[1] if len(words) > 1 else "."
    return words[0]


def format_event(e: dict[str, Any], quiet: bool = False) -> str | None:
    kind = e.get("type")
    if kind == "step":
        return f"[{e['n']}/{e['of']}] {e.get('text', '')}" + ("  (cached)" if e.get("cached")
                                                              else "")
    if kind == "output" and not quiet:
        return str(e.get("text", "")).rstrip("\n")
    if kind == "step_done":
        return f"      done in {e.get('seconds')}s"
    if kind == "error":
        code = e.get("exit_code")
        return f"ERROR: {e.get('message')}" + (f" (exit code {code})" if code is not None else "")
    return None


def cmd_build(args: argparse.Namespace, box: AgentBox) -> int:
    if not args.name:
        raise SystemExit("agentbox: templates build needs -t NAME")

    def show(event: dict[str, Any]) -> None:
        line = None if args.json else format_event(event, args.quiet)
        if line:
            print(line, flush=True)

    try:
        build = box.builds.build(args.name, args.context, args.dockerfile, on_event=show)
    except TemplateBuildError as exc:
        if args.json:
            out.print_json(exc.build)
        print(f"agentbox: {exc}", file=sys.stderr)
        return 1
    if args.json:
        out.print_json(build)
    else:
        print(f"template {args.name!r} ready ({build.cached_steps}/{build.steps} steps cached)")
    return 0
