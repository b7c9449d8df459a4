"""``--grad-reduce {auto,step,unit}`` on the planner CLI: when sharded stages reduce gradients.

``auto`` (default) reports the pick in the JSON (``grad_reduce``) and the emitted plan (key only
when ``unit``); an explicit mode is honoured; ``unit`` where the shard group spans DP replicas is
a clear error (exit code 2); the layout search's layouts and pick say which they use.
"""
import json

from infinipipe_hf.cli.plan import main
from infinipipe_hf.data import synthetic
from infinipipe_hf.models.model_configs import config_path

MODEL = str(config_path("llama2-13b"))
LAYOUT = ["--pp", "1", "--sp", "8", "--shard", "sp", "--world-size", "8", "--gpus-per-node", "8"]


def _lengths(tmp_path, n=64):
    p = tmp_path / "lengths.txt"
    p.write_text("\n".join(map(str, synthetic.short_only(n=n, max_len=2048, seed=1))) + "\n")
    return str(p)


def test_auto_reports_the_pick_and_explicit_modes_are_honoured(tmp_path, capsys):
    args = ["--model", MODEL, "--lengths", _lengths(tmp_path), *LAYOUT, "--gpu-memory-gib", "80", "--json"]
    got = {}
    for mode in ("auto", "step", "unit"):
        plan_path = tmp_path / f"{mode}.json"
        assert main(args + ["--grad-reduce", mode, "--emit-plan", str(plan_path)]) == 0
        out = json.loads(capsys.readouterr().out)
        got[mode] = out
        plan = json.loads(plan_path.read_text())
        assert plan.get("grad_reduce", "step") == out["grad_reduce"]
    assert got["step"]["grad_reduce"] == "step" and got["unit"]["grad_reduce"] == "unit"
    best = max(("step", "unit"), key=lambda m: got[m]["tokens_per_s"])
    assert got["auto"]["grad_reduce"] == best
    assert got["auto"]["tokens_per_s"] == max(got["step"]["tokens_per_s"], got["unit"]["tokens_per_s"])


def test_unit_over_replicas_is_refused(tmp_path, capsys):
    args = ["--model", str(config_path("llama2-7b")), "--lengths", _lengths(tmp_path, 16), "--pp", "1", "--sp", "4",
            "--dp", "2", "--shard", "hybrid", "--world-size", "8", "--gpus-per-node", "8", "--json"]
    assert main(args + ["--grad-reduce", "unit"]) == 2
    err = capsys.readouterr().err
    assert "shard='hybrid' at dp_degree=2" in err and "grad_reduce='step'" in err


def test_search_says_which_reduction_each_layout_uses(tmp_path, capsys):
    args = ["--model", MODEL, "--lengths", _lengths(tmp_path, 128), "--world-size", "8", "--gpus-per-node", "8",
            "--gpu-memory-gib", "80", "--search-layout", "--json", "--sp", "8"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    sharded = [lay for lay in out["layouts"] if lay["shard"] != "none" and lay["feasible"]]
    assert sharded and all(lay["grad_reduce"] in ("step", "unit") for lay in sharded)
    assert all("grad_reduce" not in lay for lay in out["layouts"] if lay["shard"] == "none")
    rec = out["recommended"]
    assert rec["shard"] == "none" or rec["plan"]["grad_reduce"] == rec["grad_reduce"]
