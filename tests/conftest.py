import os

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that need what this machine lacks are skipped with the reason, not failed:

    - ``cuda`` without a GPU (``pytest -m cuda`` then reports them skipped and exits 0);
    - without the ``[mpi]`` extra (mpi4py and an MPI runtime): those under ``mpiexec`` (``mpi``), those
      that build an MPI strategy (``mpi4py``, or a ``LocalSGDStrategy`` among their parameters).
    """
    from lightning_commstrats import LocalSGDStrategy
    from lightning_commstrats.comm import MPI4PY_AVAILABLE

    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is available")
    no_mpi = pytest.mark.skip(reason="needs mpi4py and an MPI runtime (the [mpi] extra), not installed here")
    for item in items:
        if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        params = getattr(getattr(item, "callspec", None), "params", {})
        needs_mpi = item.get_closest_marker("mpi") or item.get_closest_marker("mpi4py")
        if (needs_mpi or LocalSGDStrategy in params.values()) and not MPI4PY_AVAILABLE:
            item.add_marker(no_mpi)


@pytest.fixture(autouse=True)
def _restore_environment():
    """Lightning's launcher exports LOCAL_RANK, MASTER_PORT... into os.environ during fit; a later
    Trainer in the same process would take them for an external launch. Each test starts clean."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def one_rank_mesh(monkeypatch):
    """A 1-D CPU device mesh over a one-rank gloo group in this process (FSDP2 needs one); a group
    another test left for the process is reused, as the strategies' sharding does."""
    import torch.distributed as dist
    from harness import free_port
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        assert dist.get_world_size() == 1
        yield init_device_mesh("cpu", (1,))
        return
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
