"""The layout search says which profile and whole-step efficiencies priced it (JSON ``pricing`` and
one printed line), names the alternatives it trails, and ``--profile`` takes a shipped profile's name."""
import json

from infinipipe_hf.cli.plan import main
from infinipipe_hf.planner.cost.profile import default_profile, uncalibrated_profile

TINY = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 65536}
LENGTHS = [3000, 1200, 800, 500, 300, 200, 100, 100]


def _files(tmp_path):
    model, lengths = tmp_path / "config.json", tmp_path / "lengths.txt"
    model.write_text(json.dumps(TINY))
    lengths.write_text("\n".join(map(str, LENGTHS)) + "\n")
    return ["--model", str(model), "--lengths", str(lengths), "--world-size", "2", "--gpus-per-node", "2",
            "--memory-budget-gib", "0.3", "--search-layout", "--search-workers", "1"]


def test_search_json_and_table_name_the_profile_and_efficiencies(tmp_path, capsys):
    args = _files(tmp_path)
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    pricing, cal = out["pricing"], default_profile().calibration
    assert pricing["profile"] == default_profile().name and pricing["epp_efficiency"] == cal.compute_efficiency
    assert pricing["system_efficiency"]["flexsp"] == cal.compute_efficiency  # no measurement: EPP's
    assert pricing["system_efficiency"]["ring-cp"] == cal.system_efficiency["ring-cp"]
    rec = out["recommended"]
    assert rec["behind_alternatives"] == {n: r for n, r in rec["over_alternatives"].items() if r < 1.0 - 1e-9}
    assert main(args) == 0
    table = capsys.readouterr().out
    assert f"priced with profile {default_profile().name}" in table
    assert all(f"behind {n}" in table for n in list(rec["behind_alternatives"])[:1])


def test_profile_by_name_prices_with_the_layer_fit_alone(tmp_path, capsys):
    assert main([*_files(tmp_path), "--json", "--profile", "uncalibrated"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pricing"]["profile"] == uncalibrated_profile().name and out["pricing"]["epp_efficiency"] == 1.0
    assert out["recommended"]["training_arguments"]["profile"] == "uncalibrated"
