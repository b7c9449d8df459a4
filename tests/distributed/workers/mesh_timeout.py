"""Mesh-timeout worker (4 ranks, pp 2 x dp 2): the DeviceMesh groups FSDP2 runs on take the
layout's timeout.  Rank 2 never joins an all-reduce on the mesh's dp group {0, 2}; rank 0 must
raise within the timeout (not the default group's 30 minutes): it prints ``RAISED_AFTER <s>``,
writes ``DONE_DIR/done.0`` (``mesh_timeout.py TIMEOUT_S [DONE_DIR]``: rank 2 stays until then) and
exits 3.  (A dim spanning the whole world may reuse the default group, whose timeout is the
launcher's: hence a world of 4.)"""
from __future__ import annotations

import sys
import time

from common import dist, exit_now, init, report_done, stay_until_reported, torch

from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.runtime.parallel.mesh import ParallelLayout

TIMEOUT_S = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
DONE_DIR = sys.argv[2] if len(sys.argv) > 2 else None

if __name__ == "__main__":
    init()
    rank = dist.get_rank()
    layout = ParallelLayout(ParallelDims.for_world(dist.get_world_size(), pp_degree=2), rank, timeout_s=TIMEOUT_S)
    group = layout.mesh.get_group("dp")
    assert dist.get_process_group_ranks(group) == ([0, 2] if rank in (0, 2) else [1, 3])
    dist.all_reduce(torch.ones(2), group=group)  # the group works
    if rank in (1, 3):
        sys.exit(0)
    if rank == 2:
        stay_until_reported(DONE_DIR, 1, TIMEOUT_S * 4 + 10)  # until rank 0 reported (given DONE_DIR)
        sys.exit(0)
    t0 = time.time()
    try:
        dist.all_reduce(torch.ones(2), group=group)
    except Exception as exc:  # gloo raises RuntimeError / DistBackendError on a timeout
        print(f"[rank 0] RAISED_AFTER {time.time() - t0:.2f} {type(exc).__name__}", flush=True)
        report_done(DONE_DIR)
        exit_now(3)
    print("[rank 0] all_reduce finished without rank 1", flush=True)
