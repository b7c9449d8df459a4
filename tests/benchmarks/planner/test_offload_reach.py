"""``benchmarks/planner/offload_reach.py`` in its reduced mode: the JSON's keys and their sense."""
from __future__ import annotations

import json

import pytest


def test_quick_reach_writes_the_pick_alst_and_the_largest_lengths(tmp_path, capsys):
    from benchmarks.planner import offload_reach

    out = tmp_path / "reach.json"
    assert offload_reach.main(["--quick", "--workers", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert report["host_memory_gib_per_gpu"] == 32.0 and row["gpus"] == 2 and row["length"] == 65536
    epp, alst = row["epp"], row["alst"]
    assert epp["feasible"] and epp["peak_memory_bytes"] <= report["memory_budget_bytes"]
    assert 0 < epp["host_peak_memory_bytes"] <= 32 * 2**30
    # The host tier is what fits the 1B model's states on 16 GiB GPUs at all.
    assert row["largest_length"] >= row["length"] > row["largest_length_without_offload"]
    assert row["alst_full_memory"]["largest_length"] > alst["largest_length"] > 0  # more memory, longer
    same = row if alst["feasible"] else row["at_common_length"]
    if not alst["feasible"]:
        assert same["length"] <= alst["largest_length"] and same["alst"]["feasible"]
        epp, alst = same["epp"], same["alst"]
    assert same["ratio"] == epp["tokens_per_s"] / alst["tokens_per_s"]
    lead = same["lead"]
    assert lead["mechanism"] in ("recompute", "idle", "optimizer_tail", "compute_and_copies")
    for part, step in (("epp_seconds", epp["step_time_s"]), ("alst_seconds", alst["step_time_s"])):
        assert sum(lead[part].values()) == pytest.approx(step) and min(lead[part].values()) > -1e-9
    assert same["lead"]["epp_ahead"] == (same["ratio"] >= 1)
    assert "wrote" in capsys.readouterr().out
