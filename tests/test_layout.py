"""The package's shape: no import cycle between its modules, no module over 500 lines, no class over 250.

Read from the sources (module-level imports only: an import inside a function is lazy by design). The
control shows the cycle finder finds a cycle when there is one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import bivit

ROOT = Path(bivit.__file__).parent
MAX_MODULE_LINES, MAX_CLASS_LINES = 500, 250


def _module_name(path: Path) -> str:
    return ".".join(("bivit",) + path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path) -> set[str]:
    """bivit modules `path` imports at module level (TYPE_CHECKING blocks excluded)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for s in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(s, ast.ImportFrom) and s.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - s.level + 1])
                out |= {f"{base}.{a.name}" for a in s.names} if s.module is None else {f"{base}.{s.module}"}
            elif isinstance(s, ast.ImportFrom) and (s.module or "").startswith("bivit"):
                out.add(s.module)
            elif isinstance(s, ast.Import):
                out |= {a.name for a in s.names if a.name.startswith("bivit")}
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                found.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return found


def test_no_import_cycle_and_the_finder_finds_one():
    graph = {_module_name(p): _imports(p) for p in ROOT.rglob("*.py")}
    graph = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}
    assert len(graph) > 40 and "bivit.items" in graph["bivit.encoder"]
    assert _cycles(graph) == []
    assert _cycles({**graph, "bivit.media": graph["bivit.media"] | {"bivit.encoder"}})  # control


def test_module_and_class_sizes():
    long_modules, long_classes = [], []
    for path in ROOT.rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            long_modules.append(str(path.relative_to(ROOT)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                long_classes.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert long_modules == [] and long_classes == []
