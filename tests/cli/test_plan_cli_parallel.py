"""Planner CLI layout flags: --sp, --shard, --gpus-per-node, --world-size, and their errors."""
import json

import pytest

from infinipipe_hf.cli.plan import main
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.layout_search.host_tier import planned_alternatives

ALTERNATIVES = planned_alternatives(0.0)  # without a host tier: alst needs one

LENGTHS = [30000, 8000, 2000, 1500, 900, 600, 300, 200, 100, 50] * 2
MODEL = str(config_path("llama2-7b"))


@pytest.fixture
def lengths_file(tmp_path):
    p = tmp_path / "lengths.txt"
    p.write_text("\n".join(map(str, LENGTHS)) + "\n")
    return p


def test_all_schedules_with_sp_and_shard(lengths_file, tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    rc = main(["--model", MODEL, "--lengths", str(lengths_file), "--pp", "4", "--sp", "8", "--shard", "sp",
               "--schedule", "all", "--emit-plan", str(plan_path), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [r.get("label", r["schedule"]) for r in out] == ["epp", "epp (whole-group SP)", "packed-1f1b", "seq1f1b",
                                                            "gpipe", *ALTERNATIVES]
    pipelines = out[:5]  # the non-pipeline alternatives run on the same 32 GPUs, ZeRO-3 over all of them
    assert all(r["sp_degree"] == 8 and r["shard"] == "sp" for r in pipelines)
    assert all(r["world_size"] == 32 for r in out[5:])
    plan = json.loads(plan_path.read_text())
    assert plan["sp_degree"] == 8 and plan["shard"] == "sp" and plan["pp_degree"] == 4
    seq = json.loads((tmp_path / "plan.seq1f1b.json").read_text())
    assert seq["sp_degree"] == 8


def test_world_size_derives_dp(lengths_file, tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    assert main(["--model", MODEL, "--lengths", str(lengths_file), "--pp", "2", "--sp", "2", "--world-size", "8",
                 "--shard", "dp", "--emit-plan", str(plan_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["feasible"]
    plan = json.loads(plan_path.read_text())
    assert plan["dp_degree"] == 2 and plan["shard"] == "dp" and set(plan["actions"]) == {"0", "1"}


def test_gpus_per_node_changes_the_price_of_crossing(lengths_file, capsys):
    args = ["--model", MODEL, "--lengths", str(lengths_file), "--pp", "2", "--sp", "8", "--schedule", "epp", "--json"]
    assert main(args) == 0
    inside = json.loads(capsys.readouterr().out)["step_time_s"]
    assert main(args + ["--gpus-per-node", "4"]) == 0  # every SP group now spans two nodes
    assert json.loads(capsys.readouterr().out)["step_time_s"] > inside


@pytest.mark.parametrize("extra, message", [
    (["--sp", "64"], "sp_degree=64 exceeds the model's 32 attention heads: Ulysses sequence parallelism "
                     "gives every SP rank at least one head; use sp_degree in 1..32"),
    (["--shard", "dp"], "shard='dp' shards over the stage's DP replicas, which has one rank here"),
    (["--sp", "2", "--shard", "hybrid", "--dp", "1"], None),
    (["--shard", "sp"], "raise sp_degree or dp_degree"),
    (["--sp", "3", "--world-size", "16"], "pp_degree=2 x sp_degree=3 = 6 does not divide world size 16"),
    (["--sp", "2", "--dp", "3", "--world-size", "16"], "set dp_degree=4 or leave it None"),
    (["--sp", "0"], "--sp must be >= 1, got 0"),
    (["--gpus-per-node", "0"], "--gpus-per-node must be >= 1, got 0"),
    (["--world-size", "0"], "--world-size must be >= 1"),
])
def test_bad_layouts_exit_2_with_a_message(lengths_file, capsys, extra, message):
    rc = main(["--model", MODEL, "--lengths", str(lengths_file), "--pp", "2", "--json", *extra])
    err = capsys.readouterr().err
    if message is None:
        assert rc == 0, err
    else:
        assert rc == 2 and message in err, err
