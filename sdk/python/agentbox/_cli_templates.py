"""``agentbox templates [ls] | rm NAME... | build [-f FILE] -t NAME [CONTEXT]``,
``agentbox snapshot SBX NAME``,
``agentbox fork SBX [-n N]`` (added to the CLI by ``agentbox.client_cli``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from agentbox import _cli_builds
from agentbox import _cli_output as out
from agentbox.client import AgentBox
from agentbox.exceptions import TemplateNotFoundError

AddCommand = Callable[..., argparse.ArgumentParser]


def add_commands(cmd: AddCommand) -> None:
    p = cmd("templates", cmd_templates, "list templates (ls), delete the key's own (rm NAME...), "
            "or build one from a Dockerfile (build -f FILE -t NAME [CONTEXT])")
    _cli_builds.add_arguments(p)
    p = cmd("snapshot", cmd_snapshot, "save a sandbox (memory, processes, files) as a template")
    p.add_argument("sandbox")
    p.add_argument("name", help="the new template's name")
    p = cmd("fork", cmd_fork, "make N new sandboxes in a sandbox's current state")
    p.add_argument("sandbox")
    p.add_argument("-n", "--count", type=int, default=1)


def _client(args: argparse.Namespace) -> AgentBox:
    return AgentBox(api_key=args.api_key, base_url=args.url)


def cmd_templates(args: argparse.Namespace) -> int:
    words = args.words or ["ls"]
    with _client(args) as box:
        if words[0] == "rm":
            if len(words) < 2:
                raise SystemExit("agentbox: templates rm needs a NAME")
            return out.remove_each(words[1:], lambda n: _delete(box, n), "template", args.json)
        if _cli_builds.action(args) == "build":
            return _cli_builds.cmd_build(args, box)
        templates = box.templates.list()
    if args.json:
        out.print_json(templates)
    else:
        out.table([(t.name, t.owner, t.source, t.state, t.mem_mib, "yes" if t.default else "")
                   for t in templates], ("NAME", "OWNER", "SOURCE", "STATE", "MEM_MIB",
                                         "DEFAULT"))
    return 0


def _delete(box: AgentBox, name: str) -> bool:
    try:
        box.templates.delete(name)
    except TemplateNotFoundError:
        return False
    return True


def cmd_snapshot(args: argparse.Namespace) -> int:
    with _client(args) as box:
        template = box.connect(args.sandbox).snapshot(args.name)
    if args.json:
        out.print_json(template)
    else:
        print(f"{template.name} (sandbox paused {template.paused_ms or 0:.0f} ms)")
    return 0


def cmd_fork(args: argparse.Namespace) -> int:
    with _client(args) as box:
        forks: list[Any] = box.connect(args.sandbox).fork(args.count, keep=True)
    if args.json:
        out.print_json([f.info for f in forks])
    else:
        for f in forks:
            print(f.id)
    return 0
