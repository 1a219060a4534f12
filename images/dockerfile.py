"""The Dockerfile subset AgentBox builds templates from, and the steps' cache keys.

Theory of operation
-------------------
``parse(text)`` turns a Dockerfile into a ``Recipe``: the ``FROM`` template, an ordered list
of ``Step``s (``RUN``, ``COPY``/``ADD``: the only ones that change the disk) and the final
image config (``ENV``, ``WORKDIR``, ``USER``, ``EXPOSE``, ``CMD``/``ENTRYPOINT``, readiness).
Every error names its line. Nothing here does I/O except ``context_digest``, which hashes
the context files a ``COPY`` names.

Supported: ``FROM <template>`` (a built-in template name, or ``debian:bookworm`` which is
the ``minimal`` template: every AgentBox image is Debian bookworm plus the guest agent),
``RUN`` (shell or JSON form), ``COPY``/``ADD`` from the build context (``--chown=``; no
URLs, archives are copied, not unpacked), ``ENV``, ``WORKDIR``, ``USER``, ``EXPOSE``,
``CMD``/``ENTRYPOINT`` (the start command, running in the golden snapshot), ``ARG`` with a
default, and one AgentBox instruction written as a comment so that Docker ignores it::

    # agentbox: ready http 8000 /health     (an HTTP GET answering < 500)
    # agentbox: ready tcp 5432              (a TCP connect)
    # agentbox: ready cmd test -f /tmp/up   (a command exiting 0)
    # agentbox: ready-timeout 120           (seconds; default 60)

Cache keys chain like Docker's: a step's key hashes its parent's key, the instruction as
written, the build state it runs in (env, workdir, user) and, for a copy, the bytes, modes
and names of the files it copies. A rebuild with nothing changed finds every key; a change
at step k reuses the layers of steps 1..k-1.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath

MAX_DOCKERFILE_BYTES = 256 * 1024
MAX_STEPS = 100
DEBIAN_ALIASES = {"debian:bookworm": "minimal", "debian:bookworm-slim": "minimal",
                  "debian:12": "minimal", "debian:12-slim": "minimal"}
_DIRECTIVE = re.compile(r"^#\s*agentbox:\s*(?P<word>[a-z-]+)\s*(?P<rest>.*)$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_USER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}(:[a-z_][a-z0-9_-]{0,31})?$|^\d+(:\d+)?$")
UNSUPPORTED_HINT = {
    "HEALTHCHECK": "use `# agentbox: ready http|tcp|cmd ...`",
    "VOLUME": "sandboxes have one disk; write where you like",
    "ONBUILD": "not supported", "STOPSIGNAL": "not supported", "SHELL": "RUN uses /bin/sh",
    "LABEL": "not supported", "MAINTAINER": "not supported",
}


class DockerfileError(ValueError):
    """The Dockerfile uses something outside the subset (or is malformed)."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}" if line else message)
        self.line = line


class StepKind(enum.Enum):
    RUN = "RUN"
    COPY = "COPY"


@dataclass(frozen=True)
class Ready:
    kind: str  # "http" | "tcp" | "cmd"
    port: int = 0
    path: str = "/"
    command: str = ""
    timeout: float = 60.0


@dataclass(frozen=True)
class BuildState:
    """What a step runs in (and what the finished template's start command gets)."""

    env: tuple[tuple[str, str], ...] = ()
    workdir: str = "/"
    user: str = "root"

    def env_dict(self) -> dict[str, str]:
        return dict(self.env)


@dataclass(frozen=True)
class Step:
    line: int
    kind: StepKind
    text: str  # the instruction as written (normalised whitespace), for the log and the key
    state: BuildState
    command: str = ""  # RUN: a shell command line
    sources: tuple[str, ...] = ()  # COPY: context paths (globs allowed)
    dest: str = ""  # COPY: absolute destination in the guest
    chown: str = ""


@dataclass(frozen=True)
class Recipe:
    base: str
    steps: tuple[Step, ...]
    final: BuildState
    expose: tuple[int, ...] = ()
    start: tuple[str, ...] = ()  # ENTRYPOINT + CMD as an argv; () = nothing started
    ready: Ready | None = None

    def config_dict(self) -> dict[str, object]:
        return {"env": self.final.env_dict(), "workdir": self.final.workdir,
                "user": self.final.user, "expose": list(self.expose),
                "start": list(self.start),
                "ready": None if self.ready is None else self.ready.__dict__}


