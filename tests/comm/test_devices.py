"""Where the communicator makes the tensors of its own messages: on ``Communicator.device`` (CUDA
for NCCL), never on the CPU by default. Checked here with the ``meta`` device standing in for a
GPU, on a communicator that records the tensors handed to its backend."""

from __future__ import annotations

import torch

from lightning_commstrats.comm import Communicator


class Recording(Communicator):
    """Rank 0 of 2 on ``device``; its backend moves nothing and records what it was handed."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(rank=0, world_size=2)
        self.device = device
        self.handed: list[tuple[str, torch.device]] = []

    def _broadcast(self, tensor, src):
        self.handed.append(("broadcast", tensor.device))

    def _all_reduce(self, tensor, op):
        self.handed.append(("all_reduce", tensor.device))

    def _reduce_scatter(self, out, tensor, op):
        raise AssertionError("not used")

    _all_gather = _all_to_all = _reduce_scatter

    def _barrier(self):
        pass


def test_object_broadcast_builds_its_tensors_on_the_communicator_device():
    comm = Recording(torch.device("meta"))
    assert comm.broadcast_object({"a": [1, 2]}, src=0) == {"a": [1, 2]}
    assert comm.handed == [("broadcast", torch.device("meta"))] * 2  # the length, then the bytes
    assert comm.stats.calls == 2


def test_gloo_and_mpi_objects_stay_on_the_cpu():
    comm = Recording(torch.device("cpu"))
    comm.broadcast_object("x", src=0)
    assert {d for _, d in comm.handed} == {torch.device("cpu")}
