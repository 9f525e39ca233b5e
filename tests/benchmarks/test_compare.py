"""benchmarks.compare: which trees it runs, side by side (the runs themselves are replaced here)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from benchmarks import compare

REPO = Path(compare.__file__).resolve().parent.parent


@pytest.fixture
def sides(monkeypatch):
    """Records each tree `run_side` is given, with a fixed result, instead of running benchmarks."""
    seen: list[Path] = []

    def fake_run_side(tree: Path, only: str, quick: bool):
        seen.append(tree)
        assert (tree / "dynbatchd").is_dir()
        assert tree == compare.REPO or (tree / "dynbatchd_plugins").is_symlink()   # an export imports its own plugins
        return {"noop-b64": (100.0, 10.0, 2.0)}
    monkeypatch.setattr(compare, "run_side", fake_run_side)
    return seen


def test_without_this_the_working_tree_runs_beside_the_exported_ref(sides, capsys):
    assert compare.main(["HEAD", "--only", "noop-b64"]) == 0
    assert sides[1] == compare.REPO and sides[0] != compare.REPO
    assert "| noop-b64 | 100 | 100 | 1.00 |" in capsys.readouterr().out


def test_this_runs_a_second_exported_commit_instead_of_the_working_tree(sides, capsys):
    first = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()[0]
    assert compare.main([first, "--this", "HEAD", "--only", "noop-b64", "--rounds", "2"]) == 0
    assert len(sides) == 4 and compare.REPO not in sides
    assert sides[0] == sides[2] and sides[1] == sides[3] and sides[0] != sides[1]
    out = capsys.readouterr().out
    assert f"ref {first} vs this tree at HEAD" in out and "(dirty)" not in out


def test_a_round_that_passed_no_rate_is_named_beside_the_mean(monkeypatch, capsys):
    results = iter([(0.0, None, None), (100.0, None, None)])
    monkeypatch.setattr(compare, "run_side", lambda tree, only, quick: {"noop-b64": next(results)})
    assert compare.main(["HEAD", "--only", "noop-b64"]) == 0
    out = capsys.readouterr().out
    assert "noop-b64: 1 of 1 rounds of HEAD passed no rate" in out
    assert out.count("passed no rate") == 1   # the side whose round passed is not named
