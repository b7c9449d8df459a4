"""Simulator: step times, bubbles, recompute, DP replicas and memory, all computed by hand; a cost
model's joint replay of the replicas (the extension point) used in place of the per-replica one."""
import pytest

from infinipipe_hf.ir.actions import B, F
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.pipeline.actions import build_pipeline_actions, one_f_one_b_warmup
from infinipipe_hf.planner.simulate.replay import ReplayResult, replay
from infinipipe_hf.planner.simulate.simulator import PlanDeadlockError, simulate
from tests.planner.fakes import FakeCost


def _packed_plan(m, p, dp=1, warm=None):
    units = [Unit(r * m + i, (Segment(r * m + i, 0, 8),), 0, r) for r in range(dp) for i in range(m)]
    actions = {}
    for r in range(dp):
        ids = [u.id for u in units if u.dp_rank == r]
        actions[r] = build_pipeline_actions(ids, ids, warm or one_f_one_b_warmup(ParallelDims(p)))
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
                {0: plan.actions[0], 1: build_pipeline_actions([3, 4, 5, 6], [3, 4, 5, 6], [1, 0])}, {})
    sim = simulate(plan, FakeCost(2, tf=1.0, tb=2.0))
    assert sim.step_time_s == pytest.approx((4 + 1) * 3.0)
    assert sim.bubble_fraction == pytest.approx(1 - (7 * 2 * 3.0) / (2 * 2 * sim.step_time_s))


def test_deadlock_raises():
    plan = _packed_plan(2, 2)
    plan.actions[0][0] = [F(0), B(0), F(1), B(1)]
    plan.actions[0][1] = [F(0), F(1), B(0), B(1)]
    with pytest.raises(PlanDeadlockError, match="deadlocks"):
        simulate(plan, FakeCost(2))


def test_memory_timeline_and_peaks_by_hand():
    """FakeCost: 10 bytes of model states, a 1-byte working set, 5 - c bytes of activations per live
    unit (c checkpointed layers), no K/V.  1F1B on 3 stages, 5 units: stage s holds at most 3 - s
    units; stage 0 runs F0 F1 F2 B0 F3 B1 F4 B2 B3 B4."""
    p, m = 3, 5
    plan = _packed_plan(m, p)
    sim = simulate(plan, FakeCost(p))
    assert sim.peak_memory_bytes == [11 + 5 * 3, 11 + 5 * 2, 11 + 5 * 1]
    live = [[0], [0, 1], [0, 1, 2], [0, 1, 2], [1, 2, 3], [1, 2, 3], [2, 3, 4], [2, 3, 4], [3, 4], [4]]
    assert [str(a) for a in plan.actions[0][0]] == ["F0", "F1", "F2", "B0", "F3", "B1", "F4", "B2", "B3", "B4"]
    act = {0: 3, 1: 5, 2: 5, 3: 5, 4: 5}  # unit 0 checkpoints 2 layers on stage 0
    plan.checkpoint_layers = {0: {0: 2}}
    sim = simulate(plan, FakeCost(p))
    want = [11 + sum(act[u] for u in units) for units in live]
    assert [b for _, b in sim.memory_timeline[(0, 0)]] == want
    starts = [e.start_s for e in sim.events if e.stage == 0 and e.dp_rank == 0]
    assert [t for t, _ in sim.memory_timeline[(0, 0)]] == starts
    assert sim.peak_memory_bytes[0] == 26 and sim.feasible  # budget 100
    tight = FakeCost(p)
    tight.memory_budget_bytes = 25.0
    assert not simulate(plan, tight).feasible
    d = sim.to_dict(include_events=True)
    assert d["peak_memory_bytes"] == [26, 21, 16] and len(d["events"]) == 2 * m * p
    assert d["memory_timeline"]["0,0"] == [[t, b] for t, b in zip(starts, want)]


def test_pp_mismatch_is_a_user_error():
    with pytest.raises(ValueError, match="pp_degree"):
        simulate(_packed_plan(2, 2), FakeCost(3))


class _JointCost(FakeCost):
    """A FakeCost with the simulator's extension point: replays every replica together (here: each
    on its own, then every action ``delay`` s later, a result the plain replay cannot give)."""

    def __init__(self, pp, delay=5.0, drop=(), **kw):
        super().__init__(pp, **kw)
        self.delay, self.drop, self.calls = delay, set(drop), []

    def replica_replay(self, plan, costs, lists):
        self.calls.append(sorted(lists))
        out = {}
        for r, stages in lists.items():
            rep = replay(stages, costs.duration, costs.transfer)
            shift = [[t + self.delay for t in times] for times in rep.start], [[t + self.delay for t in times] for times in rep.end]
            out[r] = ReplayResult(*shift, rep.done, rep.totals)
        return {r: rep for r, rep in out.items() if r not in self.drop}


def test_a_cost_models_replica_replay_replaces_the_own_device_replay():
    plan = _packed_plan(3, 2, dp=2)
    own = simulate(plan, FakeCost(2, tf=1.0, tb=2.0))
    cost = _JointCost(2, tf=1.0, tb=2.0)
    joint = simulate(plan, cost)
    assert cost.calls == [[0, 1]]  # once, with every replica's stage lists
    assert joint.step_time_s == pytest.approx(own.step_time_s + 5.0)
    starts = {(e.dp_rank, e.stage, e.action): e.start_s for e in own.events}
    assert [e.start_s for e in joint.events] == pytest.approx([starts[(e.dp_rank, e.stage, e.action)] + 5.0
                                                               for e in joint.events])
    assert joint.peak_memory_bytes == own.peak_memory_bytes


def test_a_replica_replay_must_answer_for_every_replica():
    with pytest.raises(ValueError, match=r"no replay for dp replicas \[1\]"):
        simulate(_packed_plan(3, 2, dp=2), _JointCost(2, drop=[1]))
