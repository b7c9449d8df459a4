"""Memory per rank of single-rank units at sp 2 (elastic SP rounds) against the unsplit stage and
the planner's memory model (CPU).

    python -m benchmarks.cpu.sp_rounds_memory [--out benchmarks/results/sp_rounds_memory.json]

Launches ``tests/distributed/workers/sp_rounds_memory.py`` on 2 gloo processes: a float32
Llama-shaped model (hidden 256, 8 heads, 4 K/V heads, 4 layers, pp 1) runs two 1024-token
sequences as 512-token slices, sequence ``r`` entirely on SP rank ``r`` (rounds of two sub-groups
of one).  ``saved_tensors_hooks`` count the bytes autograd keeps during each slice's forward per
rank at four checkpoint mixes; the KV store is measured after the first slice.  Each row holds
the same units through a plain stage runner (sp 1) and ``CostModel.for_group(1)``'s prediction.
Byte counts do not depend on the machine.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.lib.launch import run_json_worker
from benchmarks.lib.paths import REPO, RESULTS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS / "sp_rounds_memory.json"))
    args = ap.parse_args()
    result = run_json_worker(REPO / "tests" / "distributed" / "workers" / "sp_rounds_memory.py")
    for row in result["rows"]:
        got, unsplit, model = row["measured"], row["sp1"], row["model"]
        row["measured_over_sp1"] = {k: got[k] / unsplit[k] for k in ("first_slice", "second_slice", "kv_store")}
        row["measured_over_model"] = {k: got[k] / model[k] for k in ("first_slice", "second_slice", "kv_store")}
        print(f"rank {row['rank']} mix {row['mix']}: measured/sp1 "
              + " ".join(f"{k} {v:.3f}" for k, v in row["measured_over_sp1"].items())
              + "; measured/model " + " ".join(f"{k} {v:.3f}" for k, v in row["measured_over_model"].items())
              + f"; KV store holds sequences {got['kv_sequences']}")
    result["command"] = "python -m benchmarks.cpu.sp_rounds_memory"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
