"""The walls between gateway/'s subpackages, checked over every module's imports.

Each module is parsed with ``ast``; every import counts, including those inside
functions (they run too), except those under ``if TYPE_CHECKING:`` (never at run time).
The rules (docs/architecture.md):

a. vmctl is imported only by gateway/sandbox/ and gateway/builds/ (plus the few modules
   in ``VMCTL_ALLOWED``, each for the vmctl modules it names): everything else reaches a
   VM through the sandbox layer (gateway.sandbox.guest, .goldens, .vm_errors).
b. aiohttp's server (``aiohttp.web``, ``aiohttp.web_*``) is imported only by
   gateway/http/ and gateway/preview/: the layers below them know nothing of requests.
c. only the controller touches its core and record: outside gateway/sandbox/ nothing
   imports gateway.sandbox.core, and no module but the controller reads an attribute
   ``.core`` or ``.rec`` of anything but ``self`` (a controller offers the read-only
   ``record``, named facts and ``tell``).
d. no import cycle among gateway modules.
e. the layers below the web (sandbox/, tenancy/, templates/, builds/, store/) never
   import gateway/http/ or gateway/preview/, except the wire types (``WIRE``), the one
   description of the API that services answer in.

The checker runs over a directory (the repository, or a synthetic tree in the tests at
the bottom that show each rule failing on a violation).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Modules outside sandbox/ and builds/ that may import vmctl, and the vmctl modules each may.
VMCTL_ALLOWED: dict[str, frozenset[str]] = {
    # Its config dataclasses include vmctl's (the VM, network and confinement sections).
    "gateway.config": frozenset({"vmctl.backend", "vmctl.confine", "vmctl.network"}),
    # Composition roots: they select vmctl's backend, build the goldens at start-up and
    # install the sandboxes' DNS resolver.
    "gateway.cli": frozenset({"vmctl.backend", "vmctl.golden"}),
    "gateway.http.app": frozenset({"vmctl.backend", "vmctl.dnsfwd", "vmctl.network",
                                   "vmctl.golden"}),
    # The API schema states vmctl's bound on egress rules (MAX_RULES). The wire types are
    # shared with the sandbox layer (gateway.sandbox.egress_policy imports them), so they
    # cannot take the constant from there without an import cycle.
    "gateway.http.wire": frozenset({"vmctl.egress"}),
}
VMCTL_LAYERS = ("gateway.sandbox", "gateway.builds")
WEB_LAYERS = ("gateway.http", "gateway.preview")
SANDBOX = "gateway.sandbox"
AIOHTTP_WEB = re.compile(r"aiohttp\.web(_\w+)?(\.|$)")
INTERNALS = frozenset({"core", "rec"})
CONTROLLER = "gateway.sandbox.controller"
LOWER_LAYERS = ("gateway.sandbox", "gateway.tenancy", "gateway.templates", "gateway.builds",
                "gateway.store")
WIRE = ("gateway.http.wire", "gateway.http.wire_base")


@dataclass(frozen=True)
class Import:
    target: str  # absolute dotted name; ``from a import b`` is ``a.b`` (only)
    line: int


@dataclass(frozen=True)
class Source:
    name: str  # dotted module name (a package is its __init__)
    path: Path
    tree: ast.Module
    imports: tuple[Import, ...]


def under(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def load(root: Path) -> dict[str, Source]:
    """Every module of ``root``/gateway, parsed, with its imports."""
    out = {}
    for path in sorted((root / "gateway").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        tree = ast.parse(path.read_text(), str(path))
        package = name if is_package else name.rpartition(".")[0]
        out[name] = Source(name, path, tree, tuple(_imports(tree, package)))
    return out


def _imports(tree: ast.Module, package: str) -> list[Import]:
    found: list[Import] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                up = parts[:len(parts) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            found.extend(Import(f"{base}.{a.name}", node.lineno) for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _where(src: Source, line: int, what: str) -> str:
    return f"{src.name}:{line}: {what}"


# -- the rules --------------------------------------------------------------------------------

def vmctl_violations(sources: dict[str, Source]) -> list[str]:
    """(a) vmctl only from gateway/sandbox/, gateway/builds/ and ``VMCTL_ALLOWED``."""
    out = []
    for src in sources.values():
        if under(src.name, *VMCTL_LAYERS):
            continue
        allowed = VMCTL_ALLOWED.get(src.name, frozenset())
        for imp in src.imports:
            if under(imp.target, "vmctl") and not under(imp.target, *allowed):
                out.append(_where(src, imp.line, f"imports {imp.target}"))
    return sorted(set(out))


def aiohttp_web_violations(sources: dict[str, Source]) -> list[str]:
    """(b) aiohttp's server only from gateway/http/ and gateway/preview/."""
    out = []
    for src in sources.values():
        if under(src.name, *WEB_LAYERS):
            continue
        out += [_where(src, imp.line, f"imports {imp.target}") for imp in src.imports
                if AIOHTTP_WEB.match(imp.target)]
        out += [_where(src, node.lineno, f"uses aiohttp.{node.attr}")
                for node in ast.walk(src.tree)
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "aiohttp" and AIOHTTP_WEB.match(f"aiohttp.{node.attr}")]
    return sorted(set(out))


