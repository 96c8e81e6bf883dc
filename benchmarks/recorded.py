"""Paths as the committed results record them: never the temporary directory a run happened in.

A result file names its config and output folders so that a reader can run it again; an absolute
path (``/tmp/snapB/...``) names one machine's scratch space and means nothing elsewhere. Inside the
checkout a path is kept relative to it; a packaged config keeps its path inside the package; any
other path keeps its last part only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_commstrats"


def portable(path: str | Path) -> str:
    """``path`` as a result file records it (see the module docstring)."""
    p = Path(path)
    if not p.is_absolute():
        return str(p)
    try:
        return str(p.resolve().relative_to(REPO))
    except ValueError:
        pass
    if PACKAGE in p.parts:
        return str(Path(*p.parts[p.parts.index(PACKAGE) :]))
    return p.name


def portable_args(args: Any) -> dict[str, Any]:
    """``vars(args)`` with every absolute path made :func:`portable` (strings that start with ``/``)."""
    return {
        k: portable(v) if isinstance(v, (str, Path)) and str(v).startswith("/") else v for k, v in vars(args).items()
    }
