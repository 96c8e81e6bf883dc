"""The mutant zoo (``tests/mutants/zoo.py``, run by ``make mutants``) still applies to the package as it is.

Running the zoo takes most of an hour; this checks in a second what would make it stop at its start:
every mutant's original text occurs exactly once in its file, the mutated file still parses (a mutant
is a semantic change, never a syntax error), the names are unique, and every test a mutant names exists.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "mutants"))

from zoo import MATRIX, REFERENCE, ZOO, Mutant  # noqa: E402


def test_the_zoo_holds_at_least_30_mutants_with_unique_names():
    names = [m.name for m in ZOO]
    assert len(names) >= 30
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("mutant", ZOO, ids=lambda m: m.name)
def test_a_mutant_applies_exactly_once_and_parses(mutant: Mutant):
    text = (ROOT / mutant.file).read_text()
    assert mutant.original != mutant.mutated
    mutated = mutant.apply(text)  # raises unless the original occurs exactly once
    assert mutated != text
    ast.parse(mutated, filename=mutant.file)
    for entry in (*mutant.tests, REFERENCE, MATRIX):
        path = entry.split("::")[0]
        assert (ROOT / path).is_file(), f"{mutant.name}: {path} does not exist"
        if "::" in entry:
            test = entry.split("::")[1].split("[")[0]
            assert f"def {test}(" in (ROOT / path).read_text(), f"{mutant.name}: no {entry}"


def test_a_mutant_whose_original_is_not_found_once_is_refused():
    m = ZOO[0]
    with pytest.raises(ValueError, match="occurs 0 times"):
        m.apply("nothing here")
    with pytest.raises(ValueError, match="occurs 2 times"):
        m.apply(m.original + "\n" + m.original)
