"""Point-to-point cost between two gloo ranks on this machine (launched by torchrun, 2 processes).

    torchrun --standalone --nproc_per_node 2 -m benchmarks.workers.p2p_worker OUT.json SIZE_BYTES...

Ping-pong with the runtime's own calls (``isend`` / ``irecv`` and ``wait`` with a deadline, as
``runtime/comm.py`` posts them): rank 0 sends a float32 tensor of the size, rank 1 sends it back,
``repeat`` times after a warm-up; the one-way time is half the median round trip.  Each rank
also counts its process's CPU seconds over each round trip (every thread: gloo moves the bytes on
its own threads), so ``cpu_s`` is the CPU a message costs both ends together (half the sum over
the two ranks of a round trip, median): on CPU runs that work shares the cores with the stages.
Rank 0 writes ``p2p`` rows (``bytes``, ``seconds``, ``cpu_s``) for ``benchmarks/lib/runtime_fit.fit_p2p``.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

REPEAT, WARMUP = 31, 3


def main(out: str, sizes: list[int]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    peer = 1 - rank
    rows = []
    for nbytes in sizes:
        buf = torch.zeros(max(nbytes // 4, 1))
        rtts, cpus = [], []
        for i in range(WARMUP + REPEAT):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if rank == 0:
                dist.isend(buf, dst=peer, tag=2 * i).wait(timeout=timedelta(seconds=60))
                dist.irecv(buf, src=peer, tag=2 * i + 1).wait(timeout=timedelta(seconds=60))
            else:
                dist.irecv(buf, src=peer, tag=2 * i).wait(timeout=timedelta(seconds=60))
                dist.isend(buf, dst=peer, tag=2 * i + 1).wait(timeout=timedelta(seconds=60))
            if i >= WARMUP:
                rtts.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
        both = [None, None]
        dist.all_gather_object(both, cpus)
        rows.append({"kind": "p2p", "bytes": buf.numel() * 4, "seconds": statistics.median(rtts) / 2,
                     "cpu_s": statistics.median((a + b) / 2 for a, b in zip(*both)), "round_trips": REPEAT})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], [int(x) for x in sys.argv[2:]])
