"""viz: the Gantt + memory PNG is written and non-trivial; the text timeline lists every action."""
import sys
from pathlib import Path

from infinipipe_hf.planner.plan import Plan
from infinipipe_hf.planner.schedule import build_pipeline_actions, one_f_one_b_warmup
from infinipipe_hf.planner.simulator import simulate
from infinipipe_hf.planner.units import Segment, Unit
from infinipipe_hf.viz import format_timeline, plot_plan

sys.path.insert(0, str(Path(__file__).parent))
from test_simulator import FakeCost  # noqa: E402


def _sim(m=6, p=3):
    units = [Unit(i, (Segment(i, 0, 8),)) for i in range(m)]
    plan = Plan("packed-1f1b", p, 1, [8] * m, units,
                {0: build_pipeline_actions(range(m), range(m), p, one_f_one_b_warmup(p))}, {0: {1: 2}})
    return plan, simulate(plan, FakeCost(p))


def test_plot_plan_writes_png(tmp_path):
    plan, sim = _sim()
    out = tmp_path / "plan.png"
    plot_plan(plan, sim, str(out), title="tiny")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_plan_many_units_is_fast_enough(tmp_path):
    plan, sim = _sim(m=300, p=4)
    out = tmp_path / "big.png"
    plot_plan(plan, sim, str(out))
    assert out.stat().st_size > 10_000


def test_format_timeline():
    plan, sim = _sim()
    text = format_timeline(sim)
    assert text.splitlines()[0].startswith("step ")
    assert len(text.splitlines()) == 1 + plan.pp_degree
    assert "F5@" in text and "(rc 500.00)" in text  # unit 1 on stage 0 recomputes 2 layers x 0.25 s
