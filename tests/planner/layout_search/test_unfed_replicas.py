"""A batch with fewer sequences than a layout's DP replicas: the layout search rules the layout
out with the reason (it does not abort), still prints its table, and ``plan_step`` itself plans
the idle replicas instead of failing."""
import json

from infinipipe_hf.cli.plan import main
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.layout_search.search import search_layouts
from infinipipe_hf.planner.search.api import PlanOptions, plan_step

TINY = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 65536}
SPEC = ModelSpec.from_config_dict(TINY)


def test_one_sequence_rules_out_every_layout_with_replicas_and_plans_the_rest():
    search = search_layouts([6000], SPEC, world_size=8, gpus_per_node=8, memory_budget_bytes=2**30,
                            alternatives=False)
    unfed = [o for o in search.layouts if o.layout.dp_degree > 1]
    assert unfed and all(not o.feasible and "1 sequence for" in o.error and "would idle" in o.error for o in unfed)
    assert all(o.result is None for o in unfed)  # ruled out before planning
    assert search.recommended is not None and search.recommended.layout.dp_degree == 1


def test_search_layout_cli_prints_a_table_for_a_batch_of_one_sequence(tmp_path, capsys):
    model, lengths = tmp_path / "config.json", tmp_path / "lengths.txt"
    model.write_text(json.dumps(TINY))
    lengths.write_text("6000\n")
    argv = ["--model", str(model), "--lengths", str(lengths), "--world-size", "8", "--gpus-per-node", "8",
            "--memory-budget-gib", "1", "--search-layout", "--search-workers", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "recommended: pp " in out and "x dp 1" in out.split("recommended:")[1].splitlines()[0]
    assert "1 sequence for 2 DP replicas: a replica would idle" in out
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recommended"]["dp_degree"] == 1
    assert any(lay["dp_degree"] == 8 and "would idle" in lay["error"] for lay in data["layouts"])


def test_plan_step_plans_idle_replicas_for_a_short_batch():
    one = plan_step([6000], SPEC, ParallelDims(pp_degree=2, dp_degree=1), PlanOptions(memory_budget_bytes=2**30))
    two = plan_step([6000], SPEC, ParallelDims(pp_degree=2, dp_degree=2), PlanOptions(memory_budget_bytes=2**30))
    assert two.feasible and two.plan.info["idle_replicas"] == 1 and "idle_replicas" not in one.plan.info
    assert all(not acts for acts in two.plan.actions[1])  # replica 1 runs no action
    # the busy replica's step, plus at most the gradient all-reduce the idle replica joins
    extra = two.simulation.step_time_s - one.simulation.step_time_s
    assert 0 <= extra <= two.simulation.info["gradient_sync_s"] * (1 + 1e-9), extra
