"""``benchmarks/cpu/ab_runtime.py``'s analysis: the pair ratios, the action classes, and ``--reanalyse``
of the committed raw runs reproducing the committed report (so its figures are the runs' own)."""
from __future__ import annotations

import json
import shutil

import pytest

from benchmarks.lib.paths import RESULTS


@pytest.fixture(scope="module")
def ab():
    from benchmarks.cpu import ab_runtime

    return ab_runtime


def test_pair_is_baseline_time_over_epp_time(ab):
    runs = {"epp": {"step_s": [1.0, 2.0, 1.0], "simulated_step_s": 1.0},
            "seq1f1b": {"step_s": [1.2, 2.2, 1.5], "simulated_step_s": 1.1}}
    p = ab.pair(runs, "seq1f1b")
    assert p["measured_ratios"] == pytest.approx([1.2, 1.1, 1.5])
    assert (p["measured_median"], p["measured_min"], p["measured_max"]) == pytest.approx((1.2, 1.1, 1.5))
    assert p["simulated_ratio"] == pytest.approx(1.1)
    assert p["median_minus_simulated_points"] == pytest.approx(10.0)


def test_too_few_alternations_are_refused(ab):
    with pytest.raises(SystemExit, match="at least 5"):
        ab.main(["--alternations", "4"])


@pytest.mark.parametrize("name", ["ab_runtime", "ab_runtime_0.32gib"])
def test_reanalyse_reproduces_the_committed_report(ab, tmp_path, name):
    for suffix in (".json", ".raw.json", ".profile.json"):
        shutil.copy(RESULTS / f"{name}{suffix}", tmp_path / f"{name}{suffix}")
    committed = json.loads((RESULTS / f"{name}.json").read_text())
    out = tmp_path / f"{name}.json"
    args = ["--reanalyse", "--out", str(out), "--profile", str(tmp_path / f"{name}.profile.json"),
            "--budget-gib", repr(committed["memory_budget_gib"])]
    assert ab.main(args) == 0
    got = json.loads(out.read_text())
    assert got["pairs"] == committed["pairs"]
    assert got["profile_fit"] == committed["profile_fit"]
    for schedule, classes in committed["per_action_class"].items():
        assert got["per_action_class"][schedule].keys() == classes.keys()
        for key, c in classes.items():
            assert got["per_action_class"][schedule][key]["measured_over_predicted"] == pytest.approx(
                c["measured_over_predicted"], rel=1e-9), (schedule, key)
