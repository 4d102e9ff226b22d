"""Every notebook in notebooks/ runs from top to bottom in a fresh Jupyter kernel (nbclient), so a change that
breaks one fails the suite; and the walkthrough shows what it promises: the explain table, inline plots before
and after the bench, no errors."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")


def _execute(path: Path, workdir: Path, monkeypatch: pytest.MonkeyPatch):
    nb = nbformat.read(path, as_version=4)
    # The kernel imports this checkout's numba_flash, wherever the project is installed from.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("NUMBA_FLASH_QUIET", "1")
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(workdir)}})
    client.execute()
    return nb


def _outputs(cell, kind: str) -> list:
    return [o for o in cell.get("outputs", []) if kind in o.get("data", {})]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path, monkeypatch):
    nb = _execute(path, tmp_path, monkeypatch)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, errors
    if path.name == "walkthrough.ipynb":
        code = [c for c in nb.cells if c.cell_type == "code"]
        by_source = {c.source.splitlines()[-1]: c for c in code}
        assert _outputs(by_source["op.explain(q, k, v, causal=True)"], "text/html"), "explain shows no table"
        assert _outputs(by_source["res"], "text/html"), "the bench results show no table"
        # The progress bar's text, what a saved notebook shows of its widget, reaches its total (not "0/9").
        printed = "".join(o.get("text", "") for o in by_source["res"].get("outputs", [])
                          if o.get("output_type") == "stream")
        ends = re.findall(r"\b(\d+)/(\d+) \[", printed)
        assert ends and ends[-1][0] == ends[-1][1], printed
        # The bench's figure and the user's pyplot figure after it both render inline.
        assert _outputs(by_source["res.plot()"], "image/png")
        mask = next(c for c in code if "block_mask(same_doc_causal" in c.source)
        assert _outputs(mask, "image/png"), "the BlockMask of the mask_mod example is not drawn"
        own = next(c for c in code if "plt.subplots" in c.source)
        assert _outputs(own, "image/png"), "pyplot's inline figure is gone after the bench"


def test_there_is_a_walkthrough():
    assert (REPO / "notebooks" / "walkthrough.ipynb") in NOTEBOOKS
