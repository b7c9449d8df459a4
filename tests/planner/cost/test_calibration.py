"""Calibration mechanisms: ideal by default, and each one moves step times the right way, for the
pipeline cost model (EPP's FSDP2 actions) and the non-pipeline alternatives alike; the shipped
default carries the calibration, whole-step efficiency per system.  Mechanisms are checked on the
uncalibrated profile (the ideal machine)."""
import math
from dataclasses import replace

import pytest

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.alternatives.flat_cost import FlatCost
from infinipipe_hf.planner.cost.calibration import (
    Calibration,
    apply_calibration,
    for_system,
    overlapped,
    pricing_line,
    pricing_record,
    ring_extra_s,
)
from infinipipe_hf.planner.cost.compute import UnitShape
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.cost.profile import HardwareProfile, calibrated_profile
from infinipipe_hf.planner.cost.profile import default_profile as shipped_profile
from infinipipe_hf.planner.cost.profile import uncalibrated_profile as default_profile
from infinipipe_hf.planner.search.api import PlanOptions, plan_alternative, plan_step

SPEC = ModelSpec.from_json_file(config_path("llama3-8b"))
BATCH = [8192] * 4 + [2048] * 8 + [512] * 16


def with_cal(**kw) -> HardwareProfile:
    return replace(default_profile(), calibration=Calibration(**kw))


def alt(schedule, profile, world=16, **knobs):
    return plan_alternative(BATCH, SPEC, schedule, world_size=world, profile=profile,
                            memory_budget_bytes=80 * GIB, **knobs).summary()


def test_defaults_are_ideal_and_round_trip():
    p = default_profile()
    assert p.calibration.is_ideal and Calibration().is_ideal
    g, r = [1.0, 2.0, 3.0], [0.5, 0.5]
    assert overlapped(10.0, g, r) == max(g) + max(10.0, sum(g) + sum(r)) + max(r)
    assert overlapped(1.0, g) == max(g) + max(1.0, sum(g))
    q = replace(p, calibration=Calibration(collective_overlap=0.5, group_round_s=1e-3))
    assert HardwareProfile.from_dict(q.to_dict()) == q
    assert HardwareProfile.from_dict({k: v for k, v in p.to_dict().items() if k != "calibration"}) == p


def test_bad_values_and_double_application_are_errors():
    with pytest.raises(ValueError, match="collective_overlap must be in"):
        Calibration(collective_overlap=1.5)
    with pytest.raises(ValueError, match="compute_efficiency must be in"):
        Calibration(compute_efficiency=0.0)
    with pytest.raises(ValueError, match="unknown field"):
        Calibration.from_dict({"overlap": 1.0})
    once = apply_calibration(default_profile(), Calibration(compute_efficiency=0.5))
    with pytest.raises(ValueError, match="already calibrated"):
        apply_calibration(once, Calibration(compute_efficiency=0.5))


def test_compute_efficiency_slows_every_schedule_by_its_inverse():
    slow = apply_calibration(default_profile(), Calibration(compute_efficiency=0.5))
    for schedule in ("epp", "seq1f1b"):
        base = plan_step(BATCH, SPEC, ParallelDims(pp_degree=2), PlanOptions(schedule=schedule, memory_budget_bytes=80 * GIB,
                                                                             profile=default_profile()))
        cal = plan_step(BATCH, SPEC, ParallelDims(pp_degree=2), PlanOptions(schedule=schedule, memory_budget_bytes=80 * GIB, profile=slow))
        assert cal.summary()["tokens_per_s"] < 0.6 * base.summary()["tokens_per_s"]
    one = alt("ulysses-zero3", default_profile(), world=1, checkpointing=8)
    half = alt("ulysses-zero3", slow, world=1, checkpointing=8)
    assert half["tokens_per_s"] == pytest.approx(one["tokens_per_s"] / 2, rel=1e-9)  # pure compute on 1 GPU


def test_collective_overlap_exposes_fsdp_collectives_for_alternatives_and_epp():
    base = alt("ulysses-zero3", default_profile(), sp_degrees=[1], checkpointing=16)
    worse = alt("ulysses-zero3", with_cal(collective_overlap=0.5), sp_degrees=[1], checkpointing=16)
    slower = alt("ulysses-zero3", with_cal(nccl_compute_slowdown=0.2), sp_degrees=[1], checkpointing=16)
    assert worse["step_time_s"] > base["step_time_s"] and slower["step_time_s"] > base["step_time_s"]
    shape = UnitShape(4096.0 ** 2, 4096)
    times = []
    for prof in (default_profile(), with_cal(collective_overlap=0.0)):
        c = CostModel(SPEC, prof, ParallelDims(pp_degree=2, sp_degree=2, shard="sp"))
        times.append((c.compute.forward_time(0, shape), c.backward_time(0, shape)))
    (f0, b0), (f1, b1) = times
    assert f1 > f0 and b1 > b0  # EPP's FSDP2 gathers are priced by the same mechanism
    c = CostModel(SPEC, default_profile(), ParallelDims(pp_degree=2))  # unsharded: nothing to overlap
    assert c.compute.forward_time(0, shape) == CostModel(SPEC, with_cal(collective_overlap=0.0), ParallelDims(pp_degree=2)).compute.forward_time(0, shape)


def test_group_round_cost_charges_groups_of_several_gpus_per_round():
    fixed = 0.01
    for schedule, knobs in (("ulysses-zero3", {"sp_degrees": [4]}), ("flexsp", {})):
        base = alt(schedule, default_profile(), checkpointing=16, **knobs)
        cal = alt(schedule, with_cal(group_round_s=fixed), checkpointing=16, **knobs)
        assert cal["step_time_s"] > base["step_time_s"] + fixed * 0.99
    solo = [alt("ulysses-zero3", p, sp_degrees=[1], checkpointing=16)["step_time_s"]
            for p in (default_profile(), with_cal(group_round_s=fixed))]
    assert solo[0] == solo[1]  # one GPU per group: no group to pay for


