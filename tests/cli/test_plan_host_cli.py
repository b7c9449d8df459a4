"""The host tier on the planner CLI: ``--host-memory-gib`` and ``--state-offload`` on one plan and
on ``--search-layout`` (JSON keys, table columns, the note without a host tier, bad input), and
each layout's largest one-sequence length with and without the host tier."""
import json

import pytest

from infinipipe_hf.cli.plan import main
from infinipipe_hf.planner.cost.model import GIB

TINY = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 1 << 22}
LENGTHS = [6000, 3000, 1200, 800, 500, 300, 200, 100]


def _files(tmp_path, lengths):
    model, path = tmp_path / "config.json", tmp_path / "lengths.txt"
    model.write_text(json.dumps(TINY))
    path.write_text("\n".join(map(str, lengths)) + "\n")
    return ["--model", str(model), "--lengths", str(path)]


@pytest.fixture
def files(tmp_path):
    return _files(tmp_path, LENGTHS)


def test_one_plan_reports_the_host_peak_beside_the_gpu_peak(files, capsys):
    assert main([*files, "--pp", "2", "--memory-budget-gib", "0.3", "--host-memory-gib", "1",
                 "--state-offload", "optimizer", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["feasible"] and out["state_offload"] == "optimizer"
    assert out["host_memory_budget_bytes"] == 1 * GIB
    # The optimizer's states are on the host: its peak holds at least them, within the budget.
    assert 0 < out["host_peak_memory_bytes"] <= GIB
    assert out["host_peak_memory_bytes"] == out["info"]["host_peak_memory_bytes"]
    assert max(out["peak_memory_bytes"]) <= 0.3 * GIB  # the GPU peak stays the GPU's
    assert main([*files, "--pp", "2", "--memory-budget-gib", "0.3", "--host-memory-gib", "1",
                 "--state-offload", "optimizer"]) == 0
    table = capsys.readouterr().out
    assert "host GiB" in table.splitlines()[0]
    assert "host memory budget: 1 GiB per GPU (--host-memory-gib), state offload: optimizer" in table


def test_without_host_memory_the_table_says_so_and_nothing_is_on_the_host(files, capsys):
    assert main([*files, "--pp", "2", "--memory-budget-gib", "0.3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["host_peak_memory_bytes"] == 0.0 and out["host_memory_budget_bytes"] == 0.0
    assert out["state_offload"] == "none"
    assert main([*files, "--pp", "2", "--memory-budget-gib", "0.3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("host memory: none planned (--host-memory-gib 0") for line in lines)
    assert lines[-1].startswith("memory budget planned to:")  # still the last line


@pytest.mark.parametrize("flags, message", [
    (["--state-offload", "optimizer"], "--state-offload optimizer keeps model states in host memory, but "
                                       "--host-memory-gib is 0"),
    (["--host-memory-gib", "-1"], "--host-memory-gib must be >= 0"),
    (["--host-memory-gib", "1", "--state-offload", "states", "--dp", "2"], "needs --sp 1 and --dp 1"),
])
def test_bad_host_flags_are_input_errors(files, capsys, flags, message):
    assert main([*files, "--pp", "2", "--memory-budget-gib", "0.3", *flags]) == 2
    assert message in capsys.readouterr().err


def test_search_plans_state_offload_modes_and_recommends_the_host_budget(tmp_path, capsys):
    files = _files(tmp_path, LENGTHS)
    # 0.12 GiB: the unsharded states (51 MiB at pp 1) take over a quarter of the budget, so the
    # search also plans them in host memory.
    assert main([*files, "--world-size", "2", "--gpus-per-node", "2", "--memory-budget-gib", "0.12",
                 "--host-memory-gib", "1", "--search-layout", "--search-workers", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    modes = {(lay["pp_degree"], lay["sp_degree"], lay["shard"], lay["state_offload"]) for lay in out["layouts"]}
    assert (1, 1, "none", "optimizer") in modes and (1, 2, "sp", "optimizer") in modes
    # Unsharded, weights go to the host only where a stage is one rank with no replica (FSDP2 alone).
    assert all(m[1] == 1 and m[0] == 2 for m in modes if m[2] == "none" and m[3] == "states")
    assert all("host_peak_memory_bytes" in lay for lay in out["layouts"] if lay["feasible"])
    rec = out["recommended"]
    assert rec["training_arguments"]["host_memory_gib"] == 1.0
    assert rec["training_arguments"].get("state_offload", "none") == rec["state_offload"]
    assert "--host-memory-gib 1" in out["plan_command"]
    assert "alst" in [a["schedule"] for a in out["alternatives"]] and "alst" in rec["over_alternatives"]
    assert out["host_memory_budget_bytes"] == GIB
    # The pick replans alone, state offload and host budget included, to the same tokens/s.
    assert main([*files, "--pp", str(rec["pp_degree"]), "--sp", str(rec["sp_degree"]), "--dp", str(rec["dp_degree"]),
                 "--shard", rec["shard"], "--state-offload", rec["state_offload"], "--world-size", "2",
                 "--gpus-per-node", "2", "--memory-budget-gib", "0.12", "--host-memory-gib", "1", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone["tokens_per_s"] == rec["tokens_per_s"]
    assert alone["host_peak_memory_bytes"] == rec["host_peak_memory_bytes"]


def test_one_sequence_search_reports_largest_lengths_with_and_without_the_host_tier(tmp_path, capsys):
    files = _files(tmp_path, [20000])
    # 20000 tokens sit at the edge of what 0.125 GiB holds without the host tier; the slice cuts (equal
    # time, collectives included) move with the profile's compute speed, so the layer fit is pinned.
    args = [*files, "--world-size", "2", "--gpus-per-node", "2", "--memory-budget-gib", "0.125",
            "--search-layout", "--search-workers", "1", "--json", "--profile", "uncalibrated"]
    assert main([*args, "--host-memory-gib", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    fed = [lay for lay in out["layouts"] if lay["dp_degree"] == 1]
    assert fed and all({"largest_length", "largest_length_without_offload"} <= set(lay) for lay in fed)
    assert all(lay["largest_length"] >= lay["largest_length_without_offload"] for lay in fed)
    assert any(lay["largest_length"] > 1.2 * lay["largest_length_without_offload"] for lay in fed)
    assert all(lay["largest_length"] >= 20000 for lay in fed if lay["feasible"])
    assert "largest_length" not in next(lay for lay in out["layouts"] if lay["dp_degree"] == 2)
    assert main([*args]) == 0  # no host tier: both lengths are the same
    out = json.loads(capsys.readouterr().out)
    assert all(lay["largest_length"] == lay["largest_length_without_offload"]
               for lay in out["layouts"] if lay["dp_degree"] == 1)