@dataclass
class _Parse:
    base: str = ""
    steps: list[Step] = field(default_factory=list)
    state: BuildState = field(default_factory=BuildState)
    args: dict[str, str] = field(default_factory=dict)
    expose: list[int] = field(default_factory=list)
    cmd: tuple[str, ...] = ()
    entrypoint: tuple[str, ...] = ()
    cmd_shell: bool = False
    ready: Ready | None = None
    ready_timeout: float | None = None


def parse(text: str) -> Recipe:
    if len(text.encode()) > MAX_DOCKERFILE_BYTES:
        raise DockerfileError(0, f"the Dockerfile is larger than {MAX_DOCKERFILE_BYTES} bytes")
    p = _Parse()
    for line, word, rest in _logical_lines(text):
        if word == "#":
            _directive(p, line, rest)
            continue
        if not p.base and word not in ("FROM", "ARG"):
            raise DockerfileError(line, f"{word} before FROM: the first instruction is FROM")
        handler = _HANDLERS.get(word)
        if handler is None:
            hint = UNSUPPORTED_HINT.get(word, "not in the supported subset "
                                        "(FROM RUN COPY ADD ENV ARG WORKDIR USER EXPOSE CMD "
                                        "ENTRYPOINT)")
            raise DockerfileError(line, f"unsupported instruction {word}: {hint}")
        handler(p, line, _substitute(rest, p, line) if word not in ("RUN", "CMD", "ENTRYPOINT")
                else rest)
    if not p.base:
        raise DockerfileError(0, "no FROM instruction")
    if len(p.steps) > MAX_STEPS:
        raise DockerfileError(p.steps[MAX_STEPS].line, f"more than {MAX_STEPS} RUN/COPY steps")
    ready = p.ready
    if ready is not None and p.ready_timeout is not None:
        ready = replace(ready, timeout=p.ready_timeout)
    start = p.entrypoint + p.cmd if p.entrypoint else p.cmd
    if ready is not None and not start:
        raise DockerfileError(0, "`# agentbox: ready` needs a CMD or ENTRYPOINT to wait for")
    return Recipe(base=p.base, steps=tuple(p.steps), final=p.state, expose=tuple(p.expose),
                  start=start, ready=ready)


def _logical_lines(text: str):  # type: ignore[no-untyped-def]
    """(line number, INSTRUCTION or '#', rest), joining backslash continuations."""
    buf: list[str] = []
    start = 0
    for n, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not buf:
            if not stripped:
                continue
            if stripped.startswith("#"):
                yield n, "#", stripped
                continue
            start = n
        elif stripped.startswith("#"):
            continue  # comment lines inside a continuation are dropped, as Docker does
        if stripped.endswith("\\"):
            buf.append(stripped[:-1])
            continue
        buf.append(stripped)
        joined = " ".join(b.strip() for b in buf if b.strip())
        buf = []
        word, _, rest = joined.partition(" ")
        yield start, word.upper(), rest.strip()
    if buf:
        raise DockerfileError(start, "the file ends inside a line continuation")


def _directive(p: _Parse, line: int, comment: str) -> None:
    m = _DIRECTIVE.match(comment)
    if m is None:
        return  # an ordinary comment
    word, rest = m["word"], m["rest"].strip()
    if word == "ready":
        p.ready = _ready(line, rest)
    elif word == "ready-timeout":
        try:
            p.ready_timeout = float(rest)
        except ValueError:
            raise DockerfileError(line, f"ready-timeout wants seconds, got {rest!r}") from None
        if not 0 < p.ready_timeout <= 900:
            raise DockerfileError(line, "ready-timeout must be > 0 and <= 900 seconds")
    else:
        raise DockerfileError(line, f"unknown agentbox directive {word!r} "
                                    "(ready, ready-timeout)")


def _ready(line: int, rest: str) -> Ready:
    kind, _, args = rest.partition(" ")
    args = args.strip()
    if kind == "cmd":
        if not args:
            raise DockerfileError(line, "ready cmd needs a command")
        return Ready("cmd", command=args)
    if kind in ("http", "tcp"):
        parts = args.split()
        if not parts or len(parts) > (2 if kind == "http" else 1):
            raise DockerfileError(line, f"ready {kind} wants PORT" +
                                  (" [PATH]" if kind == "http" else ""))
        port = _port(line, parts[0])
        path = parts[1] if len(parts) > 1 else "/"
        if not path.startswith("/"):
            raise DockerfileError(line, f"ready http path must start with '/': {path!r}")
        return Ready(kind, port=port, path=path)
    raise DockerfileError(line, f"ready wants http|tcp|cmd, got {kind!r}")


