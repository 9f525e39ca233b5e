"""dynbatchd.config is a package split by job (issue 25); every name the rest of the repository
imports from it still resolves there, so the split changed no caller."""

from __future__ import annotations

import re
from pathlib import Path

import dynbatchd.config as cfgmod

ROOT = Path(__file__).resolve().parents[2]
FROM_IMPORT = re.compile(r"from dynbatchd\.config import \(?([\w\s,]+?)\)?(?:\s*#.*)?$", re.M)
ATTRIBUTE = re.compile(r"\bcfgmod\.([A-Za-z_]\w*)")


def names_used() -> set[str]:
    used = set()
    for folder in ("dynbatchd", "plugins", "tests", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            for group in FROM_IMPORT.findall(text):
                used |= {n.split(" as ")[0].strip() for n in group.split(",") if n.strip()}
            used |= set(ATTRIBUTE.findall(text))
    return used


def test_every_name_imported_from_dynbatchd_config_resolves():
    used = names_used()
    assert {"load", "ConfigError", "ChannelSettings", "read_toml", "convert"} <= used   # the scan sees them
    missing = sorted(name for name in used if not hasattr(cfgmod, name))
    assert missing == []


def test_the_public_names_are_the_packages_own_list():
    assert sorted(cfgmod.__all__) == sorted(set(cfgmod.__all__))
    assert all(hasattr(cfgmod, name) for name in cfgmod.__all__)
    assert not any(name.startswith("_") for name in cfgmod.__all__)
