"""EPP's whole-sequence candidate (planner/search/whole_units.py): on one stage with a host tier, a
long sequence as one unit with its MLP in tiles, its layers offloaded, carries no K/V; it is taken
only when it simulates faster than slicing (or nothing else fits), passes the validator and keeps
its tiles through JSON; other layouts and batches never see it."""
from __future__ import annotations

import dataclasses

import pytest

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.cost.model import GIB
from infinipipe_hf.planner.search import whole_units
from infinipipe_hf.planner.search.api import PlanOptions, plan_step
from infinipipe_hf.planner.validate.validator import validate

SPEC = dataclasses.replace(ModelSpec.from_json_file(config_path("llama3.1-8b")), max_position_embeddings=1 << 25)
BUDGET = 71.6 * GIB
HOST = 256 * GIB
LENGTH = 262144


def _plan(dims=None, host=HOST, lengths=(LENGTH,), **kw):
    options = PlanOptions(memory_budget_bytes=BUDGET, host_memory_budget_bytes=host, **kw)
    return plan_step(list(lengths), SPEC, dims or ParallelDims(state_offload="states"), options)


def _tried(result):
    return [c for c in result.candidates if c.get("candidate") == whole_units.KNOB]


def _whole_candidate(length: int = LENGTH):
    """The MLP-tiled whole-sequence candidate of one sequence on one GPU, as the search offers it."""
    from infinipipe_hf.planner.schedules.base import SearchState
    from infinipipe_hf.planner.schedules.pipeline_schedule import PipelineContext

    cost = PlanOptions(memory_budget_bytes=BUDGET, host_memory_budget_bytes=HOST).cost(
        SPEC, ParallelDims(state_offload="states"))
    state = SearchState()
    whole_units.try_whole_sequences(PipelineContext([length], [[0]], cost, "adaptive"), state, "epp")
    return state.best, cost


def test_one_gpu_long_sequence_is_one_tiled_unit_that_fits():
    (plan, sim), cost = _whole_candidate()
    assert plan.info["candidate"] == whole_units.KNOB and len(plan.units) == 1
    assert plan.mlp_tile_tokens == {0: SPEC.hidden_size} and not plan.offload_kv
    mix = plan.checkpoint_mix(0, 0)
    # every layer replayed, most offloaded (inputs, or inputs with their attention outputs)
    assert mix.offload + mix.offload_attn > 0 and mix.total == SPEC.num_layers
    assert sim.feasible and max(sim.peak_memory_bytes) <= BUDGET
    validate(plan, cost)
    assert Plan.from_json(plan.to_json()).mlp_tile_tokens == plan.mlp_tile_tokens


@pytest.mark.parametrize("length", [LENGTH, 327680])
def test_the_whole_sequence_is_taken_only_when_faster_than_slicing(monkeypatch, length):
    """262,144 tokens: slicing (4 slices) simulates faster than the MLP-tiled unit, so the search
    keeps it; 327,680: slices still fit, but the whole sequence with both sides tiled is faster."""
    r = _plan(lengths=(length,))
    whole = [c for c in r.candidates if c.get("candidate") in (whole_units.KNOB, whole_units.KNOB_ATTENTION)
             and c["feasible"]]
    assert r.feasible and whole
    monkeypatch.setattr(whole_units, "wanted", lambda ctx: False)
    sliced = _plan(lengths=(length,))
    assert sliced.feasible and len(sliced.plan.units) > 1 and not sliced.plan.mlp_tile_tokens
    if r.plan.info.get("candidate") is None:  # the search kept its slices: no whole candidate ran faster
        assert r.simulation.step_time_s == sliced.simulation.step_time_s
        assert all(c["step_time_s"] > r.simulation.step_time_s for c in whole)
    else:
        assert r.simulation.step_time_s < sliced.simulation.step_time_s
    assert (r.plan.info.get("candidate") is None) == (length == LENGTH)


def test_tiles_are_priced_in_memory_and_time():
    """The same plan without its tiles needs the whole sequence's MLP intermediates in backward (over
    the budget) and simulates less recompute."""
    from infinipipe_hf.planner.simulate.simulator import simulate

    (plan, _), cost = _whole_candidate()
    tiled = simulate(plan, cost)
    untiled_plan = Plan.from_json(plan.to_json())
    untiled_plan.mlp_tile_tokens = {}
    untiled = simulate(untiled_plan, cost)
    assert tiled.feasible and not untiled.feasible
    assert max(untiled.peak_memory_bytes) > BUDGET >= max(tiled.peak_memory_bytes)
    assert tiled.recompute_time_s > untiled.recompute_time_s
    with pytest.raises(ValueError):
        validate(untiled_plan, cost)


