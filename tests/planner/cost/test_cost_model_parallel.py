"""Cost model with sequence parallelism and sharded states: per-GPU time and bytes, collectives."""
import dataclasses
import math

import pytest

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.units import Segment
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.cost.activations import _act_elements
from infinipipe_hf.planner.cost.collectives import all_gather_time, all_reduce_time
from infinipipe_hf.planner.cost.compute import UnitShape
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.cost.profile import default_profile, uncalibrated_profile

LLAMA2_7B = ModelSpec.from_json_file(config_path("llama2-7b"))  # 32 heads, 32 K/V heads
LLAMA_30B = ModelSpec.from_json_file(config_path("llama-30b"))  # 52 heads
LLAMA2_70B = ModelSpec.from_json_file(config_path("llama2-70b"))  # 64 heads, 8 K/V heads
PROFILE = default_profile()


def test_sp1_unsharded_numbers_are_unchanged():
    # Values printed by the cost model before sequence parallelism and sharding existed (main at
    # d17d21c): the default layout must keep every number bit for bit.
    # On the uncalibrated layer fit the numbers were printed with (the default now adds EPP's efficiency).
    c = CostModel(LLAMA2_7B, uncalibrated_profile(), dims=ParallelDims(pp_degree=4, sp_degree=1, shard="none", dp_degree=1))
    sh = UnitShape.of([Segment(0, 4096, 8192)])
    assert c.compute.forward_time(0, sh) == 0.032690150641629966
    # The recompute of a whole layer does not count down_proj's GEMM, which no checkpoint replay
    # runs (planner/cost/levels.py): 0.0895706471124808 with it, less 2 x that GEMM's share.
    assert c.backward_time(3, sh, 2) == 0.0882105609089361
    assert c.backward_time(3, sh, 0) + 2 * c.coefficients.layer_fwd(sh.pairs, sh.tokens) == 0.0895706471124808
    assert c.compute.transfer_time(8192) == 0.00069108864
    assert c.acts.static_bytes(0) == 28002222080.0
    assert c.acts.kv_bytes(1, 5000) == 1310720000
    # The loss chunk, since: its logits in bf16 and one float32 block (the fused cross-entropy),
    # where two float32 copies of the logits were: 4758317419.642857 - 2 * 4096 * 32000 * 4
    # + 32000 * (4096 * 2 + 1024 * 4).
    assert c.acts.working_bytes(3, 9000, 1, True) == 4102957419.642857
    assert c.compute.gradient_sync_time(0, 1.0) == 0.0


