"""The script ``benchmarks/cpu/sim_vs_real.py --quick``: the simulator replays the plans the pp=2 gloo runtime
executes.

The quick mode fits the CPU profile with fewer repeats, sizes a tight memory budget per schedule,
and runs every schedule once at pp 2 (one warm-up, one timed step, one step under the memory
probe).  Checked: per stage the simulated order of actions equals the executed one, exactly;
every plan the test runs is one where EPP slices with context, packs and checkpoints; the
per-action CPU seconds the runtime measured are within 0.6-1.8x of the cost model's work for
each (stage, F/B) (real steps cost more than the profile fitted on isolated measurements says,
and a shared CPU's speed moves within minutes: docs/simulator_vs_real.md; a model off by 2x
still fails); the simulated
step (its profile rescaled to the machine's speed measured by a probe just before the schedule
ran) and each stage's peak memory are within a factor of two of the measured ones, and the bytes
measured at each stage's last action within 1.6x of the simulated ones (buffers the runtime held
past their use pile up there).  Ranks run pinned to cores (rank r on core r % cores) and the
simulator knows it.  The design goals (10% time, 10% memory, every repeat) are the full
benchmark's to report; on a CPU shared with other jobs one quick step can be slowed by tens of percent, so
the test's bounds catch a model that is wrong, not one that is noisy.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_simulated_order_time_and_memory_match_real_pp2_runs(tmp_path):
    out = tmp_path / "sim_vs_real.json"
    p = subprocess.run([sys.executable, "-m", "benchmarks.cpu.sim_vs_real", "--quick", "--max-load", "100",
                        "--out", str(out), "--timeout", "400"], cwd=REPO, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=590)
    assert p.returncode == 0, p.stdout[-4000:]
    r = json.loads(out.read_text())
    runs = r["repeats"][0]["layouts"]["pp2"]
    assert set(runs) == {"epp", "packed-1f1b", "seq1f1b", "gpipe"}
    for name, run in runs.items():
        assert "error" not in run, (name, run)
        assert run["orders_equal"] is True, name
        # The speed probe ran before the schedule and the uncalibrated simulation sits beside it.
        assert 0.2 < run["speed_factor"] < 5.0, (name, run["speed_factor"])
        assert abs(run["uncalibrated_relative_difference"]) < 3.0, name
        assert abs(run["relative_difference"]) < 1.0, (name, run["relative_difference"])
        # The timed step was bracketed by probes and compared at their speed.
        (step,) = run["per_step"]
        assert step["relative_difference"] == run["relative_difference"], (name, step)
        assert 0.2 < step["speed_factor"] < 5.0 and abs(run["pooled_relative_difference"]) < 1.0, (name, run)
        for row in run["breakdown"]["rows"]:
            assert 0.6 < row["cpu_over_simulated_work"] < 1.8, (name, row)
        for stage, mem in run["memory"].items():
            assert 0.5 < mem["simulated_peak_bytes"] / mem["measured_peak_bytes"] < 2.0, (name, stage, mem)
            # Bytes at every action of the peak rank; at the step's last action whatever the
            # runtime holds beyond its use has piled up (gloo sends held to the step's end read
            # 2.5x there at pp 4; since the fix at most 1.37x, from input gradients held a few
            # actions, which the model does not count).
            per = mem["per_action"]
            assert len(per["measured_bytes"]) == len(per["actions"]) and None not in per["measured_bytes"]
            assert per["measured_bytes"][-1] < 1.6 * per["simulated_bytes"][-1], (name, stage, per)
        # CPU outside the actions per rank: the executor's glue and gloo's threads (small, >= 0
        # up to timer resolution).
        outside = run["cpu_outside_actions_s"]
        assert len(outside["executor_glue"]) == len(outside["other_threads"]) == 2, (name, outside)
        assert all(-0.01 < x < 1.0 for x in outside["executor_glue"] + outside["other_threads"]), (name, outside)
        # Something is recomputed: whole layers, or keep_attn / the MLP levels (EPP's plans may
        # use only finer levels).
        assert run["checkpointed_layers"] + run["finer_levels"] > 0, name
    epp = runs["epp"]
    assert epp["units_with_context"] > 0 and epp["packed_units"] > 0 and epp["sliced_sequences"] > 0
    assert r["profile"]["held_out_errors"], "the profile is checked on held-out shapes"
    # Ranks ran pinned to cores, as the simulator replayed them, and the transport's CPU (gloo's
    # threads) was measured by the point-to-point probe and charged to the actions.
    coefficients = r["profile"]["coefficients"]
    assert r["pinned_ranks"] is True and coefficients["pinned_ranks"] is True
    assert coefficients["p2p_cpu_s"] + coefficients["p2p_cpu_s_per_byte"] > 0
    assert all("cpu_s" in row for row in r["profile"]["p2p_rows"])
