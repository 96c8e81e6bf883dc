"""The README as a front door and the user journeys' scripts, kept true.

The README stays short (at most 300 lines); its example runs as pasted; its schemes table names every
registered scheme once and says what the support matrix (``lightning_commstrats/support.py``) says
about ``shard="fsdp"`` and ``fault_tolerance=``, with only arguments the schemes take. Every journey
script under ``docs/journeys/`` runs as written and prints the lines its page says it prints.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
from ft_harness import FTRun
from harness import _base_env

import lightning_commstrats
from lightning_commstrats import support

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
JOURNEYS = DOCS / "journeys"
MAX_README_LINES = 300

# The table's columns about a setting, and the support matrix's (axis, value) for each.
SETTING_COLUMNS = {'`shard="fsdp"`': ("shard", "fsdp-2groups"), "`fault_tolerance=`": ("replicas", "fault_tolerance")}


def marked(text: str, name: str) -> str:
    """The text between ``<!-- name:begin ... -->`` and ``<!-- name:end -->``."""
    begin = re.search(rf"<!-- {name}:begin[^>]*-->\n", text)
    assert begin, f"no <!-- {name}:begin --> marker"
    end = text.find(f"<!-- {name}:end -->", begin.end())
    assert end > 0, f"no <!-- {name}:end --> marker"
    return text[begin.end() : end]


def readme_schemes() -> dict[str, dict[str, str]]:
    """The README's schemes table: {scheme: {column: cell}}, the scheme read from its first cell."""
    rows = [line for line in marked(README.read_text(), "schemes").splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in rows[0].strip("|").split("|")]
    table: dict[str, dict[str, str]] = {}
    for row in rows[2:]:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        name = re.match(r"\[?`(\w+)`", cells[0])
        assert name, f"no scheme name in {cells[0]!r}"
        assert name.group(1) not in table, f"{name.group(1)} stands twice in the README's table"
        table[name.group(1)] = dict(zip(header, cells, strict=True))
    return table


def accepting(axis: str, value: str) -> set[str]:
    """The schemes that some supported combination runs with ``axis=value`` (the support matrix)."""
    return {p[1] for p in support.allowed_pairs() if p[0] == "scheme" and (p[2], p[3]) == (axis, value)}


def init_arguments(cls: type) -> set[str]:
    """Every keyword the strategy's constructor takes, its bases' included."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith("lightning_commstrats") and "__init__" in vars(klass):
            names |= set(inspect.signature(klass.__init__).parameters)
    return names


def slug(heading: str) -> str:
    """A heading's anchor as GitHub and MyST make it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_has_at_most_300_lines():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail to docs/ (at most {MAX_README_LINES})"


def test_the_readme_table_names_every_registered_scheme_once():
    names = [cls.strategy_name for cls in lightning_commstrats.STRATEGIES]
    assert sorted(readme_schemes()) == sorted(names)


@pytest.mark.parametrize("column", list(SETTING_COLUMNS))
def test_the_readme_table_says_what_the_support_matrix_says(column: str):
    axis, value = SETTING_COLUMNS[column]
    ok = accepting(axis, value)
    assert ok, f"the support matrix accepts {axis}={value} with no scheme"
    wrong = {
        name: cells[column]
        for name, cells in readme_schemes().items()
        if cells[column] != ("yes" if name in ok else "no")
    }
    assert not wrong, f"README.md's {column} column disagrees with lightning_commstrats/support.py: {wrong}"


def test_the_readme_table_names_only_arguments_the_schemes_take():
    classes = {cls.strategy_name: cls for cls in lightning_commstrats.STRATEGIES}
    unknown = {}
    for name, cells in readme_schemes().items():
        taken = init_arguments(classes[name])
        named = set(re.findall(r"[A-Za-z_]\w*", " ".join(re.findall(r"`([^`]*)`", cells["when"]))))
        if named - taken:
            unknown[name] = sorted(named - taken)
    assert not unknown, f"README.md's table names arguments its schemes do not take: {unknown}"


def test_every_readme_link_to_the_docs_reaches_a_page_and_its_heading():
    broken = []
    for target in re.findall(r"\]\(((?:docs|benchmarks|notebooks)/[^)\s]+)\)", README.read_text()):
        path, _, anchor = target.partition("#")
        page = ROOT / path
        if not page.is_file():
            broken.append(target)
        elif anchor and anchor not in {slug(h) for h in re.findall(r"^#+ (.+)$", page.read_text(), re.MULTILINE)}:
            broken.append(target)
    assert not broken, f"README.md links to pages or headings that do not exist: {broken}"


def run(script: Path, *args: str, cwd: Path, timeout: float = 180) -> str:
    """Run ``script`` as a user would, from ``cwd``; its output (stdout and stderr), after a clean exit."""
    env = _base_env()
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    return out


