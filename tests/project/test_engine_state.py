"""Nothing outside `dynbatchd.engine` reads or writes the engine's own attributes (issue 25: a read
model instead of attributes), checked statically as test_layers checks imports.

The engine is whatever an expression names `engine` (a variable, `self.engine`, `d.engine`,
`self.daemon.engine`), and a name bound to `Engine(...)` or an argument annotated `Engine`. Its
state is every attribute an Engine instance holds (`vars`), so a field added to the engine is
covered without a list to keep. Outside the package code may call its methods and read
`PUBLIC_FIELDS` as plain values; it may not read another attribute, assign or delete any, nor
index or call methods on a public field (`engine.outbox.clear()`).
"""

from __future__ import annotations

import ast
from pathlib import Path

from dynbatchd.engine import Engine
from dynbatchd.engine.view import PUBLIC_FIELDS

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("dynbatchd", "plugins", "benchmarks")
STATE = set(vars(Engine({}, ["cpu"])))


def _engine_names(tree: ast.AST) -> set[str]:
    """`engine`, and any name bound to `Engine(...)` or an argument annotated `Engine`, in the module."""
    names = {"engine"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                ast.unparse(node.value.func).split(".")[-1] == "Engine":
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.arg) and node.annotation is not None and \
                ast.unparse(node.annotation).strip("'\"").split(".")[-1] == "Engine":
            names.add(node.arg)
    return names


def reaches_into_engine(source: str) -> list[tuple[int, str]]:
    """(line, what) for each touch of the engine's own attributes in `source`."""
    tree = ast.parse(source)
    names = _engine_names(tree)

    def _is_engine(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id in names) or (
            isinstance(node, ast.Attribute) and node.attr == "engine")

    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_engine(node.value):
            name, parent = node.attr, parents.get(node)
            if not isinstance(node.ctx, ast.Load):
                found.append((node.lineno, f"writes engine.{name}"))
            elif name in PUBLIC_FIELDS:
                if isinstance(parent, (ast.Attribute, ast.Subscript)) and parent.value is node:
                    found.append((node.lineno, f"reaches through engine.{name}"))
            elif name in STATE or name.startswith("_"):
                found.append((node.lineno, f"reads engine.{name}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "delattr") and len(node.args) >= 2
              and _is_engine(node.args[0]) and isinstance(node.args[1], ast.Constant)
              and (node.func.id != "getattr" or node.args[1].value in STATE - PUBLIC_FIELDS)):
            found.append((node.lineno, f"{node.func.id}(engine, {node.args[1].value!r})"))
    return found


def test_the_check_sees_reads_writes_and_reaching_through():
    source = """
engine.memory_used = 0.5
x = self.daemon.engine.channels["c"]
if d.engine.outbox: pass
n = engine.feeders * 2
engine.outbox.clear()
getattr(engine, "splits")
engine.submit(job, 0)
other.channels
e = Engine({}, ["cpu"])
e.devices[0]
def f(core: "dynbatchd.engine.Engine"): return core.splits
"""
    assert sorted(line for line, _ in reaches_into_engine(source)) == [2, 3, 6, 7, 11, 12]


def test_no_module_outside_the_engine_touches_its_state():
    offenders = []
    for package in CHECKED:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel.parts[:2] == ("dynbatchd", "engine"):
                continue
            offenders += [f"{rel}:{line}: {what}" for line, what in reaches_into_engine(path.read_text())]
    assert offenders == [], "ask the engine's read model (dynbatchd/engine/view.py) instead:\n" + "\n".join(offenders)


def test_the_public_fields_are_the_engines():
    assert PUBLIC_FIELDS <= STATE
