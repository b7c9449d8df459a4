"""The simulator replays the same plan the pp=2 gloo runtime executes (``benchmarks/sim_vs_real.py``).

Runs the benchmark in ``--quick`` mode (profile fitted on this machine with fewer points, one
warm-up and one timed step) and checks: (a) per stage, the simulated order of actions equals the
executed order in the engine's merged timeline, exactly; (b) the simulated step time is within a
factor of two of the measured one.  The design goal is 20% (the full benchmark reports the
figure); on a CPU shared with other jobs timings vary by tens of percent between runs, so the
test's bound only catches a cost model that is wrong, not one that is noisy.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_simulated_order_and_step_time_match_a_real_pp2_run(tmp_path):
    out = tmp_path / "sim_vs_real.json"
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sim_vs_real.py"), "--quick",
                        "--out", str(out), "--timeout", "360"], cwd=REPO, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=390)
    assert p.returncode == 0, p.stdout[-4000:]
    r = json.loads(out.read_text())
    for stage, o in r["orders"].items():
        assert o["executed"], f"stage {stage} executed nothing"
        assert o["simulated"] == o["executed"], (stage, o)
    assert r["orders_equal"] is True
    assert r["num_units"] >= 3, "the batch should produce several units"
    assert abs(r["relative_difference"]) < 1.0, r["relative_difference"]
