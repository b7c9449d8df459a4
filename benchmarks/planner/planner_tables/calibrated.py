"""The paper table and the one-node table under the uncalibrated layer fit and the shipped default.

Both profiles plan the same batches with the same code, so every difference is the calibration's
(the default ``infinipipe_hf/profiles/h100_bf16_calibrated.json``, written by
``benchmarks/planner/calibration.py``: EPP at its own measured whole-step efficiency, each measured
alternative at its own, the ring's step cost).
The paper table is reduced to keep the run short (``--models``, ``--batches``; the full table is
``python -m benchmarks.planner.planner_bench --only paper_table``).

    python -m benchmarks.planner.planner_tables.calibrated --models llama2-7b --batches 3
"""
from __future__ import annotations

import argparse
import json
import time

from benchmarks.lib.paths import RESULTS
from benchmarks.planner.planner_tables import paper_table, users_alternatives
from infinipipe_hf.planner.cost.calibration import pricing_record
from infinipipe_hf.planner.cost.profile import default_profile, uncalibrated_profile
from infinipipe_hf.planner.registry import ALTERNATIVES


def run_both(module, quick: bool) -> dict:
    out = {}
    for name, profile in (("uncalibrated", uncalibrated_profile()), ("calibrated", default_profile())):
        print(f"{module.NAME} / {name}", flush=True)
        t0 = time.perf_counter()
        out[name] = module.run(quick, profile)
        out[name]["wall_time_s"] = time.perf_counter() - t0
        out[name]["profile"] = profile.name
        out[name]["pricing"] = pricing_record(profile, ALTERNATIVES)
    return out


COLUMNS = ("epp", "seq1f1b", "ulysses-zero3", "flexsp", "ring-cp", "ring-cp-packed")


def _tps(entry) -> float | None:
    return entry.get("tokens_per_s") if entry and entry.get("feasible", True) else None


def users_markdown(report: dict) -> str:
    """EPP over each system per batch, uncalibrated -> calibrated (the default) (the one-node table)."""
    lines = ["| model | batch | " + " | ".join(f"EPP / {c}" for c in COLUMNS[1:]) + " |",
             "| --- | --- |" + " ---: |" * (len(COLUMNS) - 1)]
    for d_row, c_row in zip(report["uncalibrated"]["rows"], report["calibrated"]["rows"]):
        cells = []
        for col in COLUMNS[1:]:
            pair = []
            for row in (d_row, c_row):
                e, o = _tps(row["schedules"].get("epp")), _tps(row["schedules"].get(col))
                pair.append(f"{e / o:.2f}" if e and o else "OOM")
            cells.append(" -> ".join(pair))
        lines.append(f"| {d_row['model']} | {d_row['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paper_markdown(report: dict) -> str:
    """EPP over each system per setting (aggregate of its batches), uncalibrated -> calibrated (the default)."""
    keys = ("seq1f1b", "ulysses-zero3", "flexsp", "ring-cp")
    lines = ["| model | data | cap | " + " | ".join(f"EPP / {k}" for k in keys) + " | slow net EPP / ulysses |",
             "| --- | --- | ---: |" + " ---: |" * (len(keys) + 1)]
    for d_row, c_row in zip(report["uncalibrated"]["rows"], report["calibrated"]["rows"]):
        cells = [" -> ".join(f"{r['ratios'].get(k) or float('nan'):.2f}" for r in (d_row, c_row)) for k in keys]
        cells.append(" -> ".join(f"{r['slow_ratios'].get('ulysses-zero3') or float('nan'):.2f}" for r in (d_row, c_row)))
        lines.append(f"| {d_row['model']} | {d_row['dataset']} | {d_row['cap'] // 1024}K | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama2-7b", help="paper-table models, comma-separated")
    ap.add_argument("--batches", type=int, default=3, help="paper-table batches per setting")
    ap.add_argument("--only", default="paper_table,users_alternatives")
    ap.add_argument("--render", action="store_true", help="only rewrite the markdown of existing results")
    args = ap.parse_args()
    paper_table.MODELS = tuple(args.models.split(","))
    paper_table.NUM_BATCHES = args.batches
    for module in (paper_table, users_alternatives):
        if module.NAME not in args.only.split(","):
            continue
        path = RESULTS / f"planner_{module.NAME}_calibrated.json"
        if args.render:
            report = json.loads(path.read_text())
            report["markdown"] = (paper_markdown if module is paper_table else users_markdown)(report)
            path.write_text(json.dumps(report, indent=1))
            print(report["markdown"])
            continue
        report = run_both(module, quick=False)
        report["note"] = ("simulated tokens/s under the shipped profile (default) and under the calibrated one "
                          "(calibrated), same batches and code; docs/calibration.md")
        if module is paper_table:
            report["reduced"] = {"models": paper_table.MODELS, "batches_per_setting": args.batches}
        report["markdown"] = (paper_markdown if module is paper_table else users_markdown)(report)
        path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
