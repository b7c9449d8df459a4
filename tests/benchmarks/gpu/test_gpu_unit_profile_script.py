"""benchmarks/gpu/gpu_unit_profile.py: the CPU dry run times units of every kind through the runtime,
fits a profile ``HardwareProfile`` loads and ``gpu_sim_vs_real.py`` plans with, and reports per
unit kind measured / predicted under the fitted and the base (whole-layer) profile."""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys

import pytest

from benchmarks.lib.paths import REPO

UNIT_KINDS = {"whole", "slice", "pack", "hybrid"}


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def mod():
    from benchmarks.gpu import gpu_unit_profile

    return gpu_unit_profile


def test_unit_kinds_of_segments(mod):
    assert [mod.unit_kind(s) for s in ([[0, 8]], [[8, 16]], [[0, 4], [0, 4]], [[8, 16], [0, 4]])] == \
        ["whole", "slice", "pack", "hybrid"]
    shapes = mod.FIT_UNITS + mod.HELD_OUT_UNITS
    assert {mod.unit_kind(s) for s in mod.FIT_UNITS} == {mod.unit_kind(s) for s in mod.HELD_OUT_UNITS} == UNIT_KINDS
    assert max(sum(b - a for a, b in s) for s in shapes) <= 32 and max(b for s in shapes for _, b in s) <= 32


def test_dry_run_fits_a_profile_on_every_unit_kind_that_the_simulator_accepts(tmp_path):
    from infinipipe_hf.planner.cost.profile import HardwareProfile

    prof_path, out = tmp_path / "units.profile.json", tmp_path / "gpu_unit_profile.json"
    p = _run("-m", "benchmarks.gpu.gpu_unit_profile", "--tiny", "--device", "cpu", "--dtype", "fp32", "--repeat", "5",
             "--profile-out", str(prof_path), "--out", str(out))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads(out.read_text())
    kinds = {split: {e["unit_kind"] for e in rep[f"{split}_errors"]} for split in ("fit", "held_out")}
    for split in ("fit", "held_out"):
        assert kinds[split] == UNIT_KINDS | {"loss", "embedding"}
        assert len(rep[f"{split}_errors"]) == len(rep[f"{split}_rows"])
    assert len(rep["base_errors"]) == len(rep["fit_rows"]) + len(rep["held_out_rows"])
    assert set(rep["per_kind"]) == UNIT_KINDS | {"loss", "embedding"}
    for name, kind in rep["per_kind"].items():
        assert kind["rows"] >= 2
        assert all(math.isfinite(kind[k]) and kind[k] > 0 for k in ("fitted_fwd", "fitted_bwd")), (name, kind)
        # The tiny base is fitted on CPU timings of a loaded machine and may price a kind at 0 (ratio inf).
        assert all(kind[k] > 0 for k in ("base_fwd", "base_bwd")), (name, kind)
    assert rep["fit_worst"]["relative_error"] == rep["fit_worst_relative_error"] >= 0
    assert rep["held_out_worst_unit"]["kind"] in UNIT_KINDS
    prof = HardwareProfile.load(prof_path)
    # A layer's cost grows with the unit (the depth difference is one layer, not noise around 0).
    assert prof.to_dict() == rep["profile"]
    assert prof.layer_forward(256**2, 256) > prof.layer_forward(8**2, 8)
    assert prof.layer_backward(256**2, 256) > prof.layer_backward(8**2, 8)
    for k in ("fwd", "bwd"):
        assert statistics.median(s[f"layer_{k}_s"] for s in rep["depth_split"]) > 0
    # Memory figures come from the base (whole-layer) profile; times from the unit rows.
    base = rep["base_profile"]
    assert prof.activation_bytes_per_token_per_layer == base["activation_bytes_per_token_per_layer"]
    assert prof.reference == base["reference"] and prof.to_dict()["layer_forward"] != base["layer_forward"]
    # Stages of one and three layers: per-layer terms from their difference, the rest per unit.
    assert rep["depths"] == [1, 3] and {r["depth"] for r in rep["fit_rows"] if r["kind"] == "unit_stage"} == {1, 3}
    assert set(prof.stage_unit_s) == {"forward", "backward"} and prof.stage_unit_s == rep["stage_unit_s"]
    assert all(v >= 0 for v in prof.stage_unit_s.values())
    assert set(rep["per_kind_stage_unit"]["auto"]) == UNIT_KINDS
    assert all("one_layer_fwd" in rep["per_kind"][k] for k in UNIT_KINDS)

    sim = _run("-m", "benchmarks.gpu.gpu_sim_vs_real", "--tiny", "--device", "cpu", "--dtype", "fp32", "--case",
               "96+32+16x2+8x4:4:adaptive", "--steps", "1", "--profile", str(prof_path),
               "--out", str(tmp_path / "sim.json"))
    assert sim.returncode == 0, sim.stdout[-3000:] + sim.stderr[-3000:]
    res = json.loads((tmp_path / "sim.json").read_text())
    assert res["profile"] == str(prof_path) and res["step_predicted_over_measured"] > 0 and res["actions"]

    # The one-layer fit (--depths none) keeps the per-unit cost in its layer terms: it must not
    # inherit a base profile's stage_unit_s (that would charge it twice).
    one = _run("-m", "benchmarks.gpu.gpu_unit_profile", "--tiny", "--device", "cpu", "--dtype", "fp32", "--repeat", "1",
               "--warmup", "0", "--depths", "none", "--base-profile", str(prof_path),
               "--profile-out", str(tmp_path / "one.json"), "--out", str(tmp_path / "one_report.json"))
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    assert HardwareProfile.load(tmp_path / "one.json").stage_unit_s == {}


