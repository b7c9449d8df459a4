"""The CPU AdamW step of offloaded optimizer states, measured on this machine.

    python -m benchmarks.cpu.host_adamw [--params N] [--out benchmarks/results/host_adamw_cpu.json]

The profiler's ``host_adamw`` rows (:mod:`infinipipe_hf.profiling.host`: torch's CPU AdamW,
``fused`` and ``foreach``, over float32 parameters in several tensors, the first step untimed)
with the cores shared by 1, 2, ... local ranks, as a node's ranks share its host.  What it tells:
the parameters per second one core steps (the rate ``state_offload`` pays per GPU is
``host_optimizer_params_per_s`` in the profile; a GPU node gives each GPU several cores, and all
of them share the memory bandwidth, which one machine's row does not show).  Copies between
host and device need CUDA and are not measured here.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
from importlib.metadata import version

from benchmarks.lib.paths import RESULTS
from infinipipe_hf.profiling.host import ADAMW_PARAMS, host_cores, measure_adamw


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=int, default=ADAMW_PARAMS, help="float32 parameters per step (default 16M)")
    ap.add_argument("--out", default=str(RESULTS / "host_adamw_cpu.json"))
    args = ap.parse_args(argv)
    cores = host_cores()
    rows = []
    for ranks in sorted({r for r in (1, 2, 4, 8) if r <= cores} | {cores}):
        for impl in ("fused", "foreach"):
            row = measure_adamw(args.params, impl, ranks=ranks)
            print(f"{impl:8s} {row['threads']:3d} thread(s): {row['params_per_s'] / 1e9:.2f} G parameters/s")
            rows.append(row)
    one_core = max(r["params_per_s"] for r in rows if r["threads"] == 1)
    result = {"what": "CPU AdamW step (torch) over float32 parameters, per thread count", "machine":
              platform.processor() or platform.machine(), "cores": cores, "torch": version("torch"),
              "load_average": os.getloadavg(), "rows": rows, "best_one_core_params_per_s": one_core}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"best on one core: {one_core / 1e9:.2f} G parameters/s -> {args.out}")


if __name__ == "__main__":
    main()
