"""The planner CLI contract of docs/contracts.md (python -m infinipipe_hf.plan)."""
import json
import subprocess
import sys

import pytest

from infinipipe_hf.cli.plan import main
from infinipipe_hf.models.model_configs import config_path

LENGTHS = [30000, 8000, 2000, 1500, 900, 600, 300, 200, 100, 50] * 2


@pytest.fixture
def lengths_file(tmp_path):
    p = tmp_path / "lengths.txt"
    p.write_text("\n".join(map(str, LENGTHS)) + "\n")
    return p


def test_json_all_and_emit_plan(lengths_file, tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    rc = main(["--model", str(config_path("llama2-7b")), "--lengths", str(lengths_file), "--pp", "4",
               "--gpu-memory-gib", "80", "--schedule", "all", "--emit-plan", str(plan_path), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["schedule"] for r in out] == ["epp", "packed-1f1b", "seq1f1b", "gpipe", "ulysses-zero3", "ring-cp",
                                            "ring-cp-packed", "flexsp"]
    epp = out[0]
    assert epp["feasible"] and epp["num_tokens"] == sum(LENGTHS)
    # --gpu-memory-gib is the GPU's memory: the plan stays under it less the trainer's margin and reserve.
    assert epp["memory_budget_bytes"] == 71.6 * 2**30  # 80 GiB - 8% - 2 GiB, as the trainer plans
    assert (epp["device_memory_bytes"], epp["memory_margin"], epp["memory_reserve_bytes"]) == (80 * 2**30, 0.08, 2**31)
    plan = json.loads(plan_path.read_text())
    assert plan["schedule"] == "epp" and plan["pp_degree"] == 4 and plan["sequences"] == LENGTHS
    assert set(plan["actions"]) == {"0"} and len(plan["actions"]["0"]) == 4
    assert all(a[0] in "FB" for stage in plan["actions"]["0"] for a in stage)
    covered = sum(e - s for u in plan["units"] for _, s, e in u["segments"])
    assert covered == sum(LENGTHS)
    assert (tmp_path / "plan.seq1f1b.json").exists()


def test_single_schedule_prints_one_object(lengths_file, capsys):
    assert main(["--model", str(config_path("llama2-7b")), "--lengths", str(lengths_file), "--pp", "2",
                 "--schedule", "seq1f1b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out, dict) and out["schedule"] == "seq1f1b"


def test_plot(lengths_file, tmp_path):
    png = tmp_path / "gantt.png"
    assert main(["--model", str(config_path("llama2-7b")), "--lengths", str(lengths_file), "--pp", "4",
                 "--schedule", "epp", "--plot", str(png)]) == 0
    import matplotlib.image as mpimg

    img = mpimg.imread(str(png))  # a PNG that decodes, with the figure's width (14 in at 120 dpi)
    assert img.shape[1] == 14 * 120 and img.shape[0] > 400 and img.reshape(-1, img.shape[-1]).std(0).max() > 0.05


def test_errors(lengths_file, tmp_path, capsys):
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "n_layer": 12}))
    assert main(["--model", str(gpt2), "--lengths", str(lengths_file), "--pp", "2"]) == 2
    assert "not supported" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["--model", str(config_path("llama2-7b")), "--lengths", str(empty), "--pp", "2"]) == 2
    assert "empty batch" in capsys.readouterr().err
    bad = tmp_path / "bad.txt"
    bad.write_text("12\nabc\n")
    assert main(["--model", str(config_path("llama2-7b")), "--lengths", str(bad), "--pp", "2"]) == 2
    assert "bad.txt:2" in capsys.readouterr().err


