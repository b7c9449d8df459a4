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
                {0: build_pipeline_actions(range(m), range(m), one_f_one_b_warmup(ParallelDims(p)))}, {0: {1: 2}})
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


def _host_sim():
    from infinipipe_hf.layout import ParallelDims
    from tests.planner.simulate.test_copy_lane import cost_of, host_plan

    plan = host_plan()
    return plan, simulate(plan, cost_of(ParallelDims(pp_degree=2), [3, 3]))


def test_plot_plan_draws_a_copy_lane_under_each_stage_with_host_copies(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    plan, sim = _host_sim()
    per_stage = {s: sum(1 for e in sim.copy_events if e.stage == s) for s in range(2)}
    assert per_stage[0] > 0 and per_stage[1] > 0
    seen = {}
    real_savefig = plt.Figure.savefig

    def spy(fig, *args, **kw):  # the figure's artists before plot_plan closes it
        ax = fig.axes[0]
        seen["legend"] = [t.get_text() for t in ax.get_legend().get_texts()]
        seen["bars"] = len(ax.collections)
        return real_savefig(fig, *args, **kw)

    monkeypatch.setattr(plt.Figure, "savefig", spy)
    drawn = plot_plan(plan, sim, str(tmp_path / "host.png"))
    assert drawn["copy_boxes"] == per_stage
    assert drawn["exposed_copy_boxes"] == sum(1 for e in sim.copy_events if e.exposed_s > 0) > 0
    assert seen["legend"][-2:] == ["host copy", "exposed copy"]
    # One collection per (row, kind) of actions, per row with recompute, plus per row a copy lane and
    # its exposed parts.
    rows_with_recompute = len({e.stage for e in sim.events if e.recompute_s > 0})
    assert seen["bars"] == 2 * 2 + rows_with_recompute + 2 * 2
    bare = plot_plan(*_sim(m=4, p=2), str(tmp_path / "bare.png"))
    assert bare["copy_boxes"] == {} and bare["exposed_copy_boxes"] == 0
    assert seen["bars"] == 2 * 2 + 1 and "host copy" not in seen["legend"]  # no lane drawn


def test_format_timeline_gives_the_host_copy_totals():
    plan, sim = _host_sim()
    lines = format_timeline(sim).splitlines()
    assert lines[1].startswith("host copies: ") and f"{sim.host_copy_exposed_s:.3f} s exposed" in lines[1]
    assert all("; host copies " in line for line in lines[2:])
    _, bare = _sim()
    assert "host copies" not in format_timeline(bare)


def test_plan_cli_prints_and_emits_the_host_copy_totals(tmp_path, capsys):
    import json

    from infinipipe_hf.cli.plan import main
    from tests.cli.test_plan_host_cli import LENGTHS, _files

    args = [*_files(tmp_path, LENGTHS), "--pp", "2", "--memory-budget-gib", "0.3", "--host-memory-gib", "1",
            "--state-offload", "optimizer"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["host_copy_s"] > 0 and out["host_copy_exposed_s"] > 0  # the optimizer step's tail
    assert len(out["host_copy_exposed_s_per_stage"]) == 2
    assert main(args) == 0
    table = capsys.readouterr().out
    assert f"epp: host copies: {out['host_copy_s']:.3f} s on the host link" in table
    assert main([*args[:-4], "--json"]) == 0  # no host tier: no host copy keys
    assert not any(k.startswith("host_copy") for k in json.loads(capsys.readouterr().out))
