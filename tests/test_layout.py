"""The package's shape: no import cycle between its modules, none pointing back up its layers (LAYERS), no module
over 500 lines, no class over 250.

Read from the sources, imports inside functions included (a lazy import is still a dependency: it only hides
the loop from the interpreter); TYPE_CHECKING blocks excluded (annotations only). The control shows the cycle
finder finds a cycle when there is one.
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
    """bivit modules `path` imports, anywhere in it (TYPE_CHECKING blocks excluded); `from bivit.x import y`
    counts `bivit.x.y` too when that is a module."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    out = set()
    for s in ast.walk(tree):
        if id(s) in skip:
            continue
        if isinstance(s, ast.ImportFrom):
            if s.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - s.level + 1])
                module = f"{base}.{s.module}" if s.module else base
            elif (s.module or "").startswith("bivit"):
                module = s.module
            else:
                continue
            out |= {module} | {f"{module}.{a.name}" for a in s.names}
        elif isinstance(s, ast.Import):
            out |= {a.name for a in s.names if a.name.startswith("bivit")}
    # A module's own packages run before it whatever it imports (`from . import x` names its package only to
    # reach a sibling): not dependencies.
    return out - {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}


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
    assert len(graph) > 40 and "bivit.core.items" in graph["bivit.core.encoder"]
    assert _cycles(graph) == []
    assert _cycles({**graph, "bivit.media.pixels": graph["bivit.media.pixels"] | {"bivit.core.encoder"}})  # control


def test_engines_are_a_leaf():
    """`bivit.integrations` (what inference engines and trainers consume) sits beside the front ends: no other bivit
    module imports it (the encoder cache the front ends write is `bivit.core.encoder_cache`, which engines read)."""
    graph = {_module_name(p): _imports(p) for p in ROOT.rglob("*.py")}
    users = sorted(m for m, deps in graph.items() if not m.startswith("bivit.integrations")
                   and any(d.startswith("bivit.integrations") for d in deps))
    assert any(m.startswith("bivit.integrations") for m in graph) and users == []


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


# The package's layers, highest first (docs/architecture.md): a module imports its own layer and the ones below,
# never one above. A module's layer is the row with the longest prefix of its name.
LAYERS = [
    ["bivit", "bivit.__main__", "bivit.cli", "bivit.serve", "bivit.dataset", "bivit.bench", "bivit.integrations"],
    ["bivit.diagnose"],
    ["bivit.core"],
    ["bivit.media"],
    ["bivit.checkpoint"],
    ["bivit.model", "bivit.checkpoint.config"],  # ModelConfig: what the model is built from, read from config.json
    ["bivit.ops"],
    ["bivit.kernels"],
    ["bivit.base", "bivit.errors"],
]


def _layer(module: str) -> int | None:
    """Index of `module`'s layer in LAYERS (0: the top), or None where no row names it."""
    best = None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > len(best[1])):
                best = (i, p)
    return None if best is None else best[0]


def _arrows_up(graph: dict[str, set[str]]) -> list[str]:
    return [f"{m} -> {d}" for m in sorted(graph) for d in sorted(graph[m])
            if d in graph and _layer(d) < _layer(m)]


def test_every_module_has_a_layer_and_no_import_points_back_up():
    graph = {_module_name(p): _imports(p) for p in ROOT.rglob("*.py")}
    assert [m for m in graph if _layer(m) is None] == []
    assert _arrows_up(graph) == []
    # controls: the kernels reaching into the op layer, the op layer into the model, media into the core
    assert _arrows_up({**graph, "bivit.kernels.cuda": graph["bivit.kernels.cuda"] | {"bivit.ops.dispatch"}})
    assert _arrows_up({**graph, "bivit.ops.dispatch": graph["bivit.ops.dispatch"] | {"bivit.model"}})
    assert _arrows_up({**graph, "bivit.media.pixels": graph["bivit.media.pixels"] | {"bivit.core.encoder"}})


def _unregistered_caches(source: str) -> list[str]:
    """Functions of `source` cached with `functools.cache` (or an unbounded `lru_cache`), i.e. process state that
    `bivit.base.state.reset` would not know of."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                text = ast.unparse(d)
                if text in ("functools.cache", "cache") or "maxsize=None" in text:
                    found.append(node.name)
    return found


def test_the_engines_process_state_is_made_through_bivit_state():
    """Kernel choices, proofs and caches of the kernel floor, the op layer and the notices are made with
    `bivit.base.state.memo`/`table`, so the one reset (`refuse`, the tests' `fresh_state`) forgets them all; bounded
    `lru_cache`s of values (RoPE tables) are not state. Control: a bare `functools.cache` is found."""
    paths = [*(ROOT / "ops").rglob("*.py"), *(ROOT / "kernels").rglob("*.py"), ROOT / "base" / "notices.py"]
    assert {p.name for p in paths} >= {"selection.py", "proof.py", "notices.py", "cpu.py"}
    assert [f"{p.name}: {f}" for p in paths for f in _unregistered_caches(p.read_text())] == []
    assert _unregistered_caches("import functools\n@functools.cache\ndef f():\n    return 1\n") == ["f"]


# Imports inside functions at b914131, before issue 43: 128 (counted as `_function_imports` counts). A third is
# the most left: the rest are at module level, where the import graph and a reader see them.
FUNCTION_IMPORTS_BEFORE = 128


def _function_imports(source: str) -> list[tuple[int, bool]]:
    """(line, says why) of each import statement inside a function of `source`: whether a comment sits on one of
    its lines or on the line above it (a comment-only line)."""
    lines = source.splitlines()
    comments = {i for i, ln in enumerate(lines, 1) if "#" in ln}  # imports hold no "#" in a string
    found = []

    def visit(node: ast.AST, inside: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if inside and isinstance(child, (ast.Import, ast.ImportFrom)):
                own = set(range(child.lineno, child.end_lineno + 1))
                above = child.lineno - 1
                says = bool(own & comments) or (above in comments and lines[above - 1].lstrip().startswith("#"))
                found.append((child.lineno, says))
            visit(child, inside or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source), False)
    return found


def test_imports_are_at_module_level_unless_a_comment_says_why():
    """An import inside a function hides a dependency from whoever reads the module's head: each one left says
    why (an optional extra, a heavy import a light entry point must not pay, a cycle), and they are at most a
    third of what they were. Controls: an uncommented one and a commented one are told apart."""
    found = {str(p.relative_to(ROOT)): _function_imports(p.read_text()) for p in ROOT.rglob("*.py")}
    silent = [f"{path}:{line}" for path, rows in found.items() for line, says in rows if not says]
    assert silent == []
    assert sum(map(len, found.values())) <= FUNCTION_IMPORTS_BEFORE // 3
    assert _function_imports("import os\ndef f():\n    import json\n    # why\n    import re\n") == [(3, False),
                                                                                                   (5, True)]
