"""The gateway's import walls: no module cycle (imports inside functions count; only
``if TYPE_CHECKING:`` imports do not), and the sandbox layer and those below it never
import the HTTP or preview layers (except the wire types, a shared description)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOWER = ("gateway.sandbox", "gateway.tenancy", "gateway.templates", "gateway.builds",
         "gateway.store")
SHARED = {"gateway.http.wire", "gateway.http.wire_base"}


def modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "gateway").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The gateway modules ``name`` imports anywhere in its body, TYPE_CHECKING aside."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def module_of(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            targets = [f"{base}.{a.name}" for a in node.names]
        for target in targets:
            mod = module_of(target)
            if mod is not None and mod != name:
                found.add(mod)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in g[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            connect(v)
    return out


def test_the_finder_sees_a_cycle_through_a_function_body():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]
    src = ast.parse("def f():\n    from gateway.sandbox import core\n")
    assert isinstance(src.body[0], ast.FunctionDef)  # the case the walk must enter


def test_function_body_imports_are_counted():
    g = graph()
    # gateway.http.app imports gateway.preview.fastlane (a package) inside a function only
    assert "gateway.preview.fastlane" in g["gateway.http.app"]


def test_no_import_cycle_in_the_gateway():
    assert cycles(graph()) == []


def test_lower_layers_never_import_http_or_preview():
    bad = {name: sorted(t for t in targets
                        if t.startswith(("gateway.http", "gateway.preview")) and t not in SHARED)
           for name, targets in graph().items() if name.startswith(LOWER)}
    assert {k: v for k, v in bad.items() if v} == {}
