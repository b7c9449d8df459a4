"""The ``offload_pair`` level in the planner: its host bytes (three quarters of ``offload_attn``'s
per layer, an odd run's last input counted exactly), copies and recompute between ``offload_attn``
and ``offload``; the solver takes it where the host cannot hold every layer at ``offload_attn``,
always in even counts, within both budgets."""
from __future__ import annotations

import pytest

from infinipipe_hf.ir.levels import FINER_LEVELS, KEEP_ATTN, OFFLOAD, OFFLOAD_ATTN, OFFLOAD_PAIR
from infinipipe_hf.ir.units import Segment
from infinipipe_hf.planner.checkpointing.host_peak import host_peak_bytes_per_stage
from infinipipe_hf.planner.checkpointing.host_rows import even_pairs
from infinipipe_hf.planner.checkpointing.solver import solve_checkpointing
from infinipipe_hf.planner.cost.compute import UnitShape
from infinipipe_hf.planner.validate.validator import validate
from tests.planner.checkpointing.test_offload_attn_solver import cost_of, count, host_levels_needed_budget
from tests.planner.hand_plans import epp_plan


def test_host_bytes_copies_and_recompute_of_the_level():
    cost = cost_of(1e18, 1e18)
    seg = (Segment(0, 0, 1 << 16),)
    h, kept = cost.acts.hidden_bytes_per_token, cost.acts.kept_attention_bytes_per_token
    tokens = 1 << 16
    host = cost.host
    assert host.layer_offload_bytes(0, seg, OFFLOAD_PAIR) == pytest.approx(tokens * (kept + h / 2))
    # Exactly: one input per pair, an odd run's last layer its own.
    assert host.unit_offload_bytes(0, seg, {OFFLOAD_PAIR: 3}) == pytest.approx(tokens * (3 * kept + 2 * h))
    assert host.unit_offload_bytes(0, seg, {OFFLOAD_PAIR: 2, OFFLOAD_ATTN: 1, OFFLOAD: 1}) == pytest.approx(
        tokens * (2 * kept + h + (h + kept) + h))
    shape = UnitShape.of(seg)
    # The backward reads half a rebuild more per layer: the first layer's input and attention output.
    assert host.layer_copy_bytes(shape, OFFLOAD_PAIR, backward=True) == pytest.approx(
        host.layer_copy_bytes(shape, OFFLOAD_PAIR) + tokens * (h + kept) / 2)
    lc = cost.levels
    rebuild = cost.compute.layer_fwd(0, tokens)
    assert lc.layer_recompute_s(OFFLOAD_PAIR, shape) == pytest.approx(
        lc.layer_recompute_s(KEEP_ATTN, shape) + rebuild / 2 + host.layer_exposed_s(shape, OFFLOAD_PAIR))
    # On a long slice: no core rerun, half a replay more than offload_attn, far below offload.
    assert (lc.layer_recompute_s(OFFLOAD_ATTN, shape) < lc.layer_recompute_s(OFFLOAD_PAIR, shape)
            < 0.5 * lc.layer_recompute_s(OFFLOAD, shape))
    assert lc.layer_saved_bytes(OFFLOAD_PAIR, 0, seg) == lc.layer_saved_bytes(OFFLOAD, 0, seg)


@pytest.mark.parametrize("counts,want", [
    ({OFFLOAD_PAIR: 2, OFFLOAD: 1}, {OFFLOAD_PAIR: 2, OFFLOAD: 1}),
    ({OFFLOAD_PAIR: 3, OFFLOAD_ATTN: 1}, {OFFLOAD_PAIR: 4}),
    ({OFFLOAD_PAIR: 1, OFFLOAD_ATTN: 2, "mlp": 1}, {OFFLOAD_PAIR: 2, OFFLOAD_ATTN: 1, "mlp": 1}),
    ({OFFLOAD_PAIR: 3, "full": 1}, {OFFLOAD_PAIR: 2, OFFLOAD: 1, "full": 1}),
    ({OFFLOAD_PAIR: 1}, {OFFLOAD: 1}),
])
def test_even_pairs_keeps_host_bytes_within_the_linear_rows(counts, want):
    assert even_pairs(counts) == want
    cost, seg = cost_of(1e18, 1e18), (Segment(0, 0, 4096),)
    linear = sum(n * cost.host.layer_offload_bytes(0, seg, lv) for lv, n in counts.items()
                 if lv in (OFFLOAD_ATTN, OFFLOAD_PAIR, OFFLOAD))
    assert cost.host.unit_offload_bytes(0, seg, want) <= linear + 1e-6


@pytest.mark.parametrize("policy,sharing", [("adaptive", "cell"), ("adaptive", "diagonal"), ("greedy", "diagonal")])
def test_a_host_short_of_offload_attn_takes_pairs_in_even_counts(policy, sharing):
    plan = epp_plan([65536, 16384, 8192], 2, 16384, 16384)  # long slices: the attention core dominates
    budget = host_levels_needed_budget(plan, cost_of(1e18, 1e18))
    roomy = solve_checkpointing(plan, cost_of(budget, 1e18), policy=policy, sharing=sharing, levels=FINER_LEVELS)
    assert roomy.feasible and count(roomy, OFFLOAD_ATTN) > 0
    plan.checkpoint_layers, plan.checkpoint_levels = roomy.checkpoint_layers, roomy.checkpoint_levels
    roomy_peak = max(host_peak_bytes_per_stage(plan, cost_of(budget, 1e18)))
    tight = cost_of(budget, 0.5 * roomy_peak)
    sol = solve_checkpointing(plan, tight, policy=policy, sharing=sharing, levels=FINER_LEVELS)
    assert sol.feasible and count(sol, OFFLOAD_PAIR) > 0
    assert all(per.get(OFFLOAD_PAIR, 0) % 2 == 0 for lv in sol.checkpoint_levels.values() for per in lv.values())
    plan.checkpoint_layers, plan.checkpoint_levels = sol.checkpoint_layers, sol.checkpoint_levels
    assert max(host_peak_bytes_per_stage(plan, tight)) <= 0.5 * roomy_peak + 1
    validate(plan, tight)
    assert roomy.recompute_time_s <= sol.recompute_time_s
