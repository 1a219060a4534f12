"""Client commands of the ``agentbox`` CLI (``agentbox.cli``; the daemon's
``serve``/``keys``/``images`` are ``agentbox-server``, on the server side):

    create, ls, info, exec, run, cp, shell, url, suspend, resume, rm, templates, mcp,
    session put|get|ls|rm (in ``agentbox._cli_sessions``)

Human output by default, one JSON document with ``--json``. The key and URL come
from ``--api-key``/``--url``, else ``AGENTBOX_API_KEY``/``AGENTBOX_URL``. Exit
status: 0 ok; 1 an API error (printed to stderr); for ``exec``/``shell`` the
remote command's exit status; for ``run`` 1 if the code raised.
"""

from __future__ import annotations

import argparse
import functools
import shlex
import sys
import time
from collections.abc import Callable
from typing import Any

from agentbox import _cli_output as out
from agentbox.client import AgentBox
from agentbox.exceptions import AgentBoxError, EndpointNotFoundError
from agentbox.models import CommandResult, Execution, ExecResult

Command = Callable[[argparse.Namespace], int]


def add_commands(sub: argparse._SubParsersAction) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--api-key", help="API key (default: $AGENTBOX_API_KEY)")
    common.add_argument("--url", help="server URL (default: $AGENTBOX_URL or "
                                      "http://127.0.0.1:8080)")
    common.add_argument("--json", action="store_true", help="print JSON for scripts")

    def cmd(name: str, func: Command, help: str) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, parents=[common], help=help, description=help)
        parser.set_defaults(func=_api_errors(func))
        return parser

    p = cmd("create", cmd_create, "create a sandbox and print its id")
    p.add_argument("template", nargs="?", default="python", help="template (default python)")
    p.add_argument("--idle-timeout", type=float, help="seconds idle before suspend (0 = never)")
    p.add_argument("--metadata", action="append", default=[], metavar="KEY=VALUE")
    cmd("ls", cmd_ls, "list sandboxes")
    cmd("info", cmd_info, "show a sandbox").add_argument("sandbox")
    p = cmd("exec", cmd_exec, "run a shell command in a sandbox")
    p.add_argument("sandbox")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="command (and arguments)")
    _run_options(p)
    p = cmd("run", cmd_run, "run code in a sandbox's stateful interpreter")
    p.add_argument("sandbox")
    p.add_argument("file", nargs="?", help="file with the code ('-' = stdin)")
    p.add_argument("-c", "--code", help="the code itself")
    p.add_argument("--language", default="python")
    p.add_argument("--context", help="interpreter context (default: the default one)")
    p.add_argument("--timeout", type=float)
    p.add_argument("--save-images", metavar="DIR", help="write image results into DIR")
    p = cmd("cp", cmd_cp, "copy a file: cp LOCAL SBX:/path, or cp SBX:/path LOCAL "
                          "('-' = stdin/stdout)")
    p.add_argument("src")
    p.add_argument("dst")
    p = cmd("shell", cmd_shell, "open an interactive terminal in a sandbox")
    p.add_argument("sandbox")
    p = cmd("url", cmd_url, "print the preview URL of a port in a sandbox")
    p.add_argument("sandbox")
    p.add_argument("port", type=int)
    p.add_argument("--token", action="store_true",
                   help="append ?token= (the preview token) so a browser can open a private port")
    from agentbox import _cli_sessions  # imports this module's helpers

    _cli_sessions.add_commands(sub.add_parser("session", help="named long-lived sessions",
                                              description="named long-lived sessions"),
                               common, _api_errors)
    cmd("suspend", cmd_suspend, "snapshot a sandbox and stop its VM").add_argument("sandbox")
    cmd("resume", cmd_resume, "wake a suspended sandbox").add_argument("sandbox")
    cmd("rm", cmd_rm, "delete sandboxes").add_argument("sandboxes", nargs="+")
    from agentbox import _cli_builds

    _cli_builds.add_arguments(cmd("templates", cmd_templates, "list templates (ls), or build "
                                  "one from a Dockerfile: build -f FILE -t NAME [CONTEXT]"))
    p = cmd("mcp", cmd_mcp, "serve the sandbox tools over MCP (stdio)")
    p.add_argument("--template", default="python", help="template of the session's sandbox")
    p.add_argument("--sandbox", help="use this existing sandbox instead of creating one")
    p.add_argument("--keep", action="store_true", help="do not delete the sandbox at exit")