def _port(line: int, text: str) -> int:
    text = text.split("/")[0]
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise DockerfileError(line, f"not a port: {text!r}")
    return int(text)


def _substitute(rest: str, p: _Parse, line: int) -> str:
    """$VAR / ${VAR} from ARG and ENV, as Docker does for these instructions."""
    values = p.args | p.state.env_dict()

    def sub(m: re.Match[str]) -> str:
        name = m["a"] or m["b"]
        return values.get(name, "")

    return re.sub(r"\$(?:\{(?P<b>[A-Za-z_][A-Za-z0-9_]*)\}|(?P<a>[A-Za-z_][A-Za-z0-9_]*))",
                  sub, rest)


def _json_or_shell(line: int, rest: str) -> tuple[tuple[str, ...], bool]:
    """(argv, is_shell_form)."""
    if rest.startswith("["):
        try:
            argv = json.loads(rest)
        except ValueError as exc:
            raise DockerfileError(line, f"bad JSON array: {exc}") from None
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise DockerfileError(line, "the JSON form is a non-empty array of strings")
        return tuple(argv), False
    if not rest:
        raise DockerfileError(line, "missing command")
    return ("/bin/sh", "-c", rest), True


def _split(line: int, rest: str) -> list[str]:
    try:
        return shlex.split(rest)
    except ValueError as exc:
        raise DockerfileError(line, f"cannot split the arguments: {exc}") from None


def _from(p: _Parse, line: int, rest: str) -> None:
    if p.base:
        raise DockerfileError(line, "only one FROM (multi-stage builds are not supported)")
    parts = rest.split()
    if len(parts) != 1 or parts[0].startswith("--"):
        raise DockerfileError(line, "FROM takes one template name (no AS, no --platform)")
    name = parts[0]
    if ":" in name and name not in DEBIAN_ALIASES:
        raise DockerfileError(line, f"FROM {name}: only AgentBox templates and "
                                    f"{', '.join(sorted(DEBIAN_ALIASES))} are supported")
    p.base = DEBIAN_ALIASES.get(name, name)


def _run(p: _Parse, line: int, rest: str) -> None:
    argv, shell = _json_or_shell(line, rest)
    command = rest if shell else shlex.join(argv)
    p.steps.append(Step(line, StepKind.RUN, f"RUN {rest}", p.state, command=command))


def _copy(p: _Parse, line: int, rest: str, word: str = "COPY") -> None:
    words = _split(line, rest) if not rest.startswith("[") else \
        list(_json_or_shell(line, rest)[0])
    chown = ""
    while words and words[0].startswith("--"):
        flag = words.pop(0)
        if flag.startswith("--chown="):
            chown = flag.split("=", 1)[1]
            if not _USER.match(chown):
                raise DockerfileError(line, f"bad --chown value {chown!r}")
        else:
            raise DockerfileError(line, f"{word} {flag.split('=')[0]} is not supported "
                                        "(only --chown)")
    if len(words) < 2:
        raise DockerfileError(line, f"{word} wants SOURCE... DEST")
    *sources, dest = words
    for src in sources:
        if "://" in src:
            raise DockerfileError(line, f"{word} from a URL is not supported: {src}")
        if PurePosixPath(src).is_absolute() or ".." in PurePosixPath(src).parts:
            raise DockerfileError(line, f"{word} source must stay inside the context: {src}")
    if not dest.startswith("/"):
        dest = str(PurePosixPath(p.state.workdir) / dest) + ("/" if dest.endswith("/") else "")
    p.steps.append(Step(line, StepKind.COPY, f"{word} {rest}", p.state,
                        sources=tuple(sources), dest=dest, chown=chown))


def _env(p: _Parse, line: int, rest: str) -> None:
    pairs: list[tuple[str, str]] = []
    words = _split(line, rest)
    if words and "=" not in words[0]:
        if len(words) < 2:
            raise DockerfileError(line, "ENV wants NAME=VALUE (or NAME VALUE)")
        name, _, value = rest.partition(" ")
        pairs = [(name, value.strip())]
    else:
        for word in words:
            name, eq, value = word.partition("=")
            if not eq:
                raise DockerfileError(line, f"ENV: expected NAME=VALUE, got {word!r}")
            pairs.append((name, value))
    env = p.state.env_dict()
    for name, value in pairs:
        if not _ENV_NAME.match(name):
            raise DockerfileError(line, f"ENV: bad variable name {name!r}")
        env[name] = value
    p.state = replace(p.state, env=tuple(env.items()))


