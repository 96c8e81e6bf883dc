"""Seconds inside the collectives of one pseudo-gradient exchange when the link costs nothing.

    python benchmarks/exchange_overhead.py [--ranks 4 --bits 4 32 --repeats 10]

The part of an exchange's measured communication time that no link rate explains: ``--ranks``
processes on loopback (no rate limit) average a pseudo-gradient of the demo LSTM's shapes (10k
words, 256 units, tied embeddings: ``lstm_demo.yaml``) with :class:`TensorExchange` as ``diloco``
does (scales per row, error feedback), the ranks released together by a barrier before every
exchange, so no rank waits for another's training step. Per exchange, rank by rank: the seconds
inside the collectives (what ``comm_stats.comm_seconds`` counts: the transfers through loopback and
the waiting for the other ranks, which at 4 bits encode and decode between the two stages), the
wall seconds of the whole exchange, and the collectives. Medians over ``--repeats`` exchanges after
two warm-up ones. One thread per rank; the race ran 4 ranks on the same 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import free_port

from lightning_commstrats.comm.torch_dist import TorchCommunicator
from lightning_commstrats.compression import TensorExchange

# the demo LSTM's trainable parameters (lstm_demo.yaml, vocabulary 10,000): tied embedding, LSTM, output bias
SHAPES = [(10_000, 256), (1024, 256), (1024, 256), (1024,), (1024,), (10_000,)]
WARMUP = 2


def _worker(rank: int, ranks: int, port: int, bits: int, repeats: int, queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    comm = TorchCommunicator()
    exchange = TensorExchange(comm, bits, scales="rows", tag="outer")
    generator = torch.Generator().manual_seed(rank)
    rows = []
    for i in range(WARMUP + repeats):
        named = {f"p{j}": 1e-3 * torch.randn(shape, generator=generator) for j, shape in enumerate(SHAPES)}
        dist.barrier()
        comm_seconds, calls = comm.stats.comm_seconds, comm.stats.calls
        start = time.perf_counter()
        exchange.average(named)
        wall = time.perf_counter() - start
        if i >= WARMUP:
            rows.append((comm.stats.comm_seconds - comm_seconds, wall, comm.stats.calls - calls))
    queue.put((rank, rows))
    dist.destroy_process_group()


def measure(ranks: int, bits: int, repeats: int) -> dict[int, list[tuple[float, float, int]]]:
    """Per rank, ``(seconds in collectives, wall seconds, collectives)`` of each measured exchange."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    procs = [context.Process(target=_worker, args=(r, ranks, port, bits, repeats, queue)) for r in range(ranks)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 32])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    print(f"{args.ranks} ranks on loopback, {os.cpu_count()} CPU cores, torch {torch.__version__}")
    print("| bits | rank | in collectives s | wall s | collectives |")
    print("|---|---|---|---|---|")
    for bits in args.bits:
        for rank, rows in sorted(measure(args.ranks, bits, args.repeats).items()):
            inside, wall, calls = (statistics.median(column) for column in zip(*rows, strict=True))
            print(f"| {bits} | {rank} | {inside:.3f} | {wall:.3f} | {calls:.0f} |")


if __name__ == "__main__":
    main()