@pytest.mark.parametrize("case", ["no host tier", "two stages", "sp 2", "short sequences", "slice counts given"])
def test_other_layouts_and_batches_never_see_it(case):
    kw = {}
    if case == "no host tier":
        r = _plan(dims=ParallelDims(), host=0.0, lengths=(8192,))
    elif case == "two stages":
        r = _plan(dims=ParallelDims(pp_degree=2, state_offload="states"), lengths=(65536,))
    elif case == "sp 2":
        r = _plan(dims=ParallelDims(sp_degree=2, shard="sp", state_offload="states"), lengths=(65536,))
    elif case == "short sequences":
        r = _plan(lengths=(SPEC.hidden_size, 1000, 300))
    else:
        kw = {"num_slices": [4]}
        r = _plan(lengths=(65536,), **kw)
    assert not _tried(r)
    assert r.plan is None or not r.plan.mlp_tile_tokens


def test_too_long_for_every_candidate_says_so():
    r = _plan(lengths=(2 * 524288,))
    assert not r.feasible and "cannot fit" in r.error
    tried = [c for c in r.candidates if c.get("candidate") in (whole_units.KNOB, whole_units.KNOB_ATTENTION)]
    assert [c["candidate"] for c in tried] == [whole_units.KNOB, whole_units.KNOB_ATTENTION]
    assert not any(c["feasible"] for c in tried) and "host memory" in tried[0]["error"]


def test_attention_side_in_tiles_when_the_mlp_tiles_do_not_fit():
    """491,520 tokens on one GPU: the MLP-tiled unit does not fit the device, the attention-tiled
    one does; every layer recomputed or offloaded, the tiles' projections priced, the peaks within
    both budgets, the key through JSON and the validator."""
    r = _plan(lengths=(491520,))
    tried = {c["candidate"]: c for c in r.candidates if c.get("candidate", "").startswith("whole_sequences")}
    assert not tried[whole_units.KNOB]["feasible"]
    plan = r.plan
    assert r.feasible and plan.info["candidate"] == whole_units.KNOB_ATTENTION and len(plan.units) == 1
    assert plan.attention_tile_tokens == plan.mlp_tile_tokens == {0: SPEC.hidden_size}
    mix = plan.checkpoint_mix(0, 0)
    host = mix.offload + mix.offload_attn + mix.offload_pair
    assert mix.full + host == SPEC.num_layers and host > 0
    assert max(r.simulation.peak_memory_bytes) <= BUDGET and r.host_peak_memory_bytes <= HOST
    validate(plan, None)
    assert Plan.from_json(plan.to_json()).attention_tile_tokens == plan.attention_tile_tokens
    from infinipipe_hf.planner.simulate.simulator import simulate
    cost = PlanOptions(memory_budget_bytes=BUDGET, host_memory_budget_bytes=HOST).cost(SPEC, ParallelDims(state_offload="states"))
    untiled = simulate(dataclasses.replace(plan, attention_tile_tokens={}), cost)
    assert untiled.recompute_time_s < simulate(plan, cost).recompute_time_s  # the tiles' q/k/v/o reruns
    assert max(untiled.peak_memory_bytes) > BUDGET  # the attention side whole does not fit


def test_plan_per_replica_by_hand():
    """Two replicas: each sequence one unit on its replica, forward then backward, the long ones
    tiled; the structure passes the validator."""
    from infinipipe_hf.planner.schedules.pipeline_schedule import PipelineContext

    cost = PlanOptions(memory_budget_bytes=BUDGET, host_memory_budget_bytes=HOST).cost(
        SPEC, ParallelDims(dp_degree=2, shard="dp", state_offload="states"))
    lengths = [9000, 7000, 3000]
    ctx = PipelineContext(lengths, [[0, 2], [1]], cost, "adaptive")
    assert whole_units.wanted(ctx)
    plan = whole_units.whole_sequence_plan(ctx, "epp")
    assert [(u.dp_rank, u.segments[0].seq, u.num_tokens) for u in plan.units] == [(0, 0, 9000), (0, 2, 3000), (1, 1, 7000)]
    assert {d: [str(a) for a in acts[0]] for d, acts in plan.actions.items()} == {0: ["F0", "B0", "F1", "B1"],
                                                                                 1: ["F2", "B2"]}
    assert plan.mlp_tile_tokens == {0: SPEC.hidden_size, 2: SPEC.hidden_size}
    validate(plan, None)
