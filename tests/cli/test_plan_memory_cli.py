"""One memory budget: the planner CLI plans to what the trainer would on the same GPU, and the layout
search's recipe flags make the trainer plan the same batch to the same plan."""
import json
import shlex
import types

import pytest
import torch

from infinipipe_hf import EPPTrainingArguments, InfiniPipeConfig
from infinipipe_hf.cli.plan import main
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.search.api import PlanOptions, plan_step
from infinipipe_hf.runtime.engine import planning
from infinipipe_hf.trainer.pipeline_arguments import config_kwargs

GIB = 2**30
TINY = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 65536}
LENGTHS = [6000, 3000, 1200, 800, 500, 300, 200, 100] * 2


@pytest.fixture
def files(tmp_path):
    model, lengths = tmp_path / "config.json", tmp_path / "lengths.txt"
    model.write_text(json.dumps(TINY))
    lengths.write_text("\n".join(map(str, LENGTHS)) + "\n")
    return ["--model", str(model), "--lengths", str(lengths)]


def trainer_budget(monkeypatch, config: InfiniPipeConfig, gpu_gib: float) -> float:
    """``memory_budget_bytes`` of the engine on a CUDA device reporting ``gpu_gib`` GiB."""
    monkeypatch.setattr(planning.torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=int(gpu_gib * GIB)))
    return planning.memory_budget_bytes(config, torch.device("cuda", 0))


@pytest.mark.parametrize("gpu_gib, flags, config", [
    (80.0, [], InfiniPipeConfig()),
    (79.1787109375, [], InfiniPipeConfig()),  # what torch reports for an H100 80GB
    (40.0, ["--memory-margin", "0.1", "--memory-reserve-gib", "1"],
     InfiniPipeConfig(memory_margin=0.1, memory_reserve_gib=1.0)),
])
def test_the_cli_plans_to_the_trainers_budget_on_that_gpu(monkeypatch, capsys, tmp_path, gpu_gib, flags, config):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("4000\n900\n300\n")
    args = ["--model", str(config_path("llama3.2-1b")), "--lengths", str(lengths), "--pp", "2",
            "--gpu-memory-gib", repr(gpu_gib), *flags]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["memory_budget_bytes"] == trainer_budget(monkeypatch, config, gpu_gib)
    assert out["device_memory_bytes"] == gpu_gib * GIB and out["memory_margin"] == config.memory_margin
    assert out["memory_reserve_bytes"] == config.memory_reserve_gib * GIB
    assert main(args) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith(f"memory budget planned to: {out['memory_budget_bytes'] / GIB:.4g} GiB per GPU "
                           f"({gpu_gib:.4g} GiB device - {100 * config.memory_margin:g}% margin")
    assert line.endswith("; the trainer's default)") == (not flags)


def test_search_prints_the_trainers_budget_and_its_recipe_flags_reproduce_the_plan(monkeypatch, files, capsys,
                                                                                   tmp_path):
    """8 GPUs, 2.5 GiB each: the search plans to the trainer's budget there; parsed by
    HfArgumentParser as recipes/train.py does, its flags plan the batch to the same plan on a GPU
    of any size (the exact budget travels as memory_budget_gib)."""
    search = [*files, "--world-size", "8", "--search-layout", "--search-workers", "1", "--gpu-memory-gib", "2.5",
              "--max-tokens-per-unit", "4096", "--checkpoint-levels", "keep_attn"]
    assert main(search) == 0
    table = capsys.readouterr().out
    assert "memory budget planned to: 0.3 GiB per GPU (2.5 GiB device - 8% margin - 2 GiB reserve; " \
           "the trainer's default)" in table
    assert main([*search, "--json", "--emit-plan", str(tmp_path / "plan.json")]) == 0
    out = json.loads(capsys.readouterr().out)
    budget = trainer_budget(monkeypatch, InfiniPipeConfig(), 2.5)
    assert out["memory_budget_bytes"] == budget and out["device_memory_bytes"] == 2.5 * GIB
    rec = out["recommended"]
    assert f"recipe flags: {rec['recipe_flags']} (recipes/train.py" in table
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(EPPTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "unused", "--use_cpu", "true", *shlex.split(rec["recipe_flags"])])
    assert args.tokens_per_step == sum(LENGTHS)
    assert (args.max_tokens_per_unit, list(args.checkpoint_levels)) == (4096, ["keep_attn"])
    config = InfiniPipeConfig(**config_kwargs(args))
    assert trainer_budget(monkeypatch, config, 80.0) == budget  # whatever the GPU reports
    replan = plan_step(LENGTHS, ModelSpec.from_config_dict(TINY), ParallelDims(pp_degree=config.pp_degree, dp_degree=config.dp_degree, sp_degree=config.sp_degree, shard=config.shard), PlanOptions(memory_budget_bytes=budget, max_tokens_per_unit=config.max_tokens_per_unit, num_slices=config.num_slices, checkpointing=config.checkpointing, loss_chunk_tokens=config.loss_chunk_tokens, sp_rounds=config.sp_rounds, checkpoint_levels=config.checkpoint_levels))
    assert replan.feasible and replan.summary()["tokens_per_s"] == rec["tokens_per_s"]
    searched, again = json.loads((tmp_path / "plan.json").read_text()), json.loads(replan.plan.to_json())
    assert (again["units"], again["actions"]) == (searched["units"], searched["actions"])


