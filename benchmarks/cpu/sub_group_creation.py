"""Cost of creating the SP sub-groups' process groups (``ParallelLayout._build_sub_groups``), CPU/gloo.

    python -m benchmarks.cpu.sub_group_creation [--out benchmarks/results/sub_group_creation.json]

For each layout (pp 1 x sp 4, pp 1 x sp 8, pp 2 x sp 4) the script launches ``pp x sp`` gloo
processes on this machine and, on every rank: builds a ``ParallelLayout`` without the sub-groups
(the mesh, link and gradient groups), then times ``_build_sub_groups`` once through
``DeviceMesh._unflatten`` (what the engine uses) and once through the fall-back 4-D
``DeviceMesh``; it counts the process groups each path creates (``_world.group_count``).  Reported
per layout: the slowest rank's seconds and the group counts.  Times depend on the machine (and on
how many processes share its cores); group counts do not.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from benchmarks.lib.launch import torchrun
from benchmarks.lib.paths import RESULTS

LAYOUTS = [(1, 4), (1, 8), (2, 4)]


def worker(pp: int, sp: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from infinipipe_hf.runtime.parallel.mesh import ParallelLayout

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    build = ParallelLayout._build_sub_groups
    ParallelLayout._build_sub_groups = lambda self, timeout, unflatten=True: None
    t0 = time.perf_counter()
    lay = ParallelLayout(world, rank, pp_degree=pp, dp_degree=world // (pp * sp), sp_degree=sp, timeout_s=60)
    base_s = time.perf_counter() - t0
    ParallelLayout._build_sub_groups = build
    row = {"base_layout_s": base_s}
    for name, unflatten in (("unflatten", True), ("fallback_mesh", False)):
        dist.barrier()
        groups0 = c10d._world.group_count
        t0 = time.perf_counter()
        lay._build_sub_groups(None, unflatten=unflatten)
        row[f"{name}_s"] = time.perf_counter() - t0
        row[f"{name}_groups"] = c10d._world.group_count - groups0
        for g, pg in lay.sub_group_pgs.items():  # this rank's aligned sub-group, as the rank formula says
            want = lay.sub_group_of(lay.sp_rank // g * g, g)[1]
            assert dist.get_process_group_ranks(pg) == want, (name, g, dist.get_process_group_ranks(pg), want)
    rows: list = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        slowest = {k: max(r[k] for r in rows) for k in row}
        with open(out, "w") as f:
            json.dump({"pp_degree": pp, "sp_degree": sp, "world_size": world,
                       "sub_group_sizes": sorted(lay.sub_group_pgs), "ranks_checked": True, **slowest}, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS / "sub_group_creation.json"))
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for pp, sp in LAYOUTS:
            raw = Path(tmp) / f"pp{pp}_sp{sp}.json"
            p = torchrun(["-m", "benchmarks.cpu.sub_group_creation", "--worker", pp, sp, raw], pp * sp, 600)
            if p.returncode != 0:
                sys.exit(f"pp {pp} x sp {sp} failed:\n{p.stdout[-4000:]}")
            results.append(json.loads(raw.read_text()))
            print(json.dumps(results[-1]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"what": "seconds (slowest rank) and process groups per rank to create the SP sub-groups, "
                           "gloo on this machine's CPU", "command": "python -m benchmarks.cpu.sub_group_creation",
                   "machine_cores": os.cpu_count(), "load_average_at_end": os.getloadavg(),
                   "torch": version("torch"), "layouts": results},
                  f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        main()
