import os

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` are skipped, not failed, on a machine without a GPU (``pytest -m cuda``
    then reports them skipped and exits 0)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is available")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_environment():
    """Lightning's launcher exports LOCAL_RANK, MASTER_PORT... into os.environ during fit; a later
    Trainer in the same process would take them for an external launch. Each test starts clean."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def pytest_collection_modifyitems(config, items):
    """Without the ``[mpi]`` extra (mpi4py and an MPI runtime), the tests that need MPI are skipped
    with the reason: those under ``mpiexec`` (``mpi``), those that build an MPI strategy (``mpi4py``,
    or a ``LocalSGDStrategy`` among their parameters)."""
    from lightning_commstrats import LocalSGDStrategy
    from lightning_commstrats.comm import MPI4PY_AVAILABLE

    if MPI4PY_AVAILABLE:
        return
    skip = pytest.mark.skip(reason="needs mpi4py and an MPI runtime (the [mpi] extra), not installed here")
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.get_closest_marker("mpi") or item.get_closest_marker("mpi4py") or LocalSGDStrategy in params.values():
            item.add_marker(skip)