def test_ring_step_efficiency_and_merge_slow_ring_cp_only_at_cp_above_one():
    assert ring_extra_s(1.0, 100, 1, 1e12, Calibration(ring_step_efficiency=0.5)) == 0.0
    assert ring_extra_s(1.0, 100, 2, 1e12, Calibration(ring_step_efficiency=0.5)) == pytest.approx(1.0)
    m = Calibration(ring_merge_bytes_per_token=1e3)
    assert ring_extra_s(0.0, 1e6, 8, 1e12, m) == pytest.approx(7 * ring_extra_s(0.0, 1e6, 2, 1e12, m))
    lengths = [65536] * 2
    def tps(profile, cp):
        return plan_alternative(lengths, SPEC, "ring-cp", world_size=8, profile=profile, memory_budget_bytes=80 * GIB,
                                cp_degrees=[cp], checkpointing="full").summary()["tokens_per_s"]
    cal = with_cal(ring_step_efficiency=0.5, ring_merge_bytes_per_token=1e5)
    assert tps(cal, 1) == tps(default_profile(), 1)
    assert tps(cal, 4) < 0.8 * tps(default_profile(), 4)


def test_shipped_calibrated_profile_is_the_default_with_a_fitted_calibration():
    p = calibrated_profile()
    assert p == shipped_profile() and HardwareProfile.load("default") == p
    assert not p.calibration.is_ideal and 0 < p.calibration.compute_efficiency < 1
    k = 1 / p.calibration.compute_efficiency
    assert p.layer_forward.token_s == pytest.approx(default_profile().layer_forward.token_s * k)
    assert math.isfinite(FlatCost.of(SPEC, 8, 80 * GIB, p).states.round_time(1.0, 2.0))
    assert HardwareProfile.load("uncalibrated").calibration.is_ideal


def test_each_system_is_priced_at_its_own_efficiency_unmeasured_ones_at_epps():
    p = shipped_profile()
    c = p.calibration
    assert set(c.system_efficiency) == {"ulysses-zero3", "ring-cp", "ring-cp-packed"}
    assert c.efficiency_of("flexsp") == c.efficiency_of("alst") == c.compute_efficiency
    assert for_system(p, "flexsp") is p
    tt = for_system(p, "ring-cp")
    assert tt.calibration.compute_efficiency == c.system_efficiency["ring-cp"]
    k = c.compute_efficiency / c.system_efficiency["ring-cp"]
    for key in ("layer_forward", "layer_backward", "head_forward", "head_backward"):
        assert getattr(tt, key).token_s == pytest.approx(getattr(p, key).token_s * k)
        assert getattr(tt, key).fixed_s == pytest.approx(getattr(p, key).fixed_s * k)
    assert tt.embedding_token_s == pytest.approx(p.embedding_token_s * k)
    # The same system efficiency from any starting point: the uncalibrated layer speed divided by it.
    assert tt.layer_forward.token_s == pytest.approx(default_profile().layer_forward.token_s / c.system_efficiency["ring-cp"])
    assert for_system(tt, "ring-cp") is tt  # applied once


def test_alternatives_plan_at_their_system_efficiency():
    """ZeRO-3 + Ulysses at torchtitan's measured efficiency is slower than the same plan at EPP's;
    FlexSP (no measurement) is priced at EPP's, exactly as with no per-system entry."""
    p = shipped_profile()
    neutral = replace(p, calibration=replace(p.calibration, system_efficiency={}))
    # One node: compute-bound rounds (across nodes the gathers hide compute and no efficiency shows).
    z_cal, z_neu = (alt("ulysses-zero3", q, world=8, sp_degrees=[1], checkpointing=16) for q in (p, neutral))
    assert z_cal["info"] == z_neu["info"] and z_cal["tokens_per_s"] < z_neu["tokens_per_s"]
    c = p.calibration
    assert z_cal["tokens_per_s"] / z_neu["tokens_per_s"] > c.system_efficiency["ulysses-zero3"] / c.compute_efficiency - 0.02
    f_cal, f_neu = (alt("flexsp", q, world=8) for q in (p, neutral))
    assert f_cal["tokens_per_s"] == f_neu["tokens_per_s"]
    flat = FlatCost.of(SPEC, 8, 80 * GIB, p)
    assert flat.for_system("flexsp") is flat and flat.for_system("ring-cp") is flat.for_system("ring-cp")


def test_pricing_names_the_profile_and_every_efficiency():
    p = shipped_profile()
    r = pricing_record(p, ("ulysses-zero3", "flexsp"))
    assert r["profile"] == p.name and r["epp_efficiency"] == p.calibration.compute_efficiency
    assert r["system_efficiency"]["flexsp"] == p.calibration.compute_efficiency
    line = pricing_line(p, ("ulysses-zero3", "flexsp"))
    assert p.name in line and "flexsp" in line and "no measurement: EPP's" in line


def test_system_efficiency_round_trips_and_bad_values_are_errors():
    c = Calibration(compute_efficiency=0.8, system_efficiency={"ring-cp": 0.7})
    assert Calibration.from_dict(c.to_dict()) == c and not c.is_ideal
    with pytest.raises(ValueError, match=r"system_efficiency\['ring-cp'\] must be in"):
        Calibration(system_efficiency={"ring-cp": 0.0})
    with pytest.raises(ValueError, match="must map schedule names"):
        Calibration.from_dict({"system_efficiency": 0.7})
