"""Generate the sync SDK modules from their asyncio sources (the unasync approach, as in
encode/httpcore): one description of the behaviour, two APIs.

    python sdk/python/gen_sync.py          # rewrite the generated modules
    python sdk/python/gen_sync.py --check  # exit 1 if one differs (tests/unit/test_sdk_unasync.py)

Each rule is a plain text or regex substitution, applied line by line; the async source is
written so that they suffice (``contextlib.aclosing`` around async generators, for
instance, becomes ``contextlib.closing`` around generators). Markers in the async source:
a line ending in ``# unasync: drop`` is left out of the sync module; a comment line
``# unasync: add CODE`` is ``CODE`` there (and only there).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent / "agentbox"
# async source -> generated sync module (in agentbox/)
MODULES = {"async_commands.py": "commands.py", "async_sandbox.py": "sandbox.py",
           "async_client.py": "client.py", "async_files.py": "files.py",
           "async_sessions.py": "sessions.py", "async_builds.py": "builds.py"}

_RULES: list[tuple[str, str]] = [
    # (await x.f()).attr -> x.f().attr; not a call's own parentheses: g(await x.f())
    (r"(?<![\w)\]])\(await ([\w.]+\([^()]*\))\)", r"\1"),
    (r"\basync def\b", "def"),
    (r"\basync with\b", "with"),
    (r"\basync for\b", "for"),
    (r"\bawait ", ""),
    (r"\bcontextlib\.aclosing\(", "contextlib.closing("),
    (r"\bAsyncGenerator\[(\w+), None\]", r"Generator[\1, None, None]"),
    (r"\bAsyncGenerator\b", "Generator"),
    (r"\bAsyncIterator\b", "Iterator"),
    (r"\b__aiter__\b", "__iter__"),
    (r"\b__anext__\b", "__next__"),
    (r"\b__aenter__\b", "__enter__"),
    (r"\b__aexit__\b", "__exit__"),
    (r"\baclose\b", "close"),
    (r"\bStopAsyncIteration\b", "StopIteration"),
    (r"\bAbstractAsyncContextManager\b", "AbstractContextManager"),
    (r"\baread\(", "read("),
    (r"\baiter_bytes\(", "iter_bytes("),
    (r"\bAsyncTransport\b", "SyncTransport"),
    (r"\bAsync(\w+)", r"\1"),  # AsyncCommandHandle -> CommandHandle, AsyncSandbox -> Sandbox
    (r"\basyncio\.sleep\(", "time.sleep("),
    (r"^import asyncio$", "import time"),
    (r", maybe_await\b", ""),
    (r"\bagentbox\.async_(\w+)", r"agentbox.\1"),
    (r"\bused from asyncio\b", "used synchronously"),  # docstrings
]
_ADD = re.compile(r"^(\s*)# unasync: add (.*)$")
_COMPILED = [(re.compile(pattern), repl) for pattern, repl in _RULES]


def _strip_call(line: str, name: str) -> str:
    """``name(X)`` -> ``X`` (parentheses balanced), for every occurrence in ``line``."""
    while (start := line.find(name + "(")) != -1:
        depth, i = 0, start + len(name)
        for i in range(start + len(name), len(line)):
            depth += {"(": 1, ")": -1}.get(line[i], 0)
            if depth == 0:
                break
        line = line[:start] + line[start + len(name) + 1:i] + line[i + 1:]
    return line


def _balance(line: str) -> int:
    return line.count("(") + line.count("[") - line.count(")") - line.count("]")


def unasync(source: str, origin: str) -> str:
    out = [f"# Generated from agentbox/{origin} by sdk/python/gen_sync.py: do not edit.\n"]
    dedent, depth = 0, 0  # continuation lines of a `def` that lost its `async `
    for line in source.splitlines(keepends=True):
        if line.rstrip().endswith("# unasync: drop"):
            continue
        if (added := _ADD.match(line)) is not None:
            out.append(added.group(1) + added.group(2) + "\n")  # verbatim: no rules
            continue
        if depth > 0 and line.startswith(" " * dedent):
            line = line[dedent:]
        elif "async def " in line:
            dedent = len("async ")
        line = _strip_call(line, "maybe_await")
        for pattern, repl in _COMPILED:
            line = pattern.sub(repl, line)
        depth = depth + _balance(line) if depth > 0 or dedent else 0
        if depth <= 0:
            dedent, depth = 0, 0
        out.append(line)
    # a dropped line between two blank ones leaves two blank lines inside a class
    return re.sub(r"\n\n\n(?=[ ]+\S)", "\n\n", "".join(out))


def generated() -> dict[Path, str]:
    return {PACKAGE / dst: unasync((PACKAGE / src).read_text(), src)
            for src, dst in MODULES.items()}


def main(argv: list[str]) -> int:
    stale = [path for path, text in generated().items()
             if not path.exists() or path.read_text() != text]
    if "--check" in argv:
        for path in stale:
            print(f"{path} is not what gen_sync.py generates: run it", file=sys.stderr)
        return 1 if stale else 0
    for path, text in generated().items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
