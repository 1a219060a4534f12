"""The SDK side of template builds: packing a context, the CLI's arguments and log lines."""

from __future__ import annotations

import io
import tarfile

import pytest

from agentbox import _cli_builds, cli
from agentbox._build_context import pack_context


def names(data: bytes) -> list[str]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return sorted(tar.getnames())


def test_pack_context_skips_dockerignore_and_vcs_and_adds_an_outside_dockerfile(tmp_path):
    ctx = tmp_path / "ctx"
    (ctx / "src").mkdir(parents=True)
    (ctx / ".git").mkdir()
    (ctx / ".git" / "HEAD").write_text("x")
    (ctx / "src" / "app.py").write_text("print(1)")
    (ctx / "secret.env").write_text("TOKEN=1")
    (ctx / "Dockerfile").write_text("FROM python\n")
    (ctx / ".dockerignore").write_text("# comment\nsecret.env\n")
    data, name = pack_context(ctx)
    assert name == "Dockerfile"
    assert names(data) == [".dockerignore", "Dockerfile", "src/app.py"]
    other = tmp_path / "Other.Dockerfile"
    other.write_text("FROM node\n")
    data, name = pack_context(ctx, other)
    assert name == ".agentbox.Dockerfile" and name in names(data)
    _, name = pack_context(ctx, ctx / "Dockerfile")
    assert name == "Dockerfile"


def test_cli_arguments_and_event_lines():
    args = cli.parse_args(["templates", "build", "-f", "D", "-t", "web", "dir"])
    assert _cli_builds.action(args) == "build"
    assert (args.dockerfile, args.name, args.context) == ("D", "web", "dir")
    assert _cli_builds.action(cli.parse_args(["templates"])) == "ls"
    args = cli.parse_args(["templates", "build", "-t", "x"])
    assert _cli_builds.action(args) == "build" and args.context == "."
    with pytest.raises(SystemExit):
        cli.parse_args(["ls", "stray"])  # other commands still refuse extra arguments
    fmt = _cli_builds.format_event
    assert fmt({"type": "step", "n": 1, "of": 3, "text": "RUN x", "cached": True}) == \
        "[1/3] RUN x  (cached)"
    assert fmt({"type": "error", "message": "m", "exit_code": 7}) == "ERROR: m (exit code 7)"
    assert fmt({"type": "output", "text": "hi\n"}) == "hi"
    assert fmt({"type": "output", "text": "hi\n"}, quiet=True) is None