def test_model_directory_and_bad_json_name_the_file(lengths_file, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    assert main(["--model", str(ckpt), "--lengths", str(lengths_file), "--pp", "2"]) == 2
    assert f"model directory {ckpt} has no config.json" in capsys.readouterr().err
    # a checkpoint directory holding a config.json is read like the file itself
    (ckpt / "config.json").write_text(config_path("llama2-7b").read_text())
    assert main(["--model", str(ckpt), "--lengths", str(lengths_file), "--pp", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["feasible"]
    broken = tmp_path / "broken.json"
    broken.write_text('{"model_type": "llama",\n "hidden_size": }')
    assert main(["--model", str(broken), "--lengths", str(lengths_file), "--pp", "2"]) == 2
    err = capsys.readouterr().err
    assert f"model config {broken} is not valid JSON (line 2" in err and "Traceback" not in err
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    assert main(["--model", str(partial), "--lengths", str(lengths_file), "--pp", "2"]) == 2
    assert f"model config {partial} lacks 'num_attention_heads'" in capsys.readouterr().err
    assert main(["--model", str(config_path("llama2-7b")), "--lengths", str(tmp_path), "--pp", "2"]) == 2
    assert f"lengths file {tmp_path} is a directory" in capsys.readouterr().err
    assert main(["--model", str(config_path("llama2-7b")), "--lengths", str(lengths_file), "--pp", "2",
                 "--profile", str(broken)]) == 2
    assert f"profile {broken} is not valid JSON" in capsys.readouterr().err


def test_module_entry_point_reports_a_directory_without_traceback(tmp_path, lengths_file):
    proc = subprocess.run([sys.executable, "-m", "infinipipe_hf.plan", "--model", str(tmp_path),
                           "--lengths", str(lengths_file), "--pp", "2"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "has no config.json" in proc.stderr


def test_infeasible_is_reported_not_crashed(tmp_path, capsys):
    p = tmp_path / "huge.txt"
    p.write_text("50000000\n")
    assert main(["--model", str(config_path("llama2-7b")), "--lengths", str(p), "--pp", "4",
                 "--gpu-memory-gib", "80", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["feasible"] is False and "50000000 tokens" in out["error"]


def test_module_entry_point(lengths_file):
    proc = subprocess.run([sys.executable, "-m", "infinipipe_hf.plan", "--model", str(config_path("llama2-7b")),
                           "--lengths", str(lengths_file), "--pp", "4", "--schedule", "epp", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["feasible"]


def test_checkpoint_levels_flag(lengths_file, tmp_path, capsys):
    """Finer levels are on by default and go in the plan's own key; ``none`` turns them off."""
    args = ["--model", str(config_path("llama2-7b")), "--lengths", str(lengths_file), "--pp", "4",
            "--memory-budget-gib", "40", "--json"]
    for flag, want_levels in (([], True), (["--checkpoint-levels", "none"], False)):
        plan_path = tmp_path / f"plan{len(flag)}.json"
        assert main(args + flag + ["--emit-plan", str(plan_path)]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["feasible"] and out["recompute_time_s"] > 0
        plan = json.loads(plan_path.read_text())
        assert ("checkpoint_levels" in plan) == want_levels
    assert main(args + ["--checkpoint-levels", "mlp,attn"]) == 2
    assert "unknown checkpoint level 'attn'" in capsys.readouterr().err


def test_solver_time_limit_flag_reaches_every_plan_and_the_recipe(lengths_file, monkeypatch, capsys):
    """``--solver-time-limit-s`` (default 0: no branch and bound) goes to the single plan and to every
    layout the search plans, and the search's commands repeat it; a negative value is an input error."""
    import infinipipe_hf.cli.plan as cli_plan
    import infinipipe_hf.planner.layout_search.search as search

    seen = []

    def recording(real):
        def plan_step(*args, **kwargs):
            options = args[3] if len(args) > 3 else kwargs.get("options")
            seen.append(options.solver_time_limit_s)
            return real(*args, **kwargs)
        return plan_step

    monkeypatch.setattr(cli_plan, "plan_step", recording(cli_plan.plan_step))
    monkeypatch.setattr(search, "plan_step", recording(search.plan_step))
    args = ["--model", str(config_path("llama2-7b")), "--lengths", str(lengths_file), "--json"]
    assert main(args + ["--pp", "2"]) == 0 and seen == [0.0]
    assert main(args + ["--pp", "2", "--solver-time-limit-s", "0.5"]) == 0 and seen[-1] == 0.5
    capsys.readouterr()
    seen.clear()
    assert main(args + ["--world-size", "4", "--search-layout", "--search-workers", "1", "--solver-time-limit-s",
                        "0.5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert seen and set(seen) == {0.5}
    assert "--solver-time-limit-s 0.5" in out["plan_command"]
    assert main(args + ["--pp", "2", "--solver-time-limit-s", "-1"]) == 2
    assert "--solver-time-limit-s=-1.0 must be a finite number of seconds >= 0" in capsys.readouterr().err
