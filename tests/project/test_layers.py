"""The package's shape, checked statically: small modules, no import circle, lower layers never
import higher ones.

A module or circle another change is still taking apart may be named in a KNOWN list, with why;
an entry that no longer applies fails the suite until it is taken out, so the lists only shrink
and nothing new joins them unnoticed (all three are empty since issue 25's split). Only module-level imports count (a function-level import is a
deliberate late binding, and no circle at import time).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dynbatchd", "plugins")
MAX_LINES = 400

KNOWN_BIG: dict[str, str] = {   # module -> why it may still be over MAX_LINES (empty since issue 25's split)
}
KNOWN_CIRCLES: dict[frozenset[str], str] = {   # a module of each circle other changes are breaking -> why
}
# Leaves the scheduler may import: modules that import nothing of ours themselves (checked below), so
# they sit under the scheduler (telemetry's ChannelStats, the counters a channel keeps).
BELOW_SCHEDULER = {"dynbatchd.telemetry", "dynbatchd.errors"}
# What the engine may import besides itself and the scheduler: the wire types and the plugin and
# tenancy interfaces, each importing nothing of ours above the errors (checked below). Never the
# daemon, its transport, the devices, the config or the plugins.
BELOW_ENGINE = BELOW_SCHEDULER | {"dynbatchd.protocol", "dynbatchd.hookspecs", "dynbatchd.tenancy"}
KNOWN_LAYER_BREAKS: dict[tuple[str, str], str] = {   # (importer, imported) -> why
}


def module_files() -> dict[str, Path]:
    """Every module of the packages, by dotted name (a package by its own name, not `__init__`)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = module_files()


def _top_level_imports(tree: ast.Module) -> list[ast.stmt]:
    """Import statements that run when the module is imported: at top level, or inside a top-level
    if/try/with (a `try: import x except ImportError`), never inside a function or class."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse   # annotations only: not imported at run time
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            todo += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]
    return found


def imports_of(name: str) -> set[str]:
    """The modules of our packages that module `name` imports at import time."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in _top_level_imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            candidates = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for candidate in candidates:
            while candidate and candidate not in MODULES:   # `import a.b.c` names a.b.c, or a.b's attribute
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                targets.add(candidate)
    return targets


GRAPH = {name: imports_of(name) for name in MODULES}


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan), each one import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


CIRCLES = circles(GRAPH)


def _lines(name: str) -> int:
    return len(MODULES[name].read_text().splitlines())


def test_the_checker_sees_the_package():
    assert "dynbatchd.cli.dynbatchctl" in MODULES and "dynbatchd.cli.output" in GRAPH["dynbatchd.cli.dynbatchctl"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]


def test_no_module_over_the_limit_outside_the_known_list():
    big = {name: _lines(name) for name in MODULES if name not in KNOWN_BIG and _lines(name) > MAX_LINES}
    assert not big, f"over {MAX_LINES} lines: {big} (split it by job)"


def _known(circle: frozenset[str]) -> str | None:
    return next((why for members, why in KNOWN_CIRCLES.items() if members & circle), None)


def test_no_import_circle_outside_the_known_list():
    unknown = [sorted(c) for c in CIRCLES if _known(c) is None]
    assert not unknown, f"import circles: {unknown}"


def layer_breaks() -> set[tuple[str, str]]:
    """Imports from a lower layer to a higher one: the scheduler imports only the scheduler; the
    devices never import the engine."""
    breaks = set()
    for name, targets in GRAPH.items():
        for target in targets:
            if name.startswith("dynbatchd.scheduler") and target.startswith("dynbatchd") \
                    and not target.startswith("dynbatchd.scheduler") and target not in BELOW_SCHEDULER:
                breaks.add((name, target))
            if name.startswith("dynbatchd.engine") and target.startswith("dynbatchd") and not target.startswith(
                    ("dynbatchd.engine", "dynbatchd.scheduler")) and target not in BELOW_ENGINE:
                breaks.add((name, target))
            if name.startswith("dynbatchd.devices") and target.startswith("dynbatchd.engine"):
                breaks.add((name, target))
    return breaks


def test_what_the_scheduler_may_import_is_a_leaf():
    assert {name: GRAPH[name] for name in BELOW_SCHEDULER if GRAPH[name]} == {}


def test_what_the_engine_may_import_sits_below_it():
    assert {name: GRAPH[name] for name in BELOW_ENGINE if GRAPH[name] - {"dynbatchd.errors"}} == {}


def test_the_layer_check_sees_an_engine_or_device_reaching_up():
    saved = dict(GRAPH)
    try:
        GRAPH["dynbatchd.engine.core"] = GRAPH["dynbatchd.engine.core"] | {"dynbatchd.service"}
        GRAPH["dynbatchd.devices.worker"] = GRAPH["dynbatchd.devices.worker"] | {"dynbatchd.engine.view"}
        assert {("dynbatchd.engine.core", "dynbatchd.service"),
                ("dynbatchd.devices.worker", "dynbatchd.engine.view")} <= layer_breaks()
    finally:
        GRAPH.clear()
        GRAPH.update(saved)


def test_no_layer_break_outside_the_known_list():
    unknown = sorted(layer_breaks() - set(KNOWN_LAYER_BREAKS))
    assert not unknown, f"a lower layer imports a higher one: {unknown}"


def test_every_known_exception_still_holds():
    """A module split, a circle broken or a layer mended leaves its KNOWN list in the same change."""
    mended = [name for name in KNOWN_BIG if name not in MODULES or _lines(name) <= MAX_LINES]
    mended += ["<->".join(sorted(m)) for m in KNOWN_CIRCLES if not any(m & c for c in CIRCLES)]
    mended += [f"{a}->{b}" for a, b in KNOWN_LAYER_BREAKS if (a, b) not in layer_breaks()]
    assert not mended, f"mended, take them out of the KNOWN lists: {mended}"
