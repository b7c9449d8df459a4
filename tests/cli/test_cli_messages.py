"""What the CLI and the plan picture tell the user: every file written, a title that names the
layout once, a legend for the shades, budgets in useful digits."""
from __future__ import annotations

from infinipipe_hf.cli.plan import main
from infinipipe_hf.cli.viz import format_gib, plot_title
from infinipipe_hf.models.model_configs import config_path
from tests.cli.test_viz import _sim


def test_the_cli_names_every_file_it_wrote(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(map(str, [4000, 900, 300, 200] * 2)) + "\n")
    plan, png = tmp_path / "plan.json", tmp_path / "out.png"
    assert main(["--model", str(config_path("llama2-7b")), "--lengths", str(lengths), "--pp", "2",
                 "--schedule", "all", "--emit-plan", str(plan), "--plot", str(png), "--json"]) == 0
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("wrote "))
    named = [p.strip() for p in line.split(":", 1)[1].split(",")]
    files = {p.name for p in tmp_path.iterdir()} - {"lengths.txt"}
    assert {p.rsplit("/", 1)[-1] for p in named} == files  # every file written, and only those
    assert {"plan.packed-1f1b.json", "out.seq1f1b.png", "plan.flexsp.json"} <= files
    assert not any(f.startswith("out.flexsp") for f in files)  # not a pipeline: not drawn


def test_plot_title_names_the_layout_once_and_budgets_keep_their_digits():
    plan, sim = _sim()
    assert plot_title(plan, sim).count("pp=") == 1
    given = plot_title(plan, sim, "epp: llama, pp=3, dp=1")
    assert given.count("pp=") == 1 and given.startswith("epp: llama, pp=3, dp=1\n")
    assert [format_gib(x) for x in (0.01, 80.0, 1.5, 0.125)] == ["0.01", "80", "1.5", "0.125"]


def test_the_legend_explains_the_shades(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from infinipipe_hf.cli import viz

    plan, sim = _sim()
    seen = {}
    original = viz._draw_gantt

    def spy(ax, *a, **k):
        original(ax, *a, **k)
        seen["title"] = ax.get_legend().get_title().get_text()

    viz._draw_gantt = spy
    try:
        viz.plot_plan(plan, sim, str(tmp_path / "p.png"))
    finally:
        viz._draw_gantt = original
    assert "shade" in seen["title"] and "sequence" in seen["title"]
