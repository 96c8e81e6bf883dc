"""Execute the notebooks and write them back, as they are committed.

    python notebooks/execute.py                  # every notebook
    python notebooks/execute.py cost_model       # the ones named

Each notebook runs in a fresh kernel in its own folder (as a person opening it would), its earlier
outputs cleared first, and is written back without execution timestamps: ``jupyter execute
--inplace`` records when every cell ran in the cell's metadata, so a run with the same results
still rewrote every file. The notebooks save their figures under ``figures/`` beside them
(``$COMMSTRATS_FIGURES`` elsewhere) without the matplotlib version, so the same plot gives the same
bytes: a run whose results have not changed leaves the repository as it was.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent


def execute(path: Path, timeout: int = 600) -> nbformat.NotebookNode:
    """The notebook at ``path`` run from top to bottom in its folder (nothing is written).

    Args:
        path: the ``.ipynb`` file.
        timeout: seconds a cell may run.
    """
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    return nb


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="notebooks to run (cost_model or cost_model.ipynb); default all")
    args = parser.parse_args(argv)
    paths = [HERE / f"{name.removesuffix('.ipynb')}.ipynb" for name in args.names] or sorted(HERE.glob("*.ipynb"))
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        found = ", ".join(p.stem for p in sorted(HERE.glob("*.ipynb")))
        parser.error(f"no notebook {', '.join(missing)} in {HERE}; there are {found}")
    for path in paths:
        print(f"executing {path.name}", flush=True)
        nbformat.write(execute(path), path)


if __name__ == "__main__":
    main()
