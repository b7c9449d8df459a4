"""viz: the Gantt + memory picture draws every action of every stage, recompute and memory curves,
and the PNG it writes decodes to an image of that size; the text timeline lists every action."""
import pytest

from infinipipe_hf.cli.viz import format_timeline, plot_plan
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.pipeline.actions import build_pipeline_actions, one_f_one_b_warmup
from infinipipe_hf.planner.simulate.simulator import simulate
from tests.planner.fakes import FakeCost


def _sim(m=6, p=3):
    units = [Unit(i, (Segment(i, 0, 8),)) for i in range(m)]
    plan = Plan("packed-1f1b", p, 1, [8] * m, units,
                {0: build_pipeline_actions(range(m), range(m), p, one_f_one_b_warmup(p))}, {0: {1: 2}})
    return plan, simulate(plan, FakeCost(p))


def _decoded(path):
    import matplotlib.image as mpimg

    img = mpimg.imread(str(path))
    return img, len({tuple(px) for px in img.reshape(-1, img.shape[-1])[::97].tolist()})


def test_plot_plan_draws_every_action_and_writes_that_image(tmp_path):
    plan, sim = _sim()
    out = tmp_path / "plan.png"
    drawn = plot_plan(plan, sim, str(out), title="tiny")
    assert drawn["boxes"] == {0: 12, 1: 12, 2: 12}  # F and B of 6 units on each stage
    assert drawn["recompute_boxes"] == 1  # only unit 1 on stage 0 recomputes
    assert drawn["labels"] == 36 and drawn["memory_curves"] == 3
    img, colours = _decoded(out)
    assert (img.shape[1], img.shape[0]) == drawn["size_px"]
    assert colours > 20  # a drawing, not a blank canvas


def test_plot_plan_many_units_draws_all_boxes_but_labels_only_wide_ones(tmp_path):
    plan, sim = _sim(m=300, p=4)
    drawn = plot_plan(plan, sim, str(tmp_path / "big.png"))
    assert drawn["boxes"] == {s: 600 for s in range(4)}
    assert drawn["labels"] == 0  # 2400 boxes in 14 inches: none is wide enough for a label
    img, _ = _decoded(tmp_path / "big.png")
    assert (img.shape[1], img.shape[0]) == drawn["size_px"]


def test_format_timeline():
    plan, sim = _sim()
    text = format_timeline(sim)
    assert text.splitlines()[0].startswith("step ")
    assert len(text.splitlines()) == 1 + plan.pp_degree
    assert "F5@" in text and "(rc 500.00)" in text  # unit 1 on stage 0 recomputes 2 layers x 0.25 s


@pytest.mark.parametrize("suffix", [".svg", ".pdf"])
def test_other_formats_by_suffix(tmp_path, suffix):
    plan, sim = _sim()
    out = tmp_path / f"plan{suffix}"
    plot_plan(plan, sim, str(out))
    head = out.read_bytes()[:5]
    assert head == (b"%PDF-" if suffix == ".pdf" else b"<?xml")


def test_plot_plan_draws_a_rounds_units_side_by_side_in_their_lanes(tmp_path):
    from infinipipe_hf.cli.viz import _gantt_boxes
    from infinipipe_hf.planner.cost.model import GIB, CostModel
    from infinipipe_hf.planner.simulate.simulator import simulate
    from tests.planner.hand_plans import TINY
    from tests.planner.simulate.test_sp_round_simulation import round_plan

    plan = round_plan()
    sim = simulate(plan, CostModel(TINY, dims=ParallelDims(pp_degree=2, sp_degree=2), memory_budget_bytes=40 * GIB))
    boxes, _, _ = _gantt_boxes(plan, sim, sim.step_time_s)
    lanes = {lane for (row, kind, lane) in boxes if row == 0 and kind == "F"}
    assert lanes == {(-0.4, 0.8), (-0.4, 0.4), (0.0, 0.4)}  # the whole row, rank 0's half, rank 1's half
    drawn = plot_plan(plan, sim, str(tmp_path / "rounds.png"))
    assert drawn["boxes"] == {0: 8, 1: 8}
