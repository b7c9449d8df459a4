"""benchmarks/gpu/gpu_unit_profile.py: the CPU dry run times units of every kind through the runtime,
fits a profile ``HardwareProfile`` loads and ``gpu_sim_vs_real.py`` plans with, and reports per
unit kind measured / predicted under the fitted and the base (whole-layer) profile."""
from __future__ import annotations

import json
import math
import os
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
    p = _run("-m", "benchmarks.gpu.gpu_unit_profile", "--tiny", "--device", "cpu", "--dtype", "fp32", "--repeat", "2",
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
    assert prof.to_dict() == rep["profile"] and prof.layer_forward.token_s > 0
    # Memory figures come from the base (whole-layer) profile; times from the unit rows.
    base = rep["base_profile"]
    assert prof.activation_bytes_per_token_per_layer == base["activation_bytes_per_token_per_layer"]
    assert prof.reference == base["reference"] and prof.to_dict()["layer_forward"] != base["layer_forward"]

    sim = _run("-m", "benchmarks.gpu.gpu_sim_vs_real", "--tiny", "--device", "cpu", "--dtype", "fp32", "--case",
               "96+32+16x2+8x4:4:adaptive", "--steps", "1", "--profile", str(prof_path),
               "--out", str(tmp_path / "sim.json"))
    assert sim.returncode == 0, sim.stdout[-3000:] + sim.stderr[-3000:]
    res = json.loads((tmp_path / "sim.json").read_text())
    assert res["profile"] == str(prof_path) and res["step_predicted_over_measured"] > 0 and res["actions"]


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
