"""Planner CLI and elastic SP rounds: on by default at --sp > 1, --no-sp-rounds, the comparison row
of --schedule all, and a clear error when asked at --sp 1."""
import json

import pytest

from infinipipe_hf.cli.plan import main
from infinipipe_hf.models.model_configs import config_path

LENGTHS = [8000] * 2 + [300 + (i * 397) % 2700 for i in range(120)]  # short sequences: one GPU each
MODEL = str(config_path("llama2-7b"))


@pytest.fixture
def lengths_file(tmp_path):
    p = tmp_path / "lengths.txt"
    p.write_text("\n".join(map(str, LENGTHS)) + "\n")
    return p


def _run(lengths_file, tmp_path, capsys, *extra):
    plan_path = tmp_path / "plan.json"
    assert main(["--model", MODEL, "--lengths", str(lengths_file), "--pp", "2", "--sp", "4", "--shard", "sp",
                 "--json", "--emit-plan", str(plan_path), *extra]) == 0
    return json.loads(capsys.readouterr().out), json.loads(plan_path.read_text())


def test_epp_uses_rounds_at_sp_above_one_and_the_switch_turns_them_off(lengths_file, tmp_path, capsys):
    out, plan = _run(lengths_file, tmp_path, capsys)
    assert plan["rounds"] and plan["sp_groups"] and out["info"]["sp_rounds"]["single_gpu_units"] > 0
    off, plain = _run(lengths_file, tmp_path, capsys, "--no-sp-rounds")
    assert "rounds" not in plain and "sp_groups" not in plain and "sp_rounds" not in off["info"]
    assert out["tokens_per_s"] >= off["tokens_per_s"]


def test_all_reports_epp_with_and_without_rounds(lengths_file, tmp_path, capsys):
    assert main(["--model", MODEL, "--lengths", str(lengths_file), "--pp", "2", "--sp", "4", "--shard", "sp",
                 "--schedule", "all"]) == 0
    table = capsys.readouterr().out
    assert "epp (whole-group SP)" in table and "EPP speedup over epp (whole-group SP):" in table
    assert main(["--model", MODEL, "--lengths", str(lengths_file), "--pp", "2", "--sp", "4", "--shard", "sp",
                 "--schedule", "all", "--no-sp-rounds", "--json"]) == 0
    assert all("label" not in r for r in json.loads(capsys.readouterr().out))  # nothing to compare


def test_rounds_asked_at_sp_one_is_an_input_error(lengths_file, capsys):
    assert main(["--model", MODEL, "--lengths", str(lengths_file), "--pp", "2", "--sp-rounds"]) == 2
    err = capsys.readouterr().err
    assert "sp_rounds=True asks for elastic SP rounds" in err and "sp_degree=1" in err
