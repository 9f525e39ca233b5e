"""Every dotted `dynbatchd.x.y` name the docs give (docstrings, README, docs/, man pages) exists.

A name is resolved by importing its longest importable module prefix and reading the rest as
attributes, so a doc cannot name a module, class or function that was renamed or never was. Names
that are files, not Python (``dynbatchd.toml``, the man pages, the systemd unit), are not names.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"(?<![\w/.-])dynbatchd(?:\.[A-Za-z_]\w*)+")
# dynbatchd.toml (the config file), dynbatchd.service / .socket (systemd units; dynbatchd.service is
# also a module), dynbatchd.log, the man pages' dynbatchd.8, a file's suffix, not a Python name
FILE_SUFFIXES = {"toml", "log", "socket", "target", "conf", "pid", "sock", "rst", "md", "py", "egg", "yaml"}


def doc_texts() -> dict[str, str]:
    """Where each text comes from -> the text: README, docs/, man page sources, and every docstring."""
    texts = {"README.md": (ROOT / "README.md").read_text()}
    for path in sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "man").glob("*.rst")):
        texts[str(path.relative_to(ROOT))] = path.read_text()
    for package in ("dynbatchd", "plugins"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node, clean=False)
                    if doc:
                        texts[f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 1)}"] = doc
    return texts


def dotted_names() -> dict[str, list[str]]:
    """Each name -> the places that give it."""
    found: dict[str, list[str]] = {}
    for where, text in doc_texts().items():
        for name in NAME.findall(text):
            if name.split(".")[1] in FILE_SUFFIXES or name.split(".")[-1] in FILE_SUFFIXES:
                continue
            found.setdefault(name, []).append(where)
    return found


def resolves(name: str) -> bool:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attribute in parts[cut:]:
                target = getattr(target, attribute)
        except AttributeError:
            return False
        return True
    return False


NAMES = dotted_names()


def test_the_docs_name_things():
    assert "dynbatchd.engine" in NAMES and not resolves("dynbatchd.no_such_module")
    assert resolves("dynbatchd.memory.plan_memory") and not resolves("dynbatchd.memory.no_such_function")


@pytest.mark.parametrize("name", sorted(NAMES))
def test_a_documented_name_exists(name):
    assert resolves(name), f"{name}, named in {', '.join(NAMES[name][:5])}, does not exist"