def sandbox_internals_violations(sources: dict[str, Source]) -> list[str]:
    """(c) outside gateway/sandbox/ no gateway.sandbox.core; outside the controller no
    ``x.core`` / ``x.rec``."""
    out = []
    for src in sources.values():
        if src.name == CONTROLLER:
            continue
        if not under(src.name, SANDBOX):
            out += [_where(src, imp.line, f"imports {imp.target}") for imp in src.imports
                    if under(imp.target, f"{SANDBOX}.core")]
        for node in ast.walk(src.tree):
            if isinstance(node, ast.Attribute) and node.attr in INTERNALS and not (
                    isinstance(node.value, ast.Name) and node.value.id == "self"):
                out.append(_where(src, node.lineno, f"reads {ast.unparse(node)}"))
    return sorted(set(out))


def layer_violations(sources: dict[str, Source]) -> list[str]:
    """(e) the layers below the web import no http/ or preview/ module but the wire types."""
    out = []
    for src in sources.values():
        if not under(src.name, *LOWER_LAYERS):
            continue
        out += [_where(src, imp.line, f"imports {imp.target}") for imp in src.imports
                if under(imp.target, *WEB_LAYERS) and not under(imp.target, *WIRE)]
    return sorted(set(out))


def graph(sources: dict[str, Source]) -> dict[str, set[str]]:
    """Module -> the gateway modules it imports (a name inside a module is that module)."""
    def module_of(dotted: str) -> str | None:
        while dotted and dotted not in sources:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    g: dict[str, set[str]] = {}
    for src in sources.values():
        targets = {module_of(imp.target) for imp in src.imports}
        g[src.name] = {t for t in targets if t is not None and t != src.name}
    return g


def import_cycles(g: dict[str, set[str]]) -> list[str]:
    """(d) each strongly connected component of more than one module, as one cycle through
    it (``a -> b -> a``), found with Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(g[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(g):
        if v not in index:
            connect(v)
    return [" -> ".join(_cycle_through(g, comp)) + f"  (all of: {', '.join(sorted(comp))})"
            for comp in components]


def _cycle_through(g: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest cycle from the component's first module back to itself."""
    start = min(comp)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(g[v] & comp):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError("a strongly connected component always has a cycle")


def report(found: list[str]) -> str:
    return "\n".join(found)


# -- the gateway ------------------------------------------------------------------------------

SOURCES = load(ROOT)


def test_the_checker_sees_the_gateway():
    assert "gateway.sandbox.controller" in SOURCES and "gateway.http.app" in SOURCES
    assert any(under(i.target, "vmctl") for i in SOURCES["gateway.sandbox.service"].imports)


def test_a_only_the_sandbox_and_builds_import_vmctl():
    found = vmctl_violations(SOURCES)
    assert not found, "vmctl imported outside gateway/sandbox/, gateway/builds/:\n" + report(found)


def test_b_only_http_and_preview_import_aiohttp_web():
    found = aiohttp_web_violations(SOURCES)
    assert not found, "aiohttp.web outside gateway/http/, gateway/preview/:\n" + report(found)


def test_c_nothing_outside_the_sandbox_touches_a_controllers_internals():
    found = sandbox_internals_violations(SOURCES)
    assert not found, "sandbox internals used outside gateway/sandbox/:\n" + report(found)


def test_d_no_import_cycle_among_gateway_modules():
    found = import_cycles(graph(SOURCES))
    assert not found, "import cycles among gateway modules:\n" + report(found)


def test_e_the_layers_below_the_web_never_import_it():
    found = layer_violations(SOURCES)
    assert not found, "http/ or preview/ imported from below:\n" + report(found)


def test_function_body_imports_are_counted():
    # gateway.http.app imports gateway.preview.fastlane (a package) inside a function only
    assert "gateway.preview.fastlane" in graph(SOURCES)["gateway.http.app"]


# -- each rule fails on a violation (a synthetic tree) ----------------------------------------

def tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Source]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(tmp_path).parents:
            if parent != Path("."):
                (tmp_path / parent / "__init__.py").touch()
        path.write_text(text)
    return load(tmp_path)