def _run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=float, help="kill after this many seconds")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--cwd", help="working directory in the sandbox")


def _api_errors(func: Command) -> Command:
    @functools.wraps(func)
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except AgentBoxError as exc:
            if getattr(args, "json", False):
                out.print_json({"error": {"code": exc.code, "message": exc.message,
                                          "status": exc.status}}, sys.stderr)
            else:
                print(f"agentbox: {exc}", file=sys.stderr)
            return 1
    return wrapper


def _client(args: argparse.Namespace) -> AgentBox:
    return AgentBox(api_key=args.api_key, base_url=args.url)


def _pairs(items: list[str], what: str) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"agentbox: {what} must be KEY=VALUE, not {item!r}")
        pairs[key] = value
    return pairs


# -- sandboxes -----------------------------------------------------------------------------

def cmd_create(args: argparse.Namespace) -> int:
    with _client(args) as box, out.Spinner(f"creating a {args.template} sandbox"):
        start = time.monotonic()
        sandbox = box.create(args.template, idle_timeout=args.idle_timeout,
                             metadata=_pairs(args.metadata, "--metadata") or None, keep=True)
    if args.json:
        out.print_json(sandbox.info)
    else:
        print(sandbox.id)
        print(f"created {sandbox.info.template} sandbox {sandbox.id} in "
              f"{time.monotonic() - start:.1f}s", file=sys.stderr)
    return 0


def cmd_ls(args: argparse.Namespace) -> int:
    with _client(args) as box:
        sandboxes = box.list()
    if args.json:
        out.print_json(sandboxes)
        return 0
    out.table([(s.id, s.state, s.template, _idle(s.idle_timeout), out.age(s.created_at),
                out.age(s.last_activity)) for s in sandboxes],
              ("ID", "STATE", "TEMPLATE", "IDLE", "CREATED", "ACTIVE"))
    return 0


def _idle(seconds: float | None) -> str:
    return "-" if seconds is None else ("never" if seconds == 0 else f"{seconds:g}s")


def cmd_info(args: argparse.Namespace) -> int:
    with _client(args) as box:
        info = box.get(args.sandbox)
    if args.json:
        out.print_json(info)
    else:
        for key, value in out.to_jsonable(info).items():
            print(f"{key:16} {value}")
    return 0


def cmd_suspend(args: argparse.Namespace) -> int:
    return _transition(args, "suspend")


def cmd_resume(args: argparse.Namespace) -> int:
    return _transition(args, "resume")


def _transition(args: argparse.Namespace, action: str) -> int:
    with _client(args) as box, out.Spinner(f"{action[:-1]}ing {args.sandbox}"):
        start = time.monotonic()
        sandbox = box.connect(args.sandbox)
        info = sandbox.suspend() if action == "suspend" else sandbox.resume()
    if args.json:
        out.print_json(info)
    else:
        print(f"{info.id} {info.state} ({time.monotonic() - start:.2f}s)")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    with _client(args) as box:
        return out.remove_each(args.sandboxes, box.kill, "sandbox", args.json)


def cmd_templates(args: argparse.Namespace) -> int:
    from agentbox import _cli_builds

    if _cli_builds.action(args) == "build":
        with _client(args) as box:
            return _cli_builds.cmd_build(args, box)
    with _client(args) as box:
        templates = box.templates()
    if args.json:
        out.print_json(templates)
    else:
        out.table([(t.name, t.mem_mib, "yes" if t.default else "") for t in templates],
                  ("NAME", "MEM_MIB", "DEFAULT"))
    return 0


def cmd_url(args: argparse.Namespace) -> int:
    with _client(args) as box:
        url = box.connect(args.sandbox).get_url(args.port, with_token=args.token)
    out.print_json({"url": url}) if args.json else print(url)
    return 0


