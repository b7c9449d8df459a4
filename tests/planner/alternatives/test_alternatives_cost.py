"""Costs of the non-pipeline schedules on a toy profile, checked against hand computations.

The toy model *is* the profile's reference shape, so the cost model uses the profile's
coefficients unscaled and every number below can be worked out on paper: a layer's forward takes
``1e-9 * pairs + 1e-6 * tokens + 1e-3`` seconds, its backward twice that, the head ``1e-7`` /
``2e-7`` seconds per token; parameters per FSDP unit come from the shapes (embedding 100 x 64,
a layer 4 x 64 x 64 + 3 x 128 x 64 + 2 x 64, head 64 + 100 x 64).
"""
import math

import pytest

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.planner.alternatives.flat_cost import FlatCost, FlatLayout
from infinipipe_hf.planner.cost.profile import HardwareProfile, TimeCoefficients
from infinipipe_hf.planner.search.api import plan_alternative

LAYERS = 8
SPEC = ModelSpec(model_type="llama", num_layers=LAYERS, hidden_size=64, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=4, head_dim=16, vocab_size=100,
                 tie_word_embeddings=False)
EMB, LAYER, HEAD = 100 * 64, 4 * 64 * 64 + 3 * 128 * 64 + 2 * 64, 64 + 100 * 64
ACT, WORK = 1000.0, 500.0  # bytes per token per layer kept / working
H_BYTES = 64 * 2  # one hidden vector in bf16


