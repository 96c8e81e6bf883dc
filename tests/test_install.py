"""What an install gives: the declared lowest versions, and everything but MPI without the [mpi] extra.

``make smoke-lowest`` (a CI step) builds a virtual environment with the lowest supported Lightning
and without the ``[mpi]`` extra, and runs these tests there with the rest of a short subset; in the
development environment (which has the extra) the no-MPI test is skipped.
"""

import os
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from harness import run_ranks
from packaging.version import Version

from lightning_commstrats import AllReduceStrategy, FabricStrategy, LocalSGDStrategy
from lightning_commstrats.comm import MPI4PY_AVAILABLE

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
HINT = re.escape('pip install "lightning-commstrats[mpi]"')


def _lower_bound(name: str) -> Version:
    """The ``>=`` bound of ``name`` among pyproject's dependencies."""
    found = re.search(rf'^\s*"{name}>=([0-9.]+)"', PYPROJECT.read_text(), flags=re.MULTILINE)
    assert found, f"no {name}>= bound in {PYPROJECT}"
    return Version(found.group(1))


def test_installed_versions_meet_the_declared_bounds():
    assert Version(L.__version__) >= _lower_bound("lightning")
    assert Version(torch.__version__.split("+")[0]) >= _lower_bound("torch")
    expected = os.environ.get("COMMSTRATS_EXPECT_LIGHTNING")
    if expected:  # set by `make smoke-lowest`: this run really is on the lowest Lightning
        assert Version(L.__version__) == Version(expected) == _lower_bound("lightning")


@pytest.mark.multiprocess
@pytest.mark.skipif(MPI4PY_AVAILABLE, reason="the [mpi] extra is installed here; `make smoke-lowest` runs this without")
def test_without_the_mpi_extra_everything_but_mpi_works():
    with pytest.raises(ImportError):
        import mpi4py  # noqa: F401
    # MPI-only features fail when they are built, with the install hint
    with pytest.raises(ModuleNotFoundError, match=HINT):
        LocalSGDStrategy()
    with pytest.raises(ModuleNotFoundError, match=HINT):
        AllReduceStrategy(backend="mpi")
    with pytest.raises(ModuleNotFoundError, match=HINT):
        FabricStrategy("local_sgd")
    # and 2-rank training over gloo works: the ranks end with the same weights
    results = run_ranks({"scenarios": {"ar": {"strategy": "allreduce"}}}, 2)
    torch.testing.assert_close(results[1]["ar"]["params"], results[0]["ar"]["params"], atol=0, rtol=0)
    assert results[0]["ar"]["stats"]["grad/bytes_sent"] > 0
