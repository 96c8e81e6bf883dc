"""Every notebook runs from top to bottom (in its own folder, as a person would open it), shows its plots
and saves them; the committed notebooks keep their executed plots for readers on the web.

A notebook writes its figures to ``$COMMSTRATS_FIGURES`` (default ``figures/`` beside it) as
``<notebook>_*.png``; the test points that to a temporary folder, so a run leaves the repository as it was.
"""

import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
# the notebooks the issue asked for; more are welcome
REQUIRED = {"cost_model", "convergence", "onebit_inside", "moe_routing", "outer_tradeoff"}
# notebooks that start ranks in separate processes (forked by Lightning)
STARTS_RANKS = {"outer_tradeoff"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _params():
    return [
        pytest.param(p, id=p.name, marks=[pytest.mark.multiprocess] if p.stem in STARTS_RANKS else [])
        for p in NOTEBOOKS
    ]


def _images(nb) -> list:
    """The PNG images a notebook displays (inline matplotlib figures)."""
    return [
        o
        for cell in nb.cells
        if cell.cell_type == "code"
        for o in cell.get("outputs", [])
        if o.get("output_type") in ("display_data", "execute_result") and "image/png" in o.get("data", {})
    ]


def test_there_are_notebooks():
    assert REQUIRED <= {p.stem for p in NOTEBOOKS}, f"missing: {sorted(REQUIRED - {p.stem for p in NOTEBOOKS})}"


@pytest.mark.parametrize("path", _params())
def test_notebook_executes_shows_and_saves_its_plots(path, tmp_path, monkeypatch):
    figures = tmp_path / "figures"
    monkeypatch.setenv("COMMSTRATS_FIGURES", str(figures))  # the kernel inherits the environment
    started = time.time()
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # nothing shown below may come from the committed run
        if cell.cell_type == "code":
            cell.outputs = []
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, "\n".join(line for o in errors for line in o.get("traceback", []))
    assert _images(nb), f"{path.name} displayed no plot (image/png output)"
    saved = sorted(figures.glob(f"{path.stem}_*.png"))
    assert saved, f"{path.name} saved no figure {path.stem}_*.png under $COMMSTRATS_FIGURES"
    for png in saved:
        assert png.stat().st_mtime >= started, f"{png.name} was not written by this run"
        assert png.read_bytes()[:8] == PNG_MAGIC, f"{png.name} is not a PNG"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_keeps_its_plots(path):
    nb = nbformat.read(path, as_version=4)
    assert _images(nb), f"{path.name} is committed without its executed plots: execute it and save the outputs"
