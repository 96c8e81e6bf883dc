"""Sphinx configuration of the documentation site (`make docs`: docs/_build/html/index.html).

The API pages are built from the package's docstrings (Google style, read by napoleon) without the
members a class inherits or overrides from Lightning or torch: a strategy's page shows what this
package adds. The notebooks are rendered from their committed outputs, never executed.
"""

from __future__ import annotations

import inspect
import shutil
import sys
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective

import lightning_commstrats

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent

project = "lightning-commstrats"
author = "lightning-commstrats contributors"
copyright = "the lightning-commstrats contributors"
release = lightning_commstrats.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_nb",  # Markdown pages (MyST) and the notebooks
]

exclude_patterns = ["_build"]
html_theme = "furo"
html_title = f"lightning-commstrats {release}"
# _static/custom.css: code blocks wrap their long lines instead of scrolling sideways
html_static_path = ["_static"]
html_css_files = ["custom.css"]

# Notebooks: their committed outputs, as the test suite left them; never run while building.
nb_execution_mode = "off"
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_default_options = {"show-inheritance": True, "member-order": "bysource"}
autodoc_class_signature = "mixed"
autodoc_typehints = "signature"
# An override without a docstring of its own (a Lightning hook) would show Lightning's text.
autodoc_inherit_docstrings = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# The notebooks live in notebooks/ (the test suite executes them there); Sphinx reads sources only
# under docs/, so they are copied to docs/notebooks/ (ignored by git) on every build.
NOTEBOOKS_SRC = ROOT / "notebooks"
NOTEBOOKS_DST = DOCS / "notebooks"
shutil.rmtree(NOTEBOOKS_DST, ignore_errors=True)
NOTEBOOKS_DST.mkdir()
for notebook in sorted(NOTEBOOKS_SRC.glob("*.ipynb")):
    shutil.copy2(notebook, NOTEBOOKS_DST / notebook.name)


def _foreign(owner: type, name: str) -> bool:
    """Whether ``name`` on ``owner`` is (or overrides) a member of a class from outside the package."""
    for base in inspect.getmro(owner)[1:]:
        if not base.__module__.startswith("lightning_commstrats") and name in vars(base):
            return True
    return False


def _owner(obj: Any) -> type | None:
    func = obj.fget if isinstance(obj, property) else getattr(obj, "__func__", obj)
    qualname = getattr(func, "__qualname__", "")
    module = sys.modules.get(getattr(func, "__module__", None) or "")
    if module is None or "." not in qualname:
        return None
    owner: Any = module
    for part in qualname.split(".")[:-1]:
        owner = getattr(owner, part, None)
    return owner if inspect.isclass(owner) else None


def skip_foreign_members(app: Any, what: str, name: str, obj: Any, skip: bool, options: Any) -> bool | None:
    """Leave out Lightning's and torch's hooks that a class implements: their pages document them."""
    if what == "class":
        owner = _owner(obj)
        if owner is not None and _foreign(owner, name):
            return True
    return None


class RegistryTable(SphinxDirective):
    """The table of registered strategy names, made from ``lightning_commstrats.STRATEGIES`` (MyST pages)."""

    def run(self) -> list[nodes.Node]:
        lines = ["| name | class | what it does |", "|---|---|---|"]
        for cls in lightning_commstrats.STRATEGIES:
            summary = inspect.getdoc(cls).split("\n\n")[0].replace("\n", " ").replace("|", "\\|")
            lines.append(f"| `{cls.strategy_name}` | {{class}}`~lightning_commstrats.{cls.__name__}` | {summary} |")
        container = nodes.container()
        self.state.nested_parse(StringList(lines, source="lightning_commstrats.STRATEGIES"), 0, container)
        return container.children


# The support matrix's values that stand for a setting in the sentence ``supported-schemes`` writes.
SUPPORT_SETTINGS = {
    "shard": ("shard", "fsdp-2groups", '`shard="fsdp"`'),
    "fault_tolerance": ("replicas", "fault_tolerance", "`fault_tolerance=`"),
}


def schemes_accepting(axis: str, value: str) -> tuple[list[str], list[str]]:
    """(schemes that some supported combination runs with ``axis=value``, the others), in registry order,
    from the support matrix (``lightning_commstrats.support``)."""
    from lightning_commstrats import support

    ok = {p[1] for p in support.allowed_pairs() if p[0] == "scheme" and (p[2], p[3]) == (axis, value)}
    schemes = support.AXES["scheme"]
    return [s for s in schemes if s in ok], [s for s in schemes if s not in ok]


class SupportedSchemes(SphinxDirective):
    """One sentence naming the schemes that accept a setting and those that refuse it, made from the
    support matrix when the site is built: ``supported-schemes`` with ``shard`` or ``fault_tolerance``."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        axis, value, words = SUPPORT_SETTINGS[self.arguments[0]]
        ok, refused = schemes_accepting(axis, value)
        sentence = (
            f"{words} works with {', '.join(f'`{s}`' for s in ok)}. "
            f"{', '.join(f'`{s}`' for s in refused)} refuse it when the strategy is built."
        )
        container = nodes.container()
        self.state.nested_parse(StringList([sentence], source="lightning_commstrats.support"), 0, container)
        return container.children


def setup(app: Any) -> dict[str, Any]:
    app.connect("autodoc-skip-member", skip_foreign_members)
    app.add_directive("registry-table", RegistryTable)
    app.add_directive("supported-schemes", SupportedSchemes)
    return {"parallel_read_safe": True}