def toy_profile(bandwidth=1e18, inter=None, latency=0.0) -> HardwareProfile:
    return HardwareProfile(
        name="toy", reference={"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                               "num_key_value_heads": 4, "head_dim": 16, "vocab_size": 100},
        layer_forward=TimeCoefficients(1e-9, 1e-6, 1e-3), layer_backward=TimeCoefficients(2e-9, 2e-6, 2e-3),
        head_forward=TimeCoefficients(0.0, 1e-7, 0.0), head_backward=TimeCoefficients(0.0, 2e-7, 0.0),
        activation_bytes_per_token_per_layer=ACT, layer_working_bytes_per_token=WORK, embedding_token_s=0.0,
        intra_node_bandwidth_bytes_per_s=bandwidth, inter_node_bandwidth_bytes_per_s=inter or bandwidth,
        collective_latency_s=latency)


def flat(world, budget=1e12, **kw) -> FlatCost:
    return FlatCost(FlatLayout(SPEC, toy_profile(**kw), world, budget, gpus_per_node=8))


def recompute(pairs, tokens):
    """A checkpointed layer's replay: its forward less ``down_proj``, whose output the backward does
    not need: 1/5 of the toy layer's linear work (128 x 64 of 4 x 64 x 64 + 3 x 128 x 64), the
    profile's token and fixed terms both counted as linear work."""
    return 1e-9 * pairs + 0.8 * (1e-6 * tokens + 1e-3)


def fwd_bwd(pairs, tokens, c=0):
    """One GPU, every layer, head forward; backward with the chunked loss's logits recomputed."""
    f = LAYERS * (1e-9 * pairs + 1e-6 * tokens + 1e-3) + 1e-7 * tokens
    b = LAYERS * (2e-9 * pairs + 2e-6 * tokens + 2e-3) + c * recompute(pairs, tokens) + 3e-7 * tokens
    return f, b


def test_zero3_states_bytes_and_collectives_by_hand():
    cost = flat(2, bandwidth=1e6)
    total = EMB + LAYERS * LAYER + HEAD
    # Every dimension is even, so a rank holds half of every tensor; 16 bytes per parameter; the
    # running and prefetched layer gathered (bf16) plus its bf16 gradient, and one fp32 copy.
    assert cost.states.static_bytes == total // 2 * 16 + 3 * LAYER * 2 + LAYER * 4
    gathers = [0.5 * n * 2 / 1e6 for n in (EMB, *[LAYER] * LAYERS, HEAD)]
    reduces = [0.5 * n * 4 / 1e6 for n in (EMB, *[LAYER] * LAYERS, HEAD)]
    f, b = 0.01, 0.02  # compute shorter than the collectives: they show
    expect = (max(gathers) + max(f, sum(gathers)) + max(gathers) + max(b, sum(gathers) + sum(reduces))
              + max(reduces))
    assert cost.states.round_time(f, b) == pytest.approx(expect, rel=1e-12)
    assert cost.states.round_time(100.0, 200.0) == pytest.approx(300.0 + 2 * max(gathers) + max(reduces), rel=1e-12)


def test_ulysses_zero3_step_by_hand():
    # Two GPUs, SP 1, one sequence per micro-batch: one round of two groups; free collectives.
    lengths = [3000, 1000]
    res = plan_alternative(lengths, SPEC, "ulysses-zero3", world_size=2, cost=flat(2),
                           sp_degrees=[1], pack_tokens=[3000])
    assert res.feasible and res.plan.checkpoint_layers == 0
    assert [[g.seqs for g in r] for r in res.plan.rounds] == [[(0,), (1,)]]
    f0, b0 = fwd_bwd(3000 ** 2, 3000)
    assert res.simulation.step_time_s == pytest.approx(f0 + b0, rel=1e-9)
    f1, b1 = fwd_bwd(1000 ** 2, 1000)
    busy = f0 + b0 + f1 + b1
    assert res.simulation.bubble_fraction == pytest.approx(1 - busy / (2 * (f0 + b0)), rel=1e-9)


def test_ulysses_pads_to_the_sp_degree_and_splits_per_gpu():
    # SP 2 over a 1001-token micro-batch: 1002 tokens, 501 per GPU; attention pairs split by heads.
    cost = flat(2)
    res = plan_alternative([1001], SPEC, "ulysses-zero3", world_size=2, cost=cost, sp_degrees=[2])
    assert res.simulation.padded_tokens == 1002
    group = cost.group("ulysses", 2)
    pairs = 1001 ** 2 + 1  # the padding token is its own document
    a2a = 0.0  # 1e18 B/s and no latency: the all-to-alls are free
    f = LAYERS * (1e-9 * pairs / 2 + 1e-6 * 1002 / 2 + 1e-3 + a2a) + 1e-7 * 1002 / 2
    b = LAYERS * (2e-9 * pairs / 2 + 2e-6 * 1002 / 2 + 2e-3) + 3e-7 * 1002 / 2
    got = group.times(pairs, 1002, 0)
    assert got[0] == pytest.approx(f, rel=1e-9) and got[1] == pytest.approx(b, rel=1e-9)


def test_ring_cp_time_with_exposed_ring_steps_by_hand():
    # cp 2 on one node at 1 GB/s with 1 ms latency: each K/V block transfer shows over its compute.
    cost = flat(2, bandwidth=1e9, latency=1e-3)
    group = cost.group("ring", 2)
    t = group.padded_tokens(1001)
    assert t == 1004  # a multiple of 2 x cp
    pairs = float(t) ** 2
    kv = 2 * 64 * 2  # K and V of one token and layer, bf16
    ring_f = max(0.0, 1e-3 + t / 2 * kv / 1e9 - 1e-9 * pairs / 4)
    ring_b = max(0.0, 1e-3 + t / 2 * kv * 2 / 1e9 - 2e-9 * pairs / 4)
    layer_f = 1e-9 * pairs / 2 + 1e-6 * t / 2 + 1e-3 + ring_f
    layer_b = 2e-9 * pairs / 2 + 2e-6 * t / 2 + 2e-3 + ring_b
    c = 3
    f, b, rec = group.times(pairs, t, c)
    assert f == pytest.approx(LAYERS * layer_f + 1e-7 * t / 2, rel=1e-12)
    # A checkpointed layer replays its forward, ring steps included, less down_proj's GEMM (the
    # pipeline cost model's whole-layer recompute, planner/cost/levels.py).
    down = group.cost.levels.down_share * (1e-6 * t / 2 + 1e-3)
    assert 0 < down < layer_f
    assert rec == pytest.approx(c * (layer_f - down), rel=1e-12)
    assert b == pytest.approx(LAYERS * layer_b + c * (layer_f - down) + 3e-7 * t / 2, rel=1e-12)


def test_ring_cp_runs_one_sequence_per_micro_batch_in_lockstep_rounds():
    cost = flat(2)
    res = plan_alternative([4000, 3000, 2000, 1000], SPEC, "ring-cp", world_size=2, cost=cost, cp_degrees=[1])
    # Slowest two share the first round, the others the second.
    assert [[g.seqs for g in r] for r in res.plan.rounds] == [[(0,), (1,)], [(2,), (3,)]]
    expect = sum(fwd_bwd(4000 ** 2, 4000)) + sum(fwd_bwd(2000 ** 2, 2000))
    assert res.simulation.step_time_s == pytest.approx(expect, rel=1e-9)


def test_memory_peak_and_least_checkpointing_by_hand():
    cost = flat(2)
    static = cost.states.static_bytes

    def peak(c, t=3000):  # activations kept + the backward's working set + the loss chunk
        # The final RMSNorm keeps its fp32 input (2 bf16 hidden vectors) and its output (1), the
        # chunked head its input (1).
        kept = t * ((LAYERS - c) * ACT + c * H_BYTES + 4 * H_BYTES)
        # The loss chunk: its bf16 logits and one float32 block of 1024 rows (the fused cross-entropy).
        work = t * (WORK + 2 * H_BYTES + ACT * (2 if c else 1)) + 100 * (2 * t + 4 * 1024)
        return static + kept + work

    group = cost.group("ulysses", 1)
    assert static + group.activation_peak_bytes(3000, 0) == pytest.approx(peak(0), rel=1e-12)
    assert static + group.activation_peak_bytes(3000, 5) == pytest.approx(peak(5), rel=1e-12)
    budget = (peak(3) + peak(4)) / 2  # 3 checkpointed layers are too few, 4 fit
    tight = flat(2, budget=budget)
    res = plan_alternative([3000, 1000], SPEC, "ulysses-zero3", world_size=2, cost=tight, sp_degrees=[1],
                           pack_tokens=[3000])
    assert res.feasible and res.plan.checkpoint_layers == 4
    assert res.simulation.peak_memory_bytes == pytest.approx(peak(4), rel=1e-12)
    f, b = fwd_bwd(3000 ** 2, 3000, c=4)
    assert res.simulation.step_time_s == pytest.approx(f + b, rel=1e-9)
    assert res.simulation.recompute_time_s == pytest.approx(
        4 * recompute(3000 ** 2, 3000) + 4 * recompute(1000 ** 2, 1000), rel=1e-9)


def test_flexsp_small_case_by_hand():
    # Two sequences on two GPUs.  With free all-to-alls one SP-2 group sharing both balances the
    # work (0.064 s forward + 0.129 s backward) better than one GPU each (the 3000-token one alone
    # takes 0.104 + 0.209 s).
    res = plan_alternative([3000, 1000], SPEC, "flexsp", world_size=2, cost=flat(2), checkpointing="none")
    assert [(g.gpus, g.seqs) for r in res.plan.rounds for g in r] == [(2, (0, 1))]
    f = LAYERS * (1e-9 * 5e6 + 1e-6 * 2000 + 1e-3) + 1e-7 * 2000
    b = LAYERS * (2e-9 * 5e6 + 2e-6 * 2000 + 2e-3) + 3e-7 * 2000
    assert res.simulation.step_time_s == pytest.approx(f + b, rel=1e-9)
    # With slow links the all-to-alls cost more than the imbalance: one GPU each.
    slow = flat(2, bandwidth=1e6)
    res = plan_alternative([3000, 1000], SPEC, "flexsp", world_size=2, cost=slow, checkpointing="none")
    assert sorted((g.gpus, g.seqs) for r in res.plan.rounds for g in r) == [(1, (0,)), (1, (1,))]
    assert res.simulation.step_time_s == pytest.approx(slow.states.round_time(*fwd_bwd(3000 ** 2, 3000)), rel=1e-9)


def test_group_sizes_and_crossing_nodes():
    cost = FlatCost(FlatLayout(SPEC, toy_profile(bandwidth=1e12, inter=1e9), 16, 1e12, gpus_per_node=8))
    assert cost.group_sizes("ulysses") == [1, 2, 4]  # at most the model's 4 heads
    assert cost.group_sizes("ring") == [1, 2, 4, 8, 16]
    assert cost.group("ring", 16).bandwidth == 1e9 and cost.group("ring", 8).bandwidth == 1e12
    # The all-GPU shard group spans two nodes: its gathers go at the inter-node bandwidth.
    assert cost.states.gather_s[1] == pytest.approx(15 / 16 * LAYER * 2 / 1e9, rel=1e-12)
    with pytest.raises(ValueError, match="does not tile 16 GPUs"):
        cost.group("ring", 3)
    assert math.isclose(cost.states.communication_floor_s(), cost.states.round_time(0.0, 0.0))