def page_output(page: Path) -> str:
    """The ```text block under a page's "What it prints" heading."""
    section = page.read_text().split("## What it prints", 1)[1]
    block = re.search(r"^```text\n(.*?)^```$", section, flags=re.DOTALL | re.MULTILINE)
    assert block, f"{page.name}: no ```text block under 'What it prints'"
    return block.group(1)


def assert_both_print(page: Path, out: str, lines: list[str]) -> None:
    shown = page_output(page)
    for line in lines:
        assert re.search(line, shown, flags=re.MULTILINE), f"{page.name} does not show a line matching {line!r}"
        assert re.search(line, out, flags=re.MULTILINE), f"the script printed no line matching {line!r}:\n{out[-3000:]}"


@pytest.mark.parametrize("name", ["one_site", "two_sites", "moe_sites"])
def test_every_journey_page_includes_its_script(name: str):
    page = (JOURNEYS / f"{name}.md").read_text()
    assert f"```{{literalinclude}} {name}.py\n" in page
    assert (JOURNEYS / f"{name}.py").is_file()


def test_the_fault_tolerance_page_includes_its_script():
    assert "```{literalinclude} journeys/replicas.py\n" in (DOCS / "fault_tolerance.md").read_text()


@pytest.mark.multiprocess
def test_the_readme_example_runs_as_pasted(tmp_path):
    block = re.search(r"^```python\n(.*?)^```$", marked(README.read_text(), "readme-example"), re.DOTALL | re.M)
    assert block, "no ```python block between the README's example markers"
    script = tmp_path / "train.py"
    script.write_text(block.group(1))
    out = run(script, cwd=tmp_path)
    assert "`max_steps=32` reached" in out
    printed = re.search(r"^CommStats\(bytes_sent=\d+, calls=\d+, comm_seconds=[\d.]+, steps=32\)$", out, re.M)
    assert printed, out[-3000:]
    shown = README.read_text().split("<!-- readme-example:end -->", 1)[1]
    assert re.search(r"^CommStats\(bytes_sent=\d+, calls=\d+, comm_seconds=[\d.]+, steps=32\)$", shown, re.M)


@pytest.mark.multiprocess
def test_one_site_runs_as_written_and_prints_what_its_page_shows(tmp_path):
    out = run(JOURNEYS / "one_site.py", cwd=tmp_path)
    assert_both_print(
        JOURNEYS / "one_site.md",
        out,
        [r"^\[comm\] steps 32: sent [\d.]+ MB", r"^rank 0 sent \d+ bytes in \d+ collectives over 32 steps$"],
    )


@pytest.mark.multiprocess
def test_two_sites_runs_as_written_and_prints_what_its_page_shows(tmp_path):
    out = run(JOURNEYS / "two_sites.py", cwd=tmp_path)
    assert_both_print(
        JOURNEYS / "two_sites.md",
        out,
        [
            r"^\[comm\] steps 16: .* of it FSDP2's inside the groups\).*fsdp_gather.*weights_quantized",
            r"^\[memory\] rank 0: .*parameters [\d.]+, gradients [\d.]+, optimizer [\d.]+, scheme",
            r"^rank 0 holds 49,728 of the model's 99,456 parameter values$",
        ],
    )


@pytest.mark.slow
@pytest.mark.multiprocess
def test_moe_sites_runs_as_written_and_prints_what_its_page_shows(tmp_path):
    out = run(JOURNEYS / "moe_sites.py", cwd=tmp_path, timeout=300)
    expected = [r"^\[comm\] steps 16: .*tokens [\d.]+ MB.*weights_quantized"]
    expected += [rf"^rank {r} holds experts {2 * (r % 2)}-{2 * (r % 2) + 1} of 4 in each MoE layer$" for r in range(4)]
    assert_both_print(JOURNEYS / "moe_sites.md", out, expected)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_replicas_of_the_fault_tolerance_script_end_with_the_same_model():
    script = JOURNEYS / "replicas.py"
    line = r"^replica (r[01]) stopped at step 32; weights sum (-?[\d.]+)$"
    with FTRun(min_replicas=2) as ft:
        for rid in ("r0", "r1"):
            ft.start(rid, {}, command=[sys.executable, str(script), rid])
        ft.wait(timeout=300, results=False)
        out = "".join(p.read_text() for p in sorted(ft.out.glob("r*.log")))
    ends = dict(re.findall(line, out, flags=re.MULTILINE))
    assert set(ends) == {"r0", "r1"}, out[-5000:]
    assert ends["r0"] == ends["r1"], ends
    shown = dict(re.findall(line, (DOCS / "fault_tolerance.md").read_text(), flags=re.MULTILINE))
    assert set(shown) == {"r0", "r1"} and len(set(shown.values())) == 1, shown
    ft_line = r"^\[ft\] replica 'r[01]': \d+ quorums \(waited [\d.]+ s, longest [\d.]+ s; commits [\d.]+ s\);"
    assert len(re.findall(ft_line, out, flags=re.MULTILINE)) == 2, out[-5000:]
    assert re.search(ft_line, (DOCS / "fault_tolerance.md").read_text(), flags=re.MULTILINE)
