"""The dashboard as the docs tell a new user to make it (issue 47, finding 7), without minutes of benchmarking:
a run that saved no results (``asv run --python=same`` without ``--set-commit-hash``, ``--quick`` or not, leaves
only benchmarks.json) makes ``make dashboard`` say what to run instead of asv's "benchmarks.json missing" or an
empty page, and the docs' sequence is one that saves results."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _make_dashboard(tmp_path: Path) -> subprocess.CompletedProcess:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    for name in ("setup.cfg", "pyproject.toml", "stamp"):   # the stamp newer than what it depends on
        (tmp_path / name).touch()
    # STAMP and PY overridden: no venv is built, and a publish that runs would fail loudly (false exits 1).
    return subprocess.run(["make", "dashboard", "STAMP=stamp", "PY=false"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)


def test_dashboard_without_saved_results_says_what_to_run(tmp_path):
    for results in ((), ("benchmarks.json", "numba-flash-test/machine.json")):
        for name in results:
            (tmp_path / ".asv" / "results" / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / ".asv" / "results" / name).write_text("{}")
        proc = _make_dashboard(tmp_path)
        assert proc.returncode != 0
        out = proc.stdout + proc.stderr
        assert "no benchmark results in .asv/results" in out and "--set-commit-hash" in out, out
        assert "false -m asv publish" not in out, "publish ran on missing results"


def test_dashboard_publishes_once_results_are_saved(tmp_path):
    result = tmp_path / ".asv" / "results" / "numba-flash-test" / "de726eca-existing-py_python.json"
    result.parent.mkdir(parents=True)
    result.write_text("{}")
    out = _make_dashboard(tmp_path)
    assert "false -m asv publish" in out.stdout + out.stderr   # got as far as publishing


def test_the_docs_asv_runs_save_results():
    """Every ``asv run --python=same`` the docs show sets the commit hash: without it asv saves nothing."""
    for doc in ("docs/guide/bench.md", "docs/BENCHMARKING.md"):
        runs = [line for line in (REPO / doc).read_text().splitlines()
                if re.match(r"\s*asv run\b.*--python=same", line)]
        assert runs, doc
        assert all("--set-commit-hash" in line for line in runs), (doc, runs)