def test_a_base_profile_of_another_layer_shape_and_bad_counts_are_refused(tmp_path, capsys, mod):
    from infinipipe_hf.planner.cost.profile import default_profile

    base = tmp_path / "other.profile.json"
    default_profile().save(base)
    common = ["--tiny", "--device", "cpu", "--dtype", "fp32", "--profile-out", str(tmp_path / "p.json"),
              "--out", str(tmp_path / "r.json")]
    with pytest.raises(SystemExit, match="layer shape"):
        mod.main([*common, "--base-profile", str(base)])
    for flag, value in (("--repeat", "0"), ("--warmup", "-1"), ("--layers", "2"), ("--block", "0")):
        with pytest.raises(SystemExit):
            mod.parse_args([*common, flag, value])
        assert flag in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_the_report_can_join_an_existing_file_under_a_key(tmp_path, mod):
    path = tmp_path / "gpu_profile.json"
    mod.write_report(path, {"a": 1}, "stage_depth_profile")
    assert json.loads(path.read_text()) == {"stage_depth_profile": {"a": 1}}
    path.write_text(json.dumps({"models": [1]}))
    mod.write_report(path, {"a": 2}, "stage_depth_profile")
    assert json.loads(path.read_text()) == {"models": [1], "stage_depth_profile": {"a": 2}}
    mod.write_report(path, {"b": 3}, None)
    assert json.loads(path.read_text()) == {"b": 3}


def test_depths_backends_and_shape_limits_are_parsed(tmp_path, capsys, mod):
    common = ["--tiny", "--profile-out", str(tmp_path / "p.json"), "--out", str(tmp_path / "r.json")]
    args = mod.parse_args([*common, "--depths", "3,1", "--backends", "sdpa,auto", "--max-blocks", "16"])
    assert args.depths == [1, 3] and args.backends == ["sdpa", "auto"]
    assert mod.model_config(args)["num_hidden_layers"] == 5  # a middle stage of 3 layers needs 5
    fit, held = mod.shapes(args)
    assert {mod.unit_kind(s) for s in fit} == {mod.unit_kind(s) for s in held} == UNIT_KINDS
    assert max(b for s in fit + held for _, b in s) <= 16
    assert mod.parse_args([*common, "--depths", "none"]).depths is None
    for bad in ("1", "2,2", "0,3"):
        with pytest.raises(SystemExit):
            mod.parse_args([*common, "--depths", bad])
        assert "--depths" in capsys.readouterr().err