# -- running things ----------------------------------------------------------------------------

def cmd_exec(args: argparse.Namespace) -> int:
    argv = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not argv:
        raise SystemExit("agentbox: exec needs a command")
    command = argv[0] if len(argv) == 1 else shlex.join(argv)
    env = _pairs(args.env, "--env") or None
    result: ExecResult | CommandResult
    with _client(args) as box:
        sandbox = box.connect(args.sandbox)
        if args.json:
            result = sandbox.execute(command=command, timeout=args.timeout, env=env,
                                     cwd=args.cwd)
            out.print_json(result)
            return result.exit_code
        try:
            result = sandbox.commands.run(command, env=env, cwd=args.cwd, timeout=args.timeout,
                                          on_stdout=_writer(sys.stdout),
                                          on_stderr=_writer(sys.stderr))
        except EndpointNotFoundError:  # a server without /commands
            result = sandbox.execute(command=command, timeout=args.timeout, env=env,
                                     cwd=args.cwd)
            _writer(sys.stdout)(result.stdout)
            _writer(sys.stderr)(result.stderr)
    if result.timed_out:
        print("agentbox: the command timed out and was killed", file=sys.stderr)
    return result.exit_code if 0 <= result.exit_code < 256 else 128 + abs(result.exit_code)


def _writer(stream: Any) -> Callable[[str], None]:
    def write(data: str) -> None:
        stream.write(data)
        stream.flush()
    return write


def cmd_run(args: argparse.Namespace) -> int:
    code = _code_arg(args)
    with _client(args) as box:
        sandbox = box.connect(args.sandbox)
        if args.json:
            execution = sandbox.run_code(code, args.language, args.context, timeout=args.timeout)
            out.print_json(execution)
        else:
            execution = sandbox.run_code(
                code, args.language, args.context, timeout=args.timeout,
                on_stdout=_writer(sys.stdout), on_stderr=_writer(sys.stderr),
                on_result=lambda r: None, on_error=lambda e: None)
            _show_results(execution, args.save_images)
    if args.save_images and args.json:
        _show_results(execution, args.save_images, quiet=True)
    return 1 if execution.error else 0


def _code_arg(args: argparse.Namespace) -> str:
    if args.code is not None:
        return str(args.code)
    if args.file in (None, "-"):
        return sys.stdin.read()
    with open(args.file, encoding="utf-8") as f:
        return f.read()


def _show_results(execution: Execution, save_dir: str | None, quiet: bool = False) -> None:
    from pathlib import Path

    for i, result in enumerate(execution.results):
        image = result.image_bytes()
        if image is not None and save_dir:
            ext = "png" if result.png else "jpg"
            path = Path(save_dir) / f"result-{execution.execution_count or 0}-{i}.{ext}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(image)
            if not quiet:
                print(f"[image saved to {path}]", file=sys.stderr)
        elif image is not None and not quiet:
            print(f"[image result, {len(image)} bytes: use --save-images DIR]", file=sys.stderr)
        elif result.text is not None and not quiet:
            print(result.text)
    if execution.error and not quiet:
        print(execution.error.traceback or str(execution.error), file=sys.stderr)


def cmd_shell(args: argparse.Namespace) -> int:
    import asyncio

    from agentbox.terminal import require_aiohttp, run_terminal

    require_aiohttp()  # before connecting: say which extra is missing first
    with _client(args) as box:
        sandbox = box.connect(args.sandbox)
        url, key = sandbox.terminal_url(), box.config.api_key
    return asyncio.run(run_terminal(url, key))


def cmd_cp(args: argparse.Namespace) -> int:
    from agentbox._cli_copy import copy

    with _client(args) as box:
        result = copy(box, args.src, args.dst, show_progress=not args.json)
    if args.json:
        out.print_json(result)
    return 0


def cmd_mcp(args: argparse.Namespace) -> int:
    from agentbox.tools.mcp_server import serve

    serve(api_key=args.api_key, base_url=args.url, template=args.template,
          sandbox_id=args.sandbox, keep=args.keep)
    return 0
