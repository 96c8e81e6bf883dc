"""The communication layer on real ranks: results against local references, bytes against the buffers
each rank handed to the backend (and against wire.py)."""

import pytest
from harness import WORKER, ring_bytes, run_ranks

from lightning_commstrats.comm import wire

COMM_WORKER = WORKER.parent / "comm_worker.py"
NUMELS = [1000, 1001, 7]

pytestmark = pytest.mark.multiprocess


def _check_against_payloads(results, world):
    """The charges against the buffers each rank really handed to the backend."""
    for rank, res in enumerate(results):
        rec, handed = res["recorded"], res["handed"]
        for name, passes in [(f"all_reduce_{k}", 2) for k in NUMELS] + [
            ("all_reduce_bf16", 2),
            ("reduce_scatter", 1),
            ("reduce_scatter_bf16", 1),
        ]:
            ((_, numel, itemsize),) = handed[name]
            assert rec[name] == ring_bytes(numel, itemsize, world, passes), (rank, name, handed[name])
        ((_, numel, itemsize),) = handed["all_gather"]
        assert rec["all_gather"] == (world - 1) * numel * itemsize  # forwards every part but its own
        ((_, numel, itemsize),) = handed["broadcast"]
        assert numel * itemsize == 20
    # a binomial tree delivers the buffer once to each of the other ranks
    assert sum(res["recorded"]["broadcast"] for res in results) == (world - 1) * 20


def _check_bytes(results, world):
    _check_against_payloads(results, world)
    for rank, res in enumerate(results):
        rec = res["recorded"]
        for k in NUMELS:
            assert rec[f"all_reduce_{k}"] == wire.all_reduce_bytes(k, 4, world)
        assert rec["reduce_scatter"] == wire.reduce_scatter_bytes(4 * world, 4, world)
        assert rec["all_gather"] == wire.all_gather_bytes(6, 4, world)
        assert rec["all_to_all"] == rec["all_to_all_rows_sent"] * 3 + 8 * (world - 1)  # rows + the counts
        assert rec["broadcast"] == wire.broadcast_bytes(5, 4, rank, world - 1, world)
    assert sum(res["recorded"]["broadcast"] for res in results) == (world - 1) * 5 * 4


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_and_bytes_gloo(world):
    results = run_ranks({"backend": "gloo", "numels": NUMELS}, world, script=COMM_WORKER)
    assert all("backend='gloo'" in r["comm"] for r in results)
    _check_bytes(results, world)


@pytest.mark.mpi
def test_collectives_and_bytes_mpi():
    results = run_ranks({"backend": "mpi", "numels": NUMELS}, 2, launcher="mpiexec", script=COMM_WORKER)
    assert all("MPICommunicator" in r["comm"] for r in results)
    _check_bytes(results, 2)
