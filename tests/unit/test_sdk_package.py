"""The two distributions stay apart: the SDK (sdk/python) installs alone with httpx only and
imports nothing from the server; the server's packages never import the SDK.

The fresh-venv test really installs sdk/python with pip (its dependencies from the configured
index or pip's cache: about 5 s here) into a venv that cannot see this checkout."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import tomllib
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SDK = REPO / "sdk" / "python"
SERVER_PACKAGES = ("gateway", "vmctl", "guest", "images")
SERVER_ONLY_DISTS = {"uvloop", "pyroute2", "aiohttp", "orjson", "cachetools", "httptools",
                     "agentbox-server"}


def _imports(root: Path) -> set[str]:
    """Top-level module names imported anywhere under ``root`` (lazy imports included)."""
    names = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def test_sdk_declares_httpx_only_and_ships_only_agentbox():
    project = tomllib.loads((SDK / "pyproject.toml").read_text())["project"]
    assert project["name"] == "agentbox"
    assert [d.split(">")[0] for d in project["dependencies"]] == ["httpx"]
    assert set(project["optional-dependencies"]) == {"mcp", "langchain", "crewai", "shell"}
    assert project["scripts"] == {"agentbox": "agentbox.cli:main"}
    assert not (SDK / "gateway").exists() and (SDK / "agentbox" / "__main__.py").exists()


def test_sdk_source_never_imports_the_server():
    assert not _imports(SDK / "agentbox") & set(SERVER_PACKAGES)


def test_server_packages_never_import_the_sdk():
    for package in SERVER_PACKAGES:
        assert "agentbox" not in _imports(REPO / package), package


def test_server_distribution_has_its_own_command_and_not_the_sdk():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["name"] == "agentbox-server"
    assert project["project"]["scripts"] == {"agentbox-server": "gateway.cli:main"}
    assert "agentbox*" not in project["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not any(d.startswith("httpx") for d in project["project"]["dependencies"])


_PROBE = """
import importlib, importlib.metadata as md, json, pkgutil, agentbox
mods = [m.name for m in pkgutil.walk_packages(agentbox.__path__, "agentbox.")
        if m.name not in ("agentbox.__main__",)]
broken = {}
for name in mods:
    try:
        importlib.import_module(name)
    except ImportError as exc:
        broken[name] = str(exc)
server = {}
for name in ("gateway", "vmctl", "guest", "images"):
    try:
        importlib.import_module(name)
        server[name] = True
    except ImportError:
        server[name] = False
print(json.dumps({"dists": sorted(d.metadata["Name"].lower() for d in md.distributions()),
                  "requires": md.requires("agentbox"), "broken": broken, "server": server,
                  "file": agentbox.__file__}))
"""


def test_fresh_venv_installs_the_sdk_without_the_server(tmp_path):
    venv.create(tmp_path / "venv", with_pip=True)
    py = tmp_path / "venv" / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # from a copy: pip builds a local directory in place (build/, *.egg-info)
    src = shutil.copytree(SDK, tmp_path / "src", ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__"))
    subprocess.run([py, "-m", "pip", "install", "-q", str(src)], check=True, env=env,
                   cwd=tmp_path, timeout=300, capture_output=True)
    probe = subprocess.run([py, "-c", _PROBE], check=True, env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    found = json.loads(probe.stdout)
    assert found["file"].startswith(str(tmp_path))  # the installed copy, not this checkout
    assert not set(found["dists"]) & SERVER_ONLY_DISTS, found["dists"]
    assert "httpx" in found["dists"]
    assert [r for r in found["requires"] if "extra ==" not in r] == ["httpx>=0.25"]
    assert found["server"] == dict.fromkeys(SERVER_PACKAGES, False)
    # every module imports except the tool adapters whose framework is an extra
    assert set(found["broken"]) <= {"agentbox.tools.mcp_server", "agentbox.tools.crewai",
                                    "agentbox.tools.langchain"}, found["broken"]
    cli = subprocess.run([py, "-m", "agentbox", "--help"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0 and ",exec," in cli.stdout and ",serve" not in cli.stdout
    script = subprocess.run([tmp_path / "venv" / "bin" / "agentbox", "ls", "--help"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert script.returncode == 0, script.stderr
    # a command whose extra is missing names it (no traceback)
    client_env = {**env, "AGENTBOX_URL": "http://127.0.0.1:9", "AGENTBOX_API_KEY": "k"}
    for command, extra in (("shell", "shell"), ("mcp", "mcp")):
        run = subprocess.run([py, "-m", "agentbox", command, *(["sbx"] * (command == "shell"))],
                             env=client_env, cwd=tmp_path, capture_output=True, text=True,
                             timeout=60, stdin=subprocess.DEVNULL)
        assert run.returncode == 1 and f"agentbox[{extra}]" in run.stderr, run.stderr
        assert "Traceback" not in run.stderr


def test_server_command_has_the_server_subcommands_only():
    from gateway.cli import build_parser

    choices = build_parser()._subparsers._group_actions[0].choices
    assert set(choices) == {"serve", "keys", "images", "drain"}


def test_client_command_has_no_server_subcommands():
    from agentbox.cli import build_parser

    choices = build_parser()._subparsers._group_actions[0].choices
    assert {"create", "ls", "exec", "run", "cp", "shell", "mcp"} <= set(choices)
    assert not {"serve", "keys", "images"} & set(choices)
