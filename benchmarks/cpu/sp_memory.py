"""Memory per rank with Ulysses sequence parallelism: sp 2 against sp 1 on the same units (CPU).

    python -m benchmarks.cpu.sp_memory [--out benchmarks/results/sp_memory.json]

Launches ``tests/distributed/workers/sp_memory.py`` on 2 gloo processes: a float32 Llama-shaped
model (hidden 256, 8 heads, 4 K/V heads, 4 layers, pp 1) runs a 1024-token sequence as two
512-token slices, once through a plain stage runner (sp 1) and once as one of two SP ranks.
``saved_tensors_hooks`` count the bytes autograd keeps for backward per rank during each slice's
forward (with 0 and 2 of 4 layers checkpointed); the KV store is measured after the first slice.
Also reported: the prediction ``sp1 / 2 + non-checkpointed layers x tokens x q_dim x 4 B / 2``
(each rank's half of the activations, plus the attention output kept twice, head-sharded by
SDPA and token-sharded by ``o_proj``).  Byte counts do not depend on the machine.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.lib.launch import run_json_worker
from benchmarks.lib.paths import REPO, RESULTS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS / "sp_memory.json"))
    args = ap.parse_args()
    result = run_json_worker(REPO / "tests" / "distributed" / "workers" / "sp_memory.py")
    for row in result["rows"]:
        kept = 4 - row["checkpointed_layers"]
        predicted = row["sp1"]["first_slice_saved_bytes"] / 2 + kept * row["tokens_per_slice"] * 256 * 4 / 2
        row["first_slice_predicted_sp2_bytes"] = predicted
        row["first_slice_measured_over_predicted"] = row["sp2"]["first_slice_saved_bytes"] / predicted
        print(f"{row['checkpointed_layers']} of 4 layers checkpointed: sp2/sp1 saved bytes "
              f"{row['ratio']['first_slice_saved_bytes']:.3f} (first slice), "
              f"{row['ratio']['second_slice_saved_bytes']:.3f} (slice with context); measured/predicted "
              f"{row['first_slice_measured_over_predicted']:.4f}; KV store {row['ratio']['kv_store_bytes']:.3f}")
    result["command"] = "python -m benchmarks.cpu.sp_memory"
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
