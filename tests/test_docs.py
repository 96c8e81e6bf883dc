"""The documentation site's sources cover the package, the notebooks and the measured results.

`make docs` (CI) builds the site with Sphinx, warnings as errors; these checks need no Sphinx and
fail in `make test` already, naming what is missing: a public name without an API entry, a notebook
or a results table no page shows, an include whose file or marker has gone.
"""

from __future__ import annotations

import importlib
import re
import subprocess
from pathlib import Path

import pytest

import lightning_commstrats

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "results"

# Results files that no page includes, and why.
NOT_SHOWN = {
    # the race's generated index of its per-rate tables; the race's page shows those tables itself
    "standard/results.md",
}

DIRECTIVE = re.compile(r"^\.\. (auto\w+|py:\w+|currentmodule):: (\S+)", re.MULTILINE)
# a MyST include (``{include}`` or ``{literalinclude}``) and its options, up to the closing fence
INCLUDE = re.compile(r"^```\{(include|literalinclude)\} (\S+)\n((?::[\w-]+:.*\n)*)", re.MULTILINE)
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def resolve(path: str):
    """The object at a dotted path: the longest importable module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


def documented_objects() -> list[object]:
    """Every object an API page names in an ``auto*`` or ``py:`` directive."""
    found = []
    for page in sorted((DOCS / "api").glob("*.rst")):
        module = None
        for kind, target in DIRECTIVE.findall(page.read_text()):
            if kind in ("currentmodule", "automodule"):
                module = target
            if kind == "currentmodule":
                continue
            found.append(resolve(target if kind == "automodule" or module is None else f"{module}.{target}"))
    return found


def includes() -> list[tuple[Path, str, Path, dict[str, str]]]:
    """(page, directive, included file, options) for every include of every Markdown page."""
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        if "_build" in page.parts:
            continue
        for kind, target, options in INCLUDE.findall(page.read_text()):
            opts = {}
            for line in options.splitlines():
                name, _, value = line[1:].partition(":")
                opts[name] = value.strip().strip('"')
            found.append((page, kind, (page.parent / target).resolve(), opts))
    return found


def test_every_public_name_has_an_api_entry():
    documented = documented_objects()
    missing = [
        name
        for name in lightning_commstrats.__all__
        if not any(obj is getattr(lightning_commstrats, name) for obj in documented)
    ]
    assert not missing, f"lightning_commstrats.__all__ names without an entry in docs/api/*.rst: {missing}"


def test_every_include_exists_with_its_markers():
    problems = []
    for page, kind, path, opts in includes():
        where = f"{page.relative_to(ROOT)}: {kind} {path}"
        if not path.is_file():
            problems.append(f"{where}: no such file")
            continue
        text = path.read_text()
        problems += [
            f"{where}: {opt} {opts[opt]!r} is not in the file"
            for opt in ("start-after", "end-before")
            if opt in opts and opts[opt] not in text
        ]
    assert not problems, "\n".join(problems)


def test_every_notebook_is_in_the_notebooks_toctree():
    page = (DOCS / "notebooks.md").read_text()
    toctree = re.search(r"```\{toctree\}\n(.*?)```", page, re.DOTALL)
    assert toctree is not None, "docs/notebooks.md has no toctree"
    listed = set(re.findall(r"^notebooks/(\S+)$", toctree.group(1), re.MULTILINE))
    notebooks = {p.stem for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert notebooks, "no notebooks found"
    assert not notebooks - listed, f"notebooks missing from docs/notebooks.md: {sorted(notebooks - listed)}"
    assert not listed - notebooks, f"docs/notebooks.md lists notebooks that do not exist: {sorted(listed - notebooks)}"


def test_every_recipe_and_config_is_on_the_recipes_page():
    included = {path for page, _, path, _ in includes() if page.name == "recipes.md"}
    wanted = set((ROOT / "recipes").glob("*.py")) | set((ROOT / "lightning_commstrats" / "configs").glob("*.yaml"))
    missing = sorted(str(p.relative_to(ROOT)) for p in wanted - included)
    assert not missing, f"not shown in docs/recipes.md: {missing}"


def test_every_results_table_and_plot_is_shown():
    try:
        tracked = subprocess.run(
            ["git", "ls-files", "benchmarks/results"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the committed results are not known")
    files = {
        (ROOT / f).resolve()
        for f in tracked
        if f.endswith((".md", ".png"))
        and "/runs/" not in f
        and Path(f).relative_to("benchmarks/results").as_posix() not in NOT_SHOWN
    }
    assert files, "no results found"
    shown = set()
    for _, kind, path, opts in includes():
        if kind != "include" or not path.is_file():
            continue
        shown.add(path)
        if "relative-images" in opts:
            shown |= {(path.parent / image).resolve() for image in IMAGE.findall(path.read_text())}
    for page in DOCS.rglob("*.md"):
        shown |= {(page.parent / image).resolve() for image in IMAGE.findall(page.read_text())}
    missing = sorted(str(p.relative_to(ROOT)) for p in files - shown)
    assert not missing, f"benchmark results that no page of docs/ shows: {missing}"
