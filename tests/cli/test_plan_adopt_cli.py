"""The layout search never recommends less than an alternative whose plan is an EPP plan.

Llama-2-7B on 8 GPUs of 80 GiB, 256 short documents: FlexSP's group solver packs its rounds a
little better than EPP's own search (0.9999x).  The search then replans pp 1 x sp 8 with FlexSP's
rounds adopted, recommends it at FlexSP's tokens/s, and says so: ``adopt_rounds_of`` in the
training arguments and ``--adopt-rounds-of`` in the command that replans the pick, which gives the
same tokens/s.
"""
import json
import shlex

from infinipipe_hf.cli.plan import main
from infinipipe_hf.data import synthetic
from infinipipe_hf.models.model_configs import config_path


def test_search_adopts_flexsps_rounds_where_they_plan_faster(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(map(str, synthetic.short_only(n=256, max_len=2048, seed=5))) + "\n")
    args = ["--model", str(config_path("llama2-7b")), "--lengths", str(lengths), "--world-size", "8",
            "--gpus-per-node", "8", "--gpu-memory-gib", "80", "--sp", "8", "--search-layout", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    rec = out["recommended"]
    assert rec["label"] == "pp 1 x sp 8 x dp 1" and rec["shard"] == "sp"
    assert min(rec["over_alternatives"].values()) >= 1 - 1e-12
    assert rec["behind_alternatives"] == {}
    assert rec["training_arguments"]["adopt_rounds_of"] == ["flexsp"]
    assert "--adopt_rounds_of flexsp" in rec["recipe_flags"]
    command = out["plan_command"]
    assert "--adopt-rounds-of flexsp" in command
    replan = shlex.split(command)[3:]  # after python -m infinipipe_hf.plan
    assert main(replan + ["--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["tokens_per_s"] == rec["tokens_per_s"]


def test_adopting_on_a_layout_that_cannot_hold_the_rounds_is_an_input_error(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(map(str, synthetic.short_only(n=32, max_len=2048, seed=5))) + "\n")
    base = ["--model", str(config_path("llama2-7b")), "--lengths", str(lengths), "--world-size", "8",
            "--gpus-per-node", "8", "--gpu-memory-gib", "80"]
    assert main(base + ["--pp", "2", "--sp", "4", "--shard", "sp", "--adopt-rounds-of", "flexsp"]) == 2
    assert "pp_degree=1 and dp_degree=1" in capsys.readouterr().err
    assert main(base + ["--pp", "1", "--sp", "8", "--shard", "sp", "--adopt-rounds-of", "flexsp,zero3"]) == 2
    assert "'zero3' is not a non-pipeline alternative" in capsys.readouterr().err
