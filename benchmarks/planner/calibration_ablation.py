"""Which calibration mechanism moves EPP's ratios: the one-node table's 13B setup re-planned with
the uncalibrated layer fit, the whole-step efficiencies alone (EPP's and each system's), the ring
mechanisms alone, and all of them (the shipped default).

    python -m benchmarks.planner.calibration_ablation     # writes benchmarks/results/calibration_ablation.json
"""
from __future__ import annotations

import json
from dataclasses import replace

from benchmarks.lib.paths import RESULTS
from benchmarks.planner.planner_tables.common import plan_schedules
from benchmarks.planner.planner_tables.setups import batches
from infinipipe_hf.planner.cost.calibration import Calibration, apply_calibration
from infinipipe_hf.planner.cost.profile import default_profile, uncalibrated_profile

c = default_profile().calibration
base = uncalibrated_profile()
profiles = {"uncalibrated": base,
            "efficiency only": apply_calibration(base, Calibration(compute_efficiency=c.compute_efficiency,
                                                                   system_efficiency=dict(c.system_efficiency))),
            "ring only": replace(base, calibration=Calibration(ring_step_efficiency=c.ring_step_efficiency,
                                                               ring_merge_bytes_per_token=c.ring_merge_bytes_per_token)),
            "calibrated (default)": default_profile()}
b = batches(False)
out = {}
for name in ("real:stdlib", "synthetic:short-only"):
    for pname, prof in profiles.items():
        r = plan_schedules(b[name], "llama2-13b", ("epp", "ulysses-zero3", "ring-cp", "ring-cp-packed", "flexsp"), pp=8, profile=prof)
        e = r["epp"]["tokens_per_s"]
        out[(name, pname)] = {k: round(e / v["tokens_per_s"], 3) for k, v in r.items() if k != "epp" and v.get("tokens_per_s")}
        print(name, pname, out[(name, pname)], flush=True)
json.dump({f"{k[0]} | {k[1]}": v for k, v in out.items()}, open(RESULTS / "calibration_ablation.json", "w"), indent=1)
