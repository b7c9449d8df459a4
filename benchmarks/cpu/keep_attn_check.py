"""keep_attn on real CPU runs: does skipping the attention core on replay save what the cost model says?

    python -m benchmarks.cpu.keep_attn_check [--profile benchmarks/results/sim_vs_real.profile.json]
        → benchmarks/results/keep_attn_check.json

One-layer units (whole sequences and slices behind up to 3K tokens of context) run forward and
backward through the runtime (``benchmarks/lib/runtime_rows.py``: one thread, per-thread CPU seconds,
medians of interleaved repeats) with the layer kept, checkpointed whole, and at ``keep_attn``, and
are compared with the cost model of a CPU profile (by default the one ``benchmarks.cpu.sim_vs_real`` fitted).
The machine's speed drifts between a profile's fit and now, so every ratio is divided by one
speed factor: the median measured / predicted of this run's level-free rows (what ``sim_vs_real``
does with its probes).  The recompute of ``keep_attn`` is derived (the whole layer's less the
fit's attention-core term), never fitted; this checks it, and checks the saving over ``full`` that
the planner buys bytes with.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.cpu.cpu_profile import LEVEL_SHAPES, MODEL, machine, spec_of
from benchmarks.lib.paths import RESULTS

SHAPES = LEVEL_SHAPES + [((2048, 2560),), ((3072, 3584),)]
LEVELS = (None, "full", "keep_attn")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default=str(RESULTS / "sim_vs_real.profile.json"))
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--out", default=str(RESULTS / "keep_attn_check.json"))
    args = ap.parse_args(argv)

    import torch
    import transformers

    from benchmarks.lib.runtime_fit import row_errors
    from benchmarks.lib.runtime_rows import UnitCase, measure_unit_rows
    from benchmarks.lib.shared_cores import load_profile

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL)).float()
    spec, (profile, _) = spec_of(MODEL), load_profile(args.profile)  # one-layer rows: no core sharing
    t0 = time.time()
    rows = measure_unit_rows(copy.deepcopy(model), [UnitCase(s, lv) for s in SHAPES for lv in LEVELS],
                             repeat=args.repeat)
    errors = row_errors(profile, spec, rows)
    speed = statistics.median(e[f"{k}_ratio"] for e in errors if e["level"] is None for k in ("fwd", "bwd"))
    by = {(tuple(map(tuple, e["segments"])), e["level"]): e for e in errors}
    table = []
    for shape in SHAPES:
        none, full, keep = (by[(tuple(shape), lv)] for lv in LEVELS)
        row = {"segments": [list(s) for s in shape], "context": shape[0][0], "tokens": shape[0][1] - shape[0][0]}
        for lv, e in zip(LEVELS, (none, full, keep)):
            row[f"bwd_{lv or 'none'}"] = {"measured_s": e["bwd_measured_s"], "predicted_s": e["bwd_predicted_s"] * speed,
                                          "ratio": e["bwd_ratio"] / speed}
        saved_measured = full["bwd_measured_s"] - keep["bwd_measured_s"]
        saved_predicted = (full["bwd_predicted_s"] - keep["bwd_predicted_s"]) * speed
        row["keep_attn_saving_over_full"] = {"measured_s": saved_measured, "predicted_s": saved_predicted,
                                             "ratio": saved_measured / saved_predicted if saved_predicted else None,
                                             "share_of_full_replay_measured": saved_measured / max(
                                                 full["bwd_measured_s"] - none["bwd_measured_s"], 1e-12)}
        table.append(row)
        print(f"context {row['context']:5d} tokens {row['tokens']:5d}: backward measured/predicted "
              f"none {row['bwd_none']['ratio']:.3f} full {row['bwd_full']['ratio']:.3f} "
              f"keep_attn {row['bwd_keep_attn']['ratio']:.3f}; keep_attn saves {saved_measured * 1e3:.1f} ms "
              f"over full (predicted {saved_predicted * 1e3:.1f} ms)", flush=True)
    ratios = [r[f"bwd_{lv}"]["ratio"] for r in table for lv in ("full", "keep_attn")]
    report = {"what": __doc__.split("\n")[0], "command": "python -m benchmarks.cpu.keep_attn_check",
              "machine": machine(), "profile": args.profile, "repeat": args.repeat,
              "speed_factor": speed, "elapsed_s": time.time() - t0, "rows": table,
              "worst_backward_ratio_full_and_keep_attn": max(ratios, key=lambda r: abs(r - 1)),
              "raw_rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"speed factor {speed:.3f}; worst backward measured/predicted (full, keep_attn) "
          f"{report['worst_backward_ratio_full_and_keep_attn']:.3f}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
