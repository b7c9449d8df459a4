"""Simulator: hand-computed step times and bubbles, recompute, DP replicas, memory vs memory.py."""
import pytest

from infinipipe_hf.planner.actions import B, F
from infinipipe_hf.planner.cost_model import CostModel
from infinipipe_hf.planner.memory import memory_points, point_bytes, stage_peak_bytes
from infinipipe_hf.planner.model_spec import ModelSpec
from infinipipe_hf.planner.plan import Plan
from infinipipe_hf.planner.schedule import (backward_order, build_pipeline_actions, epp_warmup,
                                            one_f_one_b_warmup)
from infinipipe_hf.planner.simulator import PlanDeadlockError, simulate
from infinipipe_hf.planner.units import Segment, Unit

LLAMA3_8B = dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)


class FakeCost:
    """Fixed times per action (independent of the unit), optional transfer and per-layer recompute."""

    def __init__(self, pp, tf=1.0, tb=2.0, transfer=0.0, recompute_per_layer=0.25, layers=4):
        self.pp_degree, self.tf, self.tb, self.transfer = pp, tf, tb, transfer
        self.rc, self.layers_per_stage, self.memory_budget_bytes = recompute_per_layer, [layers] * pp, 100.0

    def forward_time(self, stage, shape):
        return self.tf

    def recompute_time(self, stage, shape, c):
        return self.rc * c

    def backward_time(self, stage, shape, c=0):
        return self.tb + self.recompute_time(stage, shape, c)

    def transfer_time(self, tokens):
        return self.transfer

    def static_bytes(self, stage):
        return 10.0

    def kv_bytes(self, stage, tokens):
        return 0.0

    def working_bytes(self, stage, tokens, c, backward):
        return 1.0

    def activation_bytes(self, stage, tokens, c):
        return 5.0 - c

    def context_bytes_per_layer(self, segments):
        return 0.0

    def unit_activation_bytes(self, stage, segments, c):
        return self.activation_bytes(stage, sum(s.end - s.start for s in segments), c)


def _packed_plan(m, p, dp=1, warm=None):
    units = [Unit(r * m + i, (Segment(r * m + i, 0, 8),), 0, r) for r in range(dp) for i in range(m)]
    actions = {}
    for r in range(dp):
        ids = [u.id for u in units if u.dp_rank == r]
        actions[r] = build_pipeline_actions(ids, ids, p, warm or one_f_one_b_warmup(p))
    return Plan("packed-1f1b", p, dp, [8] * (m * dp), units, actions, {})


@pytest.mark.parametrize("p,m", [(1, 3), (2, 1), (2, 5), (4, 4), (4, 9), (8, 3)])
def test_one_f_one_b_step_time_and_bubble_by_hand(p, m):
    sim = simulate(_packed_plan(m, p), FakeCost(p, tf=1.0, tb=2.0))
    assert sim.step_time_s == pytest.approx((m + p - 1) * 3.0)
    assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert sim.tokens_per_s == pytest.approx(8 * m / sim.step_time_s)
    assert len(sim.events) == 2 * m * p and sim.recompute_time_s == 0.0


def test_transfer_delays_by_hand():
    sim = simulate(_packed_plan(1, 2), FakeCost(2, tf=1.0, tb=2.0, transfer=0.5))
    ev = {(e.stage, e.action): (e.start_s, e.end_s) for e in sim.events}
    assert ev[(0, "F0")] == (0.0, 1.0) and ev[(1, "F0")] == (1.5, 2.5)
    assert ev[(1, "B0")] == (2.5, 4.5) and ev[(0, "B0")] == (5.0, 7.0)
    assert sim.step_time_s == 7.0


def test_recompute_lengthens_backward_and_is_summed():
    plan = _packed_plan(3, 2)
    plan.checkpoint_layers = {0: {0: 2}, 1: {1: 4}}
    sim = simulate(plan, FakeCost(2))
    assert sim.recompute_time_s == pytest.approx(0.25 * 6)
    b = {(e.stage, e.action): e for e in sim.events}
    assert b[(1, "B1")].end_s - b[(1, "B1")].start_s == pytest.approx(3.0)
    assert b[(1, "B1")].recompute_s == pytest.approx(1.0)
    assert sim.step_time_s > simulate(_packed_plan(3, 2), FakeCost(2)).step_time_s


def test_dp_replicas_run_in_parallel_step_is_slowest():
    plan = _packed_plan(3, 2, dp=2)
    # Give replica 1 an extra unit: it is the slower one.
    extra = Unit(6, (Segment(6, 0, 8),), 0, 1)
    plan = Plan(plan.schedule, 2, 2, [8] * 7, plan.units + [extra],
                {0: plan.actions[0], 1: build_pipeline_actions([3, 4, 5, 6], [3, 4, 5, 6], 2, [1, 0])}, {})
    sim = simulate(plan, FakeCost(2, tf=1.0, tb=2.0))
    assert sim.step_time_s == pytest.approx((4 + 1) * 3.0)
    assert sim.bubble_fraction == pytest.approx(1 - (7 * 2 * 3.0) / (2 * 2 * sim.step_time_s))


def test_deadlock_raises():
    plan = _packed_plan(2, 2)
    plan.actions[0][0] = [F(0), B(0), F(1), B(1)]
    plan.actions[0][1] = [F(0), F(1), B(0), B(1)]
    with pytest.raises(PlanDeadlockError, match="deadlocks"):
        simulate(plan, FakeCost(2))


def test_memory_matches_memory_module_and_feasibility():
    cm = CostModel(ModelSpec.from_config_dict(LLAMA3_8B), pp_degree=4)
    lengths = [30000, 8000, 4000, 4000, 2000]
    units = [Unit(0, (Segment(0, 0, 12000),)), Unit(1, (Segment(0, 12000, 22000),)),
             Unit(2, (Segment(0, 22000, 30000), Segment(3, 0, 4000))), Unit(3, (Segment(1, 0, 8000),)),
             Unit(4, (Segment(2, 0, 4000), Segment(4, 0, 2000)))]
    acts = build_pipeline_actions([u.id for u in units], backward_order(units, lengths), 4, epp_warmup(4, 3))
    plan = Plan("epp", 4, 1, lengths, units, {0: acts}, {0: {0: 5, 2: 3}, 1: {1: 7}})
    sim = simulate(plan, cm)
    for s in range(4):
        pts = memory_points(plan, cm, 0, s)
        want = [point_bytes(pt, plan, cm, s, plan.checkpoint_layers.get(s, {})) for pt in pts]
        got = [b for _, b in sim.memory_timeline[(0, s)]]
        assert got == pytest.approx(want)
        assert sim.peak_memory_bytes[s] == pytest.approx(stage_peak_bytes(plan, cm, 0, s))
    assert sim.feasible == all(x <= cm.memory_budget_bytes for x in sim.peak_memory_bytes)
    tight = CostModel(cm.spec, pp_degree=4, memory_budget_bytes=min(sim.peak_memory_bytes) - 1)
    assert not simulate(plan, tight).feasible
    roomy = CostModel(cm.spec, pp_degree=4, memory_budget_bytes=max(sim.peak_memory_bytes) + 1)
    assert simulate(plan, roomy).feasible
    d = sim.to_dict(include_events=True)
    assert d["step_time_s"] == sim.step_time_s and len(d["events"]) == 40 and "0,3" in d["memory_timeline"]


def test_pp_mismatch_is_a_user_error():
    with pytest.raises(ValueError, match="pp_degree"):
        simulate(_packed_plan(2, 2), FakeCost(3))