def test_a_fails_on_vmctl_in_http_even_inside_a_function(tmp_path):
    sources = tree(tmp_path, {
        "gateway/http/routes.py": "def f():\n    from vmctl import agent_interp\n",
        "gateway/preview/proxy.py": "import vmctl.agent_terminal\n",
        "gateway/store/x.py": "import vmctl\n",
        "gateway/templates/catalog.py": "from vmctl.golden import Golden\n",
        "gateway/http/app.py": "from vmctl.machine import Machine\n",  # not in its list
        "gateway/sandbox/guest.py": "from vmctl import agent_interp\n",  # allowed
        "gateway/builds/vm.py": "from vmctl.spec import VMSpec\n",  # allowed
        "gateway/http/wire.py": "from vmctl.egress import MAX_RULES\n",  # allowed
        "gateway/http/typed.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                  "    from vmctl.golden import Golden\n"),  # ignored
    })
    assert vmctl_violations(sources) == [
        "gateway.http.app:1: imports vmctl.machine.Machine",
        "gateway.http.routes:2: imports vmctl.agent_interp",
        "gateway.preview.proxy:1: imports vmctl.agent_terminal",
        "gateway.store.x:1: imports vmctl",
        "gateway.templates.catalog:1: imports vmctl.golden.Golden",
    ]


def test_b_fails_on_aiohttp_web_below_http(tmp_path):
    sources = tree(tmp_path, {
        "gateway/sandbox/a.py": "from aiohttp import web\n",
        "gateway/tenancy/b.py": "from aiohttp.web_urldispatcher import UrlDispatcher\n",
        "gateway/store/c.py": "import aiohttp\nx = aiohttp.web.Response\n",
        "gateway/d.py": "def f():\n    import aiohttp.web_request\n",
        "gateway/builds/client.py": "import aiohttp\nfrom aiohttp import ClientSession\n",  # fine
        "gateway/http/routes.py": "from aiohttp import web\n",  # allowed
        "gateway/preview/hosts.py": "from aiohttp.web_urldispatcher import X\n",  # allowed
    })
    assert aiohttp_web_violations(sources) == [
        "gateway.d:2: imports aiohttp.web_request",
        "gateway.sandbox.a:1: imports aiohttp.web",
        "gateway.store.c:2: uses aiohttp.web",
        "gateway.tenancy.b:1: imports aiohttp.web_urldispatcher.UrlDispatcher",
    ]


def test_c_fails_on_core_imports_and_controller_internals(tmp_path):
    sources = tree(tmp_path, {
        "gateway/http/a.py": "from gateway.sandbox import core\n",
        "gateway/http/b.py": "from gateway.sandbox.core import SandboxCore\n",
        "gateway/preview/c.py": "def f(ctl):\n    return ctl.rec.state, ctl.core\n",
        "gateway/preview/d.py": "class M:\n    def f(self, ctl):\n        self.rec = ctl.record\n",
        "gateway/sandbox/service.py": "from gateway.sandbox import core\nx = ctl.rec\n",
        "gateway/sandbox/controller.py": "def f(other):\n    return other.core.op\n",  # ok
    })
    assert sandbox_internals_violations(sources) == [
        "gateway.http.a:1: imports gateway.sandbox.core",
        "gateway.http.b:1: imports gateway.sandbox.core.SandboxCore",
        "gateway.preview.c:2: reads ctl.core",
        "gateway.preview.c:2: reads ctl.rec",
        "gateway.sandbox.service:2: reads ctl.rec",
    ]


def test_e_fails_on_a_lower_layer_importing_the_web(tmp_path):
    sources = tree(tmp_path, {
        "gateway/sandbox/a.py": "from gateway.http.sandbox_routes import json_response\n",
        "gateway/store/b.py": "def f():\n    from gateway.preview import hosts\n",
        "gateway/tenancy/c.py": "from gateway.http import wire, wire_base\n",  # allowed
        "gateway/http/d.py": "from gateway.preview import hosts\n",  # not a lower layer
    })
    assert layer_violations(sources) == [
        "gateway.sandbox.a:1: imports gateway.http.sandbox_routes.json_response",
        "gateway.store.b:2: imports gateway.preview.hosts",
    ]


def test_d_fails_on_a_cycle_through_a_function_body_and_names_it(tmp_path):
    sources = tree(tmp_path, {
        "gateway/http/routes.py": "from gateway.sandbox.service import Service\n",
        "gateway/sandbox/service.py": "from gateway.sandbox import expiry\n",
        "gateway/sandbox/expiry.py": "def f():\n    from gateway.http import routes\n",
        "gateway/sandbox/typed.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                     "    from gateway.http import routes\n"),
        "gateway/http/routes2.py": "from . import routes\n",  # relative, no cycle
    })
    g = graph(sources)
    assert g["gateway.http.routes2"] == {"gateway.http.routes"}
    assert import_cycles(g) == [
        "gateway.http.routes -> gateway.sandbox.service -> gateway.sandbox.expiry -> "
        "gateway.http.routes  (all of: gateway.http.routes, gateway.sandbox.expiry, "
        "gateway.sandbox.service)"]