def _arg(p: _Parse, line: int, rest: str) -> None:
    name, eq, value = rest.partition("=")
    if not _ENV_NAME.match(name.strip()):
        raise DockerfileError(line, f"ARG: bad name {name!r}")
    if not eq:
        raise DockerfileError(line, "ARG needs a default (NAME=VALUE): build args are not "
                                    "supported")
    p.args[name.strip()] = value.strip().strip('"')


def _workdir(p: _Parse, line: int, rest: str) -> None:
    if not rest or len(rest.split()) != 1:
        raise DockerfileError(line, "WORKDIR wants one path")
    path = PurePosixPath(p.state.workdir) / rest
    p.state = replace(p.state, workdir=str(path))  # made by the next step that runs in it


def _user(p: _Parse, line: int, rest: str) -> None:
    if not _USER.match(rest):
        raise DockerfileError(line, f"USER wants a user name or uid: {rest!r}")
    p.state = replace(p.state, user=rest)


def _expose(p: _Parse, line: int, rest: str) -> None:
    for word in rest.split():
        if word.endswith("/udp"):
            raise DockerfileError(line, "EXPOSE: only TCP ports are served")
        p.expose.append(_port(line, word.removesuffix("/tcp")))


def _cmd(p: _Parse, line: int, rest: str) -> None:
    p.cmd, p.cmd_shell = _json_or_shell(line, rest)


def _entrypoint(p: _Parse, line: int, rest: str) -> None:
    p.entrypoint, _ = _json_or_shell(line, rest)
    if p.cmd_shell:
        p.cmd = ()  # Docker: a shell-form CMD is ignored under an ENTRYPOINT


_HANDLERS = {"FROM": _from, "RUN": _run, "COPY": _copy,
             "ADD": lambda p, line, rest: _copy(p, line, rest, "ADD"), "ENV": _env,
             "ARG": _arg, "WORKDIR": _workdir, "USER": _user, "EXPOSE": _expose,
             "CMD": _cmd, "ENTRYPOINT": _entrypoint}


# -- cache keys -------------------------------------------------------------------------------

def _h(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def base_key(golden_dir: str) -> str:
    """A FROM template's identity: its golden directory is named by its content hash."""
    return _h("base", golden_dir)


def step_key(parent: str, step: Step, files_digest: str = "") -> str:
    return _h("step", parent, step.kind.value, step.text, step.command, step.sources,
              step.dest, step.chown, step.state.env, step.state.workdir, step.state.user,
              files_digest)


def final_key(parent: str, recipe: Recipe, mem_mib: int, vcpus: int = 1) -> str:
    """The finished template's key: a restore needs the vCPU count and RAM it was saved
    with, so both are in it (a 1-vCPU key is that of before the vCPU count was)."""
    return _h("final", parent, recipe.config_dict(), mem_mib, *([vcpus] if vcpus != 1 else []))


def context_files(context: Path, sources: tuple[str, ...]) -> list[tuple[str, Path]]:
    """(path relative to the context, file) for every file the sources name, sorted;
    a source naming a directory brings its whole tree. Symlinks out of the context are
    refused."""
    root = context.resolve()
    found: dict[str, Path] = {}
    for src in sources:
        matches = sorted(root.glob(src)) if any(c in src for c in "*?[") else [root / src]
        if not matches or not all(m.exists() for m in matches):
            raise DockerfileError(0, f"COPY source not found in the context: {src}")
        for match in matches:
            paths = [match] if match.is_file() else sorted(match.rglob("*"))
            for path in paths:
                real = path.resolve()
                if not real.is_relative_to(root):
                    raise DockerfileError(0, f"{src}: {path.name} points outside the context")
                if real.is_file():
                    base = match if match.is_dir() else match.parent
                    found[str(path.relative_to(base))] = real
    return sorted(found.items())


def context_digest(files: list[tuple[str, Path]]) -> str:
    h = hashlib.sha256()
    for rel, path in files:
        h.update(rel.encode() + b"\0" + oct(path.stat().st_mode & 0o777).encode() + b"\0")
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()
