"""plan_step with a host tier: one 131072-token sequence of the Llama-3.1-8B shape on one 80 GiB
GPU with its model states in host memory trains only with a host budget, within both budgets."""
from __future__ import annotations

import dataclasses

import pytest

from infinipipe_hf.ir.levels import HOST_LEVELS
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.search.api import PlanOptions, plan_step
from infinipipe_hf.planner.validate.validator import validate

GIB = 2**30
LENGTH = 131072


@pytest.fixture(scope="module")
def spec():
    spec = ModelSpec.from_json_file(config_path("llama3.1-8b"))
    assert spec.max_position_embeddings >= LENGTH
    return spec


def test_one_long_sequence_on_one_gpu_needs_the_host_tier_and_fits_both_budgets(spec):
    dims = ParallelDims(state_offload="states")
    without = plan_step([LENGTH], spec, dims, PlanOptions(memory_budget_bytes=80 * GIB))
    assert not without.feasible
    assert "host" in without.error and "--host-memory-gib" in without.error
    options = PlanOptions(memory_budget_bytes=80 * GIB, host_memory_budget_bytes=256 * GIB)
    result = plan_step([LENGTH], spec, dims, options)
    assert result.feasible, result.error
    plan, sim = result.plan, result.simulation
    assert max(sim.peak_memory_bytes) <= 80 * GIB
    host = plan.info["host_peak_bytes_per_stage"]
    assert len(host) == 1 and plan.info["host_peak_memory_bytes"] == max(host) <= 256 * GIB
    assert result.host_peak_memory_bytes == max(host) == result.summary()["host_peak_memory_bytes"]
    assert result.summary()["host_peak_bytes_per_stage"] == host
    assert max(host) > 100 * GIB  # the states (16 bytes per parameter) are on the host
    # layers offloaded too (inputs, or inputs with their attention outputs)
    assert any(per.get(lv) for per in plan.checkpoint_levels.get(0, {}).values() for lv in HOST_LEVELS)
    validate(plan, options.cost(spec, dims))


def test_no_host_budget_means_no_host_tier(spec):
    options = PlanOptions(memory_budget_bytes=80 * GIB)
    assert options.cost(spec, ParallelDims(pp_degree=4)).host_budget_bytes == 0.0
    result = plan_step([32768], spec, ParallelDims(pp_degree=4), options)
    assert result.feasible and result.plan.info["host_peak_memory_bytes"] == 0.0
    assert not result.plan.offload_kv
    assert not any(per.get(h) for lv in result.plan.checkpoint_levels.values() for per in lv.values() for h in HOST_LEVELS)


def test_host_tier_extends_the_longest_sequence_of_four_stages(spec):
    """393216 tokens on pp 4 do not fit 80 GiB fully checkpointed; with host memory they do, with
    layer inputs offloaded, the simulated peak within 80 GiB and the host peak within its budget."""
    long = dataclasses.replace(spec, max_position_embeddings=1 << 20)
    dims = ParallelDims(pp_degree=4)
    assert not plan_step([393216], long, dims, PlanOptions(memory_budget_bytes=80 * GIB)).feasible
    options = PlanOptions(memory_budget_bytes=80 * GIB, host_memory_budget_bytes=64 * GIB)
    result = plan_step([393216], long, dims, options)
    assert result.feasible, result.error
    assert max(result.simulation.peak_memory_bytes) <= 80 * GIB
    assert 0 < result.plan.info["host_peak_memory_bytes"] <= 64 * GIB


def test_host_tier_never_makes_a_fitting_plan_slower(spec):
    """Where a sequence fits without host memory, the host tier is used only where it saves time
    (offloaded inputs and KV stores spare recompute; their copies hide behind compute)."""
    long = dataclasses.replace(spec, max_position_embeddings=1 << 20)
    dims = ParallelDims(pp_degree=4)
    without = plan_step([262144], long, dims, PlanOptions(memory_budget_bytes=80 * GIB))
    with_host = plan_step([262144], long, dims, PlanOptions(memory_budget_bytes=80 * GIB,
                                                            host_memory_budget_bytes=256 * GIB))
    assert without.feasible and with_host.feasible
    assert with_host.simulation.step_time_s <= without.simulation.step_time_s * (1 + 1e-9)
    assert with_host.plan.info["recompute_time_s"] <= without.plan.info["recompute_time_s"]


def test_a_negative_host_budget_is_refused_naming_the_option():
    with pytest.raises(ValueError, match="host_memory_budget_bytes=-1 must be >= 0"):
        PlanOptions(host_memory_budget_bytes=-1)
