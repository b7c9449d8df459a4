"""The cost of a unit on an SP sub-group: per-GPU compute at its own token split, all-to-alls only
within the sub-group (none on one GPU), the stage's states and budget unchanged."""
import pytest

from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.compute import UnitShape
from infinipipe_hf.planner.cost.model import GIB, CostModel
from tests.planner.hand_plans import LLAMA8B

SHAPE = UnitShape(float(6000 * 6000), 6000)


def test_a_sub_group_of_one_prices_the_single_gpu_unit_with_no_all_to_all():
    stage = CostModel(LLAMA8B, dims=ParallelDims(pp_degree=2, sp_degree=4), memory_budget_bytes=80 * GIB)
    one = stage.for_group(1)
    alone = CostModel(LLAMA8B, dims=ParallelDims(pp_degree=2, sp_degree=1), memory_budget_bytes=80 * GIB)
    assert one.ulysses is None and one.group_size == 1 and one.dims.sp_degree == 4
    assert one.coefficients.layer_fwd == alone.coefficients.layer_fwd and one.coefficients.layer_bwd == alone.coefficients.layer_bwd  # no all-to-all term
    for s in range(2):
        assert one.compute.forward_time(s, SHAPE) == alone.compute.forward_time(s, SHAPE)
        assert one.acts.activation_bytes(s, 6000, 1) == alone.acts.activation_bytes(s, 6000, 1)  # every token here
        assert one.acts.kv_bytes(s, 100) == alone.acts.kv_bytes(s, 100)  # every K/V head on the one GPU
    assert one.compute.forward_time(0, SHAPE) > stage.compute.forward_time(0, SHAPE)  # one GPU instead of four


def test_a_sub_group_splits_tokens_and_heads_over_its_own_ranks_only():
    stage = CostModel(LLAMA8B, dims=ParallelDims(pp_degree=1, sp_degree=8))
    four = stage.for_group(4)
    alone4 = CostModel(LLAMA8B, dims=ParallelDims(pp_degree=1, sp_degree=4))
    assert four.ulysses.sp_degree == 4 and four.acts.gpu_tokens(1001) == 251
    assert four.coefficients.layer_fwd == alone4.coefficients.layer_fwd  # Ulysses over 4 ranks, as a 4-rank stage
    assert four.ulysses.all_to_all_time_per_layer(4096) < stage.ulysses.all_to_all_time_per_layer(4096) * 2


def test_a_sub_group_keeps_the_stage_states_split_and_budget():
    stage = CostModel(LLAMA8B, dims=ParallelDims(pp_degree=4, sp_degree=8, shard="sp"), memory_budget_bytes=70 * GIB)
    for g in (1, 2, 4):
        sub = stage.for_group(g)
        assert sub.layers_per_stage == stage.layers_per_stage
        assert sub.memory_budget_bytes == stage.memory_budget_bytes
        assert [sub.acts.static_bytes(s) for s in range(4)] == [stage.acts.static_bytes(s) for s in range(4)]
        assert sub.compute.gradient_sync_time(1, 0.1) == stage.compute.gradient_sync_time(1, 0.1)
    assert stage.for_group(8) is stage and stage.for_group(2) is stage.for_group(2)
    assert stage.for_group(2).for_group(1) is stage.for_group(1)  # one family of costs


def test_sub_groups_inside_a_node_use_its_bandwidth():
    stage = CostModel(LLAMA8B, dims=ParallelDims(pp_degree=1, sp_degree=16, gpus_per_node=8))
    assert stage.ulysses.ranks_per_node == 8  # the whole group spans two nodes
    assert stage.for_group(8).ulysses.ranks_per_node == 8 and stage.for_group(4).ulysses.ranks_per_node == 4
    t16 = stage.ulysses.all_to_all_time(1e8)
    t8 = stage.for_group(8).ulysses.all_to_all_time(1e8)
    assert t8 < t16


def test_a_sub_group_size_must_divide_the_sp_group():
    stage = CostModel(LLAMA8B, dims=ParallelDims(pp_degree=1, sp_degree=4))
    with pytest.raises(ValueError, match="does not divide sp_degree=4"):
        stage.for_group(3)