@pytest.mark.parametrize("sp", [2, 4, 8])
def test_per_gpu_compute_is_the_efficiency_curve_at_per_gpu_tokens(sp):
    one = CostModel(LLAMA2_7B, dims=ParallelDims(pp_degree=4))
    many = CostModel(LLAMA2_7B, dims=ParallelDims(pp_degree=4, sp_degree=sp))
    tokens = 4096
    a2a = many.ulysses.all_to_all_time_per_layer(tokens)
    # Linear layers and the fixed cost: exactly a single GPU running tokens / sp tokens.
    assert many.coefficients.layer_fwd(0, tokens) - a2a == pytest.approx(one.coefficients.layer_fwd(0, tokens // sp), rel=1e-12)
    assert many.coefficients.layer_bwd(0, tokens) - a2a == pytest.approx(one.coefficients.layer_bwd(0, tokens // sp), rel=1e-12)
    # Attention: all pairs, 1/sp of the heads.
    assert many.coefficients.layer_fwd.attn_pair_s == pytest.approx(one.coefficients.layer_fwd.attn_pair_s / sp, rel=1e-12)
    # Small units run the GPUs worse per token than big ones.
    assert many.coefficients.layer_fwd(0, 1024) / 1024 > many.coefficients.layer_fwd(0, 65536) / 65536


def test_all_to_all_bytes_and_time_by_hand():
    c = CostModel(LLAMA2_7B, dims=ParallelDims(pp_degree=4, sp_degree=8))
    u = c.ulysses
    # head-sharded per GPU: 32 / 8 = 4 heads of 128 in bf16, for q, k, v and the output.
    assert u.all_to_all_bytes_per_token() == [4 * 128 * 2] * 4
    tokens = 32768
    one = 7 * PROFILE.collective_latency_s + 7 / 8 * tokens * 4 * 128 * 2 / PROFILE.intra_node_bandwidth_bytes_per_s
    assert u.all_to_all_time_per_layer(tokens) == pytest.approx(4 * one, rel=1e-12)
    # The all-to-alls are in every forward and backward layer time (and hence in recompute).
    base = CostModel(LLAMA2_7B, dims=ParallelDims(pp_degree=4))
    assert c.coefficients.layer_fwd.fixed_s - base.coefficients.layer_fwd.fixed_s == pytest.approx(4 * 7 * PROFILE.collective_latency_s)


def test_uneven_heads_cost_the_busiest_rank():
    c = CostModel(LLAMA_30B, dims=ParallelDims(pp_degree=4, sp_degree=8))
    base = CostModel(LLAMA_30B, dims=ParallelDims(pp_degree=4))
    assert c.ulysses.q_heads == 7  # ceil(52 / 8), not 6.5
    assert c.coefficients.layer_fwd.attn_pair_s == pytest.approx(base.coefficients.layer_fwd.attn_pair_s * 7 / 52, rel=1e-12)
    assert c.acts.kv_bytes_per_token_per_layer == 2 * 7 * 128 * 2
    assert c.ulysses.all_to_all_bytes_per_token() == [7 * 128 * 2] * 4
    # Head-shaped activations are held for 7 of 52 heads over all tokens: a little over 1/8.
    assert 1.0 < c.ulysses.activation_scale(1.0e6) < 1.1
    assert c.acts.activation_bytes(1, 8000, 0) > base.acts.activation_bytes(1, 1000, 0)


def test_fewer_kv_heads_than_sp_ranks_replicate_one_per_rank():
    c = CostModel(LLAMA2_70B, dims=ParallelDims(pp_degree=2, sp_degree=16))
    assert c.ulysses.kv_heads == 1 and c.ulysses.q_heads == 4
    assert c.acts.kv_bytes_per_token_per_layer == 2 * 1 * 128 * 2


@pytest.mark.parametrize("sp,share", [(8, 1), (16, 2), (32, 4), (12, 1)])
def test_ranks_sharing_a_kv_head_share_its_store(sp, share):
    """At sp 16 and 32 with 8 K/V heads two and four ranks hold the same head: each keeps its chunk
    of the store (and of its host copies), the attention still reads the whole context, and a
    context read pays the chunks' exchange; at sp 8 (one head each) and sp 12 (heads not shared
    evenly) nothing changes."""
    c = CostModel(LLAMA2_70B, dims=ParallelDims(pp_degree=1, sp_degree=sp), host_budget_bytes=GIB)
    assert c.ulysses.kv_store_share == c.acts.kv_store_share == share
    whole = c.acts.kv_bytes_per_token_per_layer
    assert c.acts.kv_store_bytes_per_token_per_layer == whole / share
    assert c.acts.kv_bytes(0, 5000) == 2 * 5000 * c.num_layers(0) * whole / share
    slice_ = [Segment(0, 40960, 49152)]
    assert c.acts.context_bytes_per_layer(slice_) == 40960 * whole  # the gathered context, whole
    # A read holds the context put together and its concatenation; shared, also the exchange's
    # send and receive buffers beside the own chunks (forward) or summed gradient (backward).
    exchange_copies = 1 + 2 / share if share > 1 else 0
    assert c.acts.context_read_bytes(slice_) == pytest.approx(40960 * whole * (2 + exchange_copies), rel=1e-12)
    assert c.host.kv_copy_bytes(slice_, [True], False) == (40960 + 8192) * whole / share
    exchange = c.ulysses.kv_exchange_s(40960)
    assert (exchange > 0) == (share > 1) and c.ulysses.kv_exchange_s(0) == 0.0
    if share > 1:  # each rank sends its chunk to the other share - 1 ranks, on the node's links
        nbytes = 40960 * 2 * LLAMA2_70B.head_dim * PROFILE.bytes_per_element
        assert exchange == pytest.approx(PROFILE.collective_latency_s * (share - 1)
                                         + nbytes * (share - 1) / share / PROFILE.intra_node_bandwidth_bytes_per_s,
                                         rel=1e-12)


def test_a_shared_kv_stores_exchange_is_in_the_step():
    """The simulator charges a slice with context the exchange of every layer's read (forward),
    and of the gradients' chunks and the replays' reads (backward)."""
    from infinipipe_hf.ir.actions import Action, ActionKind
    from infinipipe_hf.ir.plan import Plan
    from infinipipe_hf.ir.units import Unit
    from infinipipe_hf.planner.simulate.action_costs import ActionCosts

    c = CostModel(LLAMA2_70B, dims=ParallelDims(pp_degree=1, sp_degree=16))
    units = [Unit(0, (Segment(0, 0, 65536),)), Unit(1, (Segment(0, 65536, 131072),))]
    acts = [Action(ActionKind.FORWARD, 0), Action(ActionKind.FORWARD, 1), Action(ActionKind.BACKWARD, 1),
            Action(ActionKind.BACKWARD, 0)]
    plan = Plan("epp", 1, 1, [131072], units, {0: [acts]}, {0: {0: 0, 1: 3}}, [c.num_layers(0)], {}, 16)
    costs = ActionCosts(plan, c)
    per_layer = c.ulysses.kv_exchange_s(65536)
    layers = c.num_layers(0)
    assert costs.kv_exchange(0, acts[0]) == costs.kv_exchange(0, acts[3]) == 0.0  # no context
    assert costs.kv_exchange(0, acts[1]) == pytest.approx(layers * per_layer)
    assert costs.kv_exchange(0, acts[2]) == pytest.approx((layers + 3) * per_layer)


def test_sp_above_head_count_is_a_clear_error():
    with pytest.raises(ValueError, match=r"sp_degree=64 exceeds the model's 52 attention heads.*"
                                         r"1\.\.52 \(an even head split: 1, 2, 4, 13, 26, 52\)"):
        CostModel(LLAMA_30B, dims=ParallelDims(pp_degree=4, sp_degree=64))


def test_memory_per_gpu_divides_by_sp_with_ceil():
    one = CostModel(LLAMA2_7B, dims=ParallelDims(pp_degree=4))
    four = CostModel(LLAMA2_7B, dims=ParallelDims(pp_degree=4, sp_degree=4))
    # 1001 tokens over 4 GPUs: the busiest holds 251, and each non-checkpointed layer keeps the
    # attention output twice (head-sharded for SDPA, token-sharded for o_proj): q_dim more per token.
    # (q_dim elements' share of the profile's measured per-token bytes).
    dup = 251 * one.acts.act_bytes_per_token * LLAMA2_7B.q_dim / _act_elements(LLAMA2_7B, PROFILE.bytes_per_element)
    kept = four.layers_per_stage[1] - 2
    assert four.acts.activation_bytes(1, 1001, 2) == pytest.approx(one.acts.activation_bytes(1, 251, 2) + kept * dup, rel=1e-12)
    assert four.acts.activation_bytes_per_checkpointed_layer(1, 1001) == pytest.approx(
        one.acts.activation_bytes_per_checkpointed_layer(1, 251) + dup, rel=1e-12)
    assert four.acts.kv_bytes(1, 5000) == one.acts.kv_bytes(1, 5000) / 4  # K/V of 8 of the 32 heads
    seg = [Segment(0, 3000, 4000)]
    assert four.acts.context_bytes_per_layer(seg) == one.acts.context_bytes_per_layer(seg) / 4
    # The loss's logits chunk is per GPU token too, up to loss_chunk_tokens (4096 > 9000 / 4).
    loss_four, loss_one = four.acts.loss_chunk_bytes(2250), one.acts.loss_chunk_bytes(9000)
    assert loss_four == one.acts.loss_chunk_bytes(2250) and loss_one == 32000 * (4096 * 2 + 1024 * 4)
    assert four.acts.working_bytes(3, 9000, 1, True) - loss_four < (one.acts.working_bytes(3, 9000, 1, True) - loss_one) / 3
    # Model states are not divided by SP (unsharded).
    assert four.acts.static_bytes(1) == one.acts.static_bytes(1)


def test_transfer_sends_each_gpus_shard_and_crosses_nodes():
    one = CostModel(LLAMA2_7B, dims=ParallelDims(pp_degree=4))
    paper = CostModel(LLAMA2_7B, dims=ParallelDims(pp_degree=4, sp_degree=8))  # stages on different nodes
    p = PROFILE
    assert paper.compute.transfer_time(8000) == pytest.approx(
        p.p2p_latency_s + 1000 * 4096 * 2 / min(p.p2p_bandwidth_bytes_per_s, p.inter_node_bandwidth_bytes_per_s))
    assert CostModel(LLAMA2_7B, dims=ParallelDims(pp_degree=4, sp_degree=2)).compute.transfer_time(8000) == pytest.approx(
        p.p2p_latency_s + 4000 * 4096 * 2 / p.p2p_bandwidth_bytes_per_s)
    assert one.compute.transfer_time(8000) == pytest.approx(p.p2p_latency_s + 8000 * 4096 * 2 / p.p2p_bandwidth_bytes_per_s)


def test_unsharded_gradients_are_all_reduced_over_sp_and_dp():
    c = CostModel(LLAMA2_7B, dims=ParallelDims(pp_degree=4, sp_degree=8))
    want = all_reduce_time(c.acts.stage_params(1) * 4, 8, PROFILE.intra_node_bandwidth_bytes_per_s,
                           PROFILE.collective_latency_s)
    assert c.compute.gradient_sync_time(1, 1.0) == pytest.approx(want, rel=1e-12)
    # Two replicas of 8 GPUs each: one per node, so a stage's gradient group crosses nodes.
    assert CostModel(LLAMA2_7B, dims=ParallelDims(pp_degree=4, sp_degree=2, dp_degree=2)).dims.replica_crosses_nodes
    assert not CostModel(LLAMA2_7B, dims=ParallelDims(pp_degree=2, sp_degree=2, dp_degree=2)).dims.replica_crosses_nodes
    wide = CostModel(LLAMA2_7B, dims=ParallelDims(pp_degree=4, sp_degree=8, dp_degree=2))
    assert wide.compute.gradient_sync_time(1, 1.0) == pytest.approx(all_reduce_time(
        wide.acts.stage_params(1) * 4, 16, PROFILE.inter_node_bandwidth_bytes_per_s, PROFILE.collective_latency_s))


def test_sharded_states_memory():
    c = CostModel(LLAMA2_7B, dims=ParallelDims(pp_degree=4, sp_degree=8, shard="sp"))
    plain = CostModel(LLAMA2_7B, dims=ParallelDims(pp_degree=4, sp_degree=8))
    n = c.acts.stage_params(1)  # 8 decoder layers
    layer = LLAMA2_7B.layer_params
    # fp32 master + Adam sharded over 8, fp32 gradients accumulated unsharded until the step's
    # reduce-scatter, three bf16 copies of a layer (running, prefetched, its gradient).
    assert c.acts.static_bytes(1) == pytest.approx(n * 12 / 8 + n * 4 + 3 * layer * 2, rel=1e-12)
    assert c.acts.static_bytes(1) < plain.acts.static_bytes(1) / 2
    assert c.states.state_bytes_per_rank(1) == pytest.approx(plain.acts.static_bytes(1) / 8, rel=1e-12)
    # Reducing after every unit instead (a what-if) keeps no unsharded gradient.
    unit = CostModel(LLAMA2_7B, dims=ParallelDims(pp_degree=4, sp_degree=8, shard="sp"), grad_reduce="unit")
    assert unit.acts.static_bytes(1) == pytest.approx(n * 16 / 8 + 3 * layer * 2 + layer * 4, rel=1e-12)


def test_sharded_times_overlap_gathers_with_compute():
    slow = dataclasses.replace(PROFILE, intra_node_bandwidth_bytes_per_s=100e9)
    c = CostModel(LLAMA2_7B, slow, ParallelDims(pp_degree=4, sp_degree=8, shard="sp"))
    plain = CostModel(LLAMA2_7B, slow, ParallelDims(pp_degree=4, sp_degree=8))
    gather = all_gather_time(LLAMA2_7B.layer_params * 2, 8, 100e9, PROFILE.collective_latency_s)
    assert c.states.gather_s[1] == [pytest.approx(gather, rel=1e-12)] * 8
    big, small = UnitShape(float(32768 ** 2), 32768), UnitShape(256.0 ** 2, 256)
    # Compute-bound: one gather shows.  Communication-bound: the gathers decide.
    assert c.compute.forward_time(1, big) == pytest.approx(plain.compute.forward_time(1, big) + gather, rel=1e-12)
    assert plain.compute.forward_time(1, small) < 8 * gather
    assert c.compute.forward_time(1, small) == pytest.approx(9 * gather, rel=1e-12)
    assert c.backward_time(1, big, 3) == pytest.approx(plain.backward_time(1, big, 3) + gather, rel=1e-12)
    assert c.compute.slowest_stage_time(big) == pytest.approx(
        max(c.compute.forward_time(s, big) + c.backward_time(s, big) for s in range(4)), rel=1e-12)
    # The reduce-scatters run once, behind the last backward: only the last one shows when the
    # backward is long, the whole chain when it is short.
    r = c.states.reduce_s[1][0]
    assert c.compute.gradient_sync_time(1, 10.0) == pytest.approx(r, rel=1e-12)
    assert c.compute.gradient_sync_time(1, 0.0) == pytest.approx(8 * r, rel=1e-12)


def test_dp_shard_crossing_nodes_uses_the_inter_node_bandwidth():
    c = CostModel(LLAMA2_7B, dims=ParallelDims(pp_degree=4, sp_degree=2, dp_degree=2, shard="dp", gpus_per_node=4))
    assert c.dims.shard_crosses_nodes
    assert c.states.gather_s[1][0] == pytest.approx(all_gather_time(
        LLAMA2_7B.layer_params * 2, 2, PROFILE.inter_node_bandwidth_bytes_per_s, PROFILE.collective_latency_s))


def test_largest_trainable_length_grows_with_sp():
    from infinipipe_hf.planner.search.limits import largest_trainable_length

    one = largest_trainable_length(CostModel(LLAMA2_7B, dims=ParallelDims(pp_degree=4), memory_budget_bytes=80 * GIB))
    eight = largest_trainable_length(CostModel(LLAMA2_7B, dims=ParallelDims(pp_degree=4, sp_degree=8), memory_budget_bytes=80 * GIB))
    # Activations and the K/V store spread over 8 GPUs and the states per GPU stay the same, so the
    # same per-GPU bytes hold about 8 times the tokens.
    assert 7 * one < eight < 9 * one
    assert math.isfinite(one) and one > 0
