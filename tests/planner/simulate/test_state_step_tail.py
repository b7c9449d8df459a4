"""The optimizer step in host memory ends a stage's step after its last backward (by hand), and a
plan's step time under ``optimizer`` offload is today's plus exactly that tail."""
import pytest

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.search.api import PlanOptions, plan_step
from infinipipe_hf.planner.simulate.simulator import simulate
from tests.planner.fakes import FakeCost
from tests.planner.simulate.test_simulator import _packed_plan


class _Tails:
    def __init__(self, tails):
        self.tails = tails

    def step_tail_s(self, stage):
        return self.tails[stage]


class TailCost(FakeCost):
    """FakeCost whose stages end with a fixed optimizer-step tail."""

    def __init__(self, pp, tails, **kw):
        super().__init__(pp, **kw)
        self.state_host = _Tails(tails)


@pytest.mark.parametrize("tails,step", [
    ((0.0, 0.0), 12.0),   # 1F1B, 2 stages, 3 units of F 1 + B 2: (3 + 1) * 3
    ((1.5, 0.0), 13.5),   # stage 0 runs the step's last backward: its tail shows in full
    ((0.0, 2.0), 12.0),   # stage 1's last backward ends at 10: a tail of 2 hides behind stage 0's
    ((0.0, 3.0), 13.0),
])
def test_tail_after_the_last_backward_by_hand(tails, step):
    sim = simulate(_packed_plan(3, 2), TailCost(2, tails, tf=1.0, tb=2.0))
    assert sim.step_time_s == step
    assert sim.info.get("state_step_tail_s", 0.0) == max(tails)
    assert sim.tokens_per_s == pytest.approx(8 * 3 / step)


def test_optimizer_offload_adds_its_tail_to_the_same_plan():
    spec = ModelSpec.from_config_dict(dict(vocab_size=1000, hidden_size=256, intermediate_size=688,
                                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                           model_type="llama"))
    none = CostModel(spec, dims=ParallelDims(), memory_budget_bytes=2 * GIB)
    opt = CostModel(spec, dims=ParallelDims(state_offload="optimizer"), memory_budget_bytes=2 * GIB)
    res = plan_step([3000, 1000, 500], spec, cost=none, options=PlanOptions(memory_budget_bytes=2 * GIB))
    assert res.feasible, res.error
    base, off = simulate(res.plan, none), simulate(res.plan, opt)
    tail = opt.state_host.step_tail_s(0)
    assert tail > 0 and "state_step_tail_s" not in base.info
    assert off.step_time_s == pytest.approx(base.step_time_s + tail, rel=1e-12)
    assert off.info["state_step_tail_s"] == tail
    assert max(off.peak_memory_bytes) < max(base.peak_memory_bytes)  # the moments left the device
