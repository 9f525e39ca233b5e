"""The wheel ships every package: pyproject.toml lists packages by name, so a new sub-package that is
not listed works in an editable checkout (and in every other test) and is missing from an install."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_package_directory_is_listed_in_pyproject():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(REPO).parts) for init in (REPO / "dynbatchd").rglob("__init__.py")}
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert "dynbatchd_plugins" in listed   # (installed from plugins/, see package-dir)