def test_budget_flags_and_their_errors(files, capsys):
    plain = [*files, "--pp", "2", "--json"]
    assert main([*plain, "--memory-budget-gib", "0.3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["memory_budget_bytes"] == 0.3 * GIB and out["memory_margin"] is None
    assert out["memory_reserve_bytes"] is None and out["device_memory_bytes"] == 80 * GIB
    assert main([*plain, "--gpu-memory-gib", "2"]) == 2  # 2 * 0.92 - 2 <= 0
    err = capsys.readouterr().err
    assert "leaves -0.16 GiB to plan to" in err and "--memory-budget-gib" in err and "--memory-reserve-gib" in err
    assert main([*plain, "--memory-margin", "0.6"]) == 2
    assert "memory_margin (--memory-margin) must be in [0, 0.5)" in capsys.readouterr().err
    assert main([*plain, "--gpu-memory-gib", "0"]) == 2
    assert "--gpu-memory-gib must be > 0" in capsys.readouterr().err
    search = [*files, "--world-size", "2", "--search-layout", "--search-workers", "1"]
    assert main([*search, "--gpu-memory-gib", "1"]) == 2
    assert "--memory-budget-gib" in capsys.readouterr().err


def test_lengths_over_the_models_positions_are_warned(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("16384\n3000\n900\n")
    short = ["--lengths", str(lengths), "--pp", "4", "--json"]
    assert main(["--model", str(config_path("llama3-8b")), *short]) == 0
    captured = capsys.readouterr()
    warning = next(line for line in captured.err.splitlines() if line.startswith("warning: "))
    for words in ("1 of 3 sequences (longest 16384 tokens)", "max_position_embeddings=8192",
                  "long_document_policy='split'", "'reject'", "llama3.1-8b.json"):
        assert words in warning
    assert json.loads(captured.out)["warnings"] == [warning.removeprefix("warning: ")]
    assert main(["--model", str(config_path("llama3.1-8b")), *short]) == 0  # 128K positions: no warning
    captured = capsys.readouterr()
    assert "warning" not in captured.err and "warnings" not in json.loads(captured.out)


def test_the_search_warns_too(files, tmp_path, capsys):
    model = tmp_path / "short.json"
    model.write_text(json.dumps({**TINY, "max_position_embeddings": 4096}))
    assert main([*files, "--model", str(model), "--world-size", "2", "--search-layout", "--search-workers", "1",
                 "--memory-budget-gib", "0.3", "--json"]) == 0
    captured = capsys.readouterr()
    assert "max_position_embeddings=4096" in captured.err
    assert json.loads(captured.out)["warnings"][0].startswith("2 of 16 sequences (longest 6000 tokens)")


def test_states_that_fit_nowhere_get_advice_with_the_numbers(tmp_path, capsys):
    """Llama-3.1-8B on one 80 GB GPU: the model states (about 120 GiB) are the cause, not a length."""
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("16384\n8000\n2000\n")
    model = ["--model", str(config_path("llama3.1-8b")), "--lengths", str(lengths)]
    assert main([*model, "--pp", "1", "--json"]) == 0
    error = json.loads(capsys.readouterr().out)["error"]
    assert main([*model, "--world-size", "1", "--gpus-per-node", "1", "--search-layout"]) == 1
    search_error = capsys.readouterr().err
    for message in (error, search_error):
        assert "model states" in message and "120 GiB per GPU" in message and "71.6 GiB" in message
        assert "pp_degree=2 (2 GPUs" in message and "shard='dp' over dp_degree=4 replicas (4 GPUs" in message
        assert "LoRA" in message and "the largest that fits is 0" not in message
        assert "split or truncate" not in message
    assert "shard='sp' with sp_degree=4 (4 GPUs" in error  # one GPU per node: no SP group in the search
    assert "Largest trainable sequence per layout" in search_error


def test_options_without_a_command_line_form_are_said(files, capsys):
    search = [*files, "--world-size", "2", "--search-layout", "--search-workers", "1", "--memory-budget-gib", "0.3",
              "--checkpoint-levels", "none", "--no-sp-rounds"]
    assert main([*search, "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)["recommended"]
    assert rec["training_arguments"]["checkpoint_levels"] == [] and rec["training_arguments"]["sp_rounds"] is False
    assert "checkpoint_levels" not in rec["recipe_flags"] and "--sp_rounds False" in rec["recipe_flags"]
    assert main(search) == 0
    out = capsys.readouterr().out
    assert "checkpoint_levels=[]" in out and "(no command-line form for checkpoint_levels=[]: set it in Python)" in out
