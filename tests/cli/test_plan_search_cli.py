"""``python -m infinipipe_hf.plan --search-layout``: the JSON contract (docs/contracts.md), the
table, replanning the pick alone, and bad input."""
import json

import pytest

from infinipipe_hf.cli.plan import main
from infinipipe_hf.planner.layout_search.host_tier import planned_alternatives

ALTERNATIVES = planned_alternatives(0.0)  # without a host tier: alst needs one

TINY = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 65536}
LENGTHS = [6000, 3000, 1200, 800, 500, 300, 200, 100]


@pytest.fixture
def files(tmp_path):
    model, lengths = tmp_path / "config.json", tmp_path / "lengths.txt"
    model.write_text(json.dumps(TINY))
    lengths.write_text("\n".join(map(str, LENGTHS)) + "\n")
    return ["--model", str(model), "--lengths", str(lengths)]


def _search(files, *extra, gib="0.3"):
    return [*files, "--world-size", "4", "--gpus-per-node", "4", "--memory-budget-gib", gib, "--search-layout",
            "--search-workers", "1", *extra]


def test_json_contract_and_the_pick_replans_to_the_same_tokens_per_s(files, tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    assert main(_search(files, "--json", "--emit-plan", str(plan_path))) == 0
    out = json.loads(capsys.readouterr().out)
    rec = out["recommended"]
    assert {"pp_degree", "sp_degree", "dp_degree", "shard", "tokens_per_s"} <= set(rec)
    assert rec["pp_degree"] * rec["sp_degree"] * rec["dp_degree"] == 4
    degrees = {k: rec[k] for k in ("pp_degree", "sp_degree", "dp_degree", "shard")}
    # The degrees, the batch's tokens and the exact budget planned to: the fields that change the plan.
    assert rec["training_arguments"] == {**degrees, "tokens_per_step": sum(LENGTHS), "memory_budget_gib": 0.3}
    assert rec["recipe_flags"] == (f"--pp_degree {rec['pp_degree']} --sp_degree {rec['sp_degree']} "
                                   f"--dp_degree {rec['dp_degree']} --shard {rec['shard']} "
                                   f"--tokens_per_step {sum(LENGTHS)} --memory_budget_gib 0.3")
    assert out["memory_budget_bytes"] == 0.3 * 2**30 and out["memory_margin"] is None
    feasible = [lay for lay in out["layouts"] if lay["feasible"]]
    assert rec["tokens_per_s"] == max(lay["tokens_per_s"] for lay in feasible)
    assert all({"pp_degree", "sp_degree", "dp_degree", "shard", "feasible", "tokens_per_s"} <= set(lay)
               for lay in out["layouts"])
    assert [a["schedule"] for a in out["alternatives"]] == list(ALTERNATIVES)
    assert out["search_time_s"] > 0 and out["num_layouts"] == len(out["layouts"])
    assert json.loads(plan_path.read_text())["pp_degree"] == rec["pp_degree"]
    # The contract: planning the pick alone with the planner's layout flags gives the same tokens/s.
    assert main([*files, "--pp", str(rec["pp_degree"]), "--sp", str(rec["sp_degree"]), "--dp", str(rec["dp_degree"]),
                 "--shard", rec["shard"], "--world-size", "4", "--gpus-per-node", "4", "--memory-budget-gib", "0.3",
                 "--schedule", "epp", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone["tokens_per_s"] == rec["tokens_per_s"]
    assert out["plan_command"].endswith(f"--pp {rec['pp_degree']} --sp {rec['sp_degree']} --dp {rec['dp_degree']} "
                                        f"--shard {rec['shard']} --world-size 4 --gpus-per-node 4 "
                                        f"--memory-budget-gib 0.3 --schedule epp")


def test_table_shows_every_layout_the_alternatives_and_the_arguments(files, capsys):
    assert main(_search(files)) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "tokens/s" in line)
    for column in ("layout", "shard", "fits", "tokens/s", "peak GiB", "bubble", "recompute"):
        assert column in header
    assert "pp 1 x sp 2 x dp 2" in out and "pp 4 x sp 1 x dp 1" in out
    for name in ALTERNATIVES:
        assert f"{name}  (best)" in out and f"x {name} at its best" in out
    assert "EPPTrainingArguments(pp_degree=" in out and "recipe flags: --pp_degree" in out
    assert "tie-break: highest tokens/s" in out


def test_search_restricted_to_one_sp_degree(files, capsys):
    assert main(_search(files, "--sp", "2", "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    assert {lay["sp_degree"] for lay in out["layouts"]} == {2}


def test_no_layout_fits_exits_1_naming_the_largest_trainable_sequence_per_layout(files, capsys):
    assert main(_search(files, "--json", gib="0.046")) == 1
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["recommended"] is None and "Largest trainable sequence per layout" in out["error"]
    assert "error: no layout of 4 GPUs fits 0.046 GiB per GPU" in captured.err
    assert all("largest_trainable_length" in lay for lay in out["layouts"])
    assert "pp 4 x sp 1 x dp 1 shard none: " in captured.err


@pytest.mark.parametrize("extra, message", [
    (["--pp", "2"], "--search-layout chooses pp, sp, dp and shard itself; drop --pp 2"),
    (["--dp", "2"], "drop --dp 2"),
    (["--schedule", "seq1f1b"], "drop --schedule seq1f1b"),
    (["--sp", "3"], "no parallel layout of 4 GPUs (4 per node) can run this model with sp_degree in (3,)"),
    (["--search-workers", "0"], "--search-workers must be >= 1"),
])
def test_bad_search_flags_exit_2_with_a_message(files, capsys, extra, message):
    assert main(_search(files, *extra)) == 2
    assert message in capsys.readouterr().err


def test_world_size_without_a_layout_and_missing_flags(files, capsys):
    assert main([*files, "--world-size", "12", "--gpus-per-node", "8", "--search-layout"]) == 2
    assert "world size 12 is not a whole number of nodes of 8 GPUs" in capsys.readouterr().err
    assert main([*files, "--search-layout"]) == 2
    assert "--search-layout needs --world-size" in capsys.readouterr().err
    assert main(files) == 2  # one layout: --pp is required
    assert "--pp is required" in capsys.readouterr().err
