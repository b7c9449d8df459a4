"""HF's own parallelism settings on the trainer's arguments: accelerate's ``ParallelismConfig``
mapped onto ``sp_degree``/``dp_degree``/``shard`` (or refused, naming what to set), kept away from
``Trainer``'s accelerator afterwards; ``deepspeed=`` refused with our message before transformers
imports DeepSpeed (not installed here)."""
from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from accelerate import ParallelismConfig  # noqa: E402

from infinipipe_hf.trainer.arguments import EPPTrainingArguments  # noqa: E402
from infinipipe_hf.trainer.hf_conventions.parallelism import ENV_SWITCH  # noqa: E402


def _args(tmp_path, cls=EPPTrainingArguments, **kw):
    return cls(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)


def _layout(args):
    return args.sp_degree, args.dp_degree, args.shard


@pytest.mark.parametrize("pc, expected", [
    (ParallelismConfig(sp_size=2), (2, None, "none")),
    (ParallelismConfig(dp_replicate_size=2), (1, 2, "none")),
    (ParallelismConfig(dp_shard_size=4), (1, 4, "dp")),
    (ParallelismConfig(dp_shard_size=2, sp_size=2), (2, 2, "sp+dp")),  # ZeRO-3 over a stage's ranks
    (ParallelismConfig(dp_replicate_size=2, sp_size=4), (4, 2, "none")),
    ({"sp_size": 2, "dp_shard_size": 2}, (2, 2, "sp+dp")),  # a dict, as a JSON/YAML config gives it
    (ParallelismConfig(), (1, None, "none")),
])
def test_parallelism_config_maps_onto_the_pipeline_layout(tmp_path, pc, expected):
    args = _args(tmp_path, pp_degree=2, parallelism_config=pc)
    assert _layout(args) == expected
    assert args.parallelism_config is None  # Trainer must not hand it to Accelerator
    cfg = args.to_infinipipe_config()
    assert (cfg.sp_degree, cfg.dp_degree, cfg.shard) == expected


def test_an_explicit_shard_that_agrees_in_kind_is_kept(tmp_path):
    args = _args(tmp_path, pp_degree=2, shard="dp", parallelism_config=ParallelismConfig(dp_shard_size=2, sp_size=2))
    assert _layout(args) == (2, 2, "dp")  # shards over DP only, as asked
    args = _args(tmp_path, pp_degree=2, shard="hybrid",
                 parallelism_config=ParallelismConfig(dp_replicate_size=2, sp_size=2))
    assert _layout(args) == (2, 2, "hybrid")  # HSDP inside a stage: shard over SP, replicate over DP
    args = _args(tmp_path, pp_degree=2, sp_degree=2, dp_degree=2, parallelism_config=ParallelismConfig(
        dp_shard_size=2, sp_size=2))
    assert _layout(args) == (2, 2, "sp+dp")  # the same degrees twice: no conflict


@pytest.mark.parametrize("kw, fragments", [
    ({"parallelism_config": ParallelismConfig(cp_size=2)},
     ["cp_size=2", "ring attention", "sp_size=2", "sp_degree=2"]),
    ({"parallelism_config": ParallelismConfig(tp_size=2)}, ["tp_size=2", "tensor parallelism", "pp_degree"]),
    ({"parallelism_config": ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)},
     ["dp_replicate_size=2 with dp_shard_size=2 (HSDP)", "dp_shard_size=4", "shard='hybrid'"]),
    ({"sp_degree": 4, "parallelism_config": ParallelismConfig(sp_size=2)},
     ["parallelism_config.sp_size=2 and sp_degree=4 disagree"]),
    ({"dp_degree": 4, "parallelism_config": ParallelismConfig(dp_shard_size=2)},
     ["parallelism_config.dp_shard_size=2 and dp_degree=4 disagree"]),
    ({"dp_degree": 3, "parallelism_config": ParallelismConfig(dp_replicate_size=2)},
     ["parallelism_config.dp_replicate_size=2 and dp_degree=3 disagree"]),
    ({"shard": "dp", "parallelism_config": ParallelismConfig(dp_replicate_size=2)},
     ["dp_replicate_size=2 replicates", "shard='dp' shards them over DP", "dp_shard_size=2"]),
    ({"shard": "hybrid", "sp_degree": 2, "parallelism_config": ParallelismConfig(dp_shard_size=2)},
     ["dp_shard_size=2 shards the states over DP", "shard='hybrid' does not", "shard='dp'"]),
    ({"pp_degree": "auto", "parallelism_config": ParallelismConfig(dp_shard_size=2)},
     ["pp_degree='auto' chooses the DP degree", "dp_shard_size=2"]),
    ({"parallelism_config": "sp_size=2"}, ["parallelism_config must be an accelerate ParallelismConfig", "str"]),
])
def test_what_has_no_meaning_here_is_refused_naming_what_to_set(tmp_path, kw, fragments):
    kw = {"pp_degree": 2, **kw}
    with pytest.raises(ValueError) as info:
        _args(tmp_path, **kw)
    for f in fragments:
        assert f in str(info.value), (f, str(info.value))


def test_accelerate_launchs_environment_is_mapped_and_switched_off(tmp_path, monkeypatch):
    """``accelerate launch --parallelism_config_sp_size 2`` reaches the process as environment."""
    monkeypatch.setenv(ENV_SWITCH, "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2")
    args = _args(tmp_path, pp_degree=2)
    assert _layout(args) == (2, 2, "sp+dp")
    import os

    assert os.environ[ENV_SWITCH] == "false"  # Accelerator would build it again from the environment


def test_sp_handler_settings_that_do_not_apply_are_warned_about(tmp_path):
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    pc = ParallelismConfig(sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length=4096,
                                                                                  sp_seq_length_is_variable=False))
    with pytest.warns(UserWarning, match=r"sp_handler settings .*sp_seq_length.* are ignored"):
        args = _args(tmp_path, pp_degree=2, parallelism_config=pc)
    assert args.sp_degree == 2


def test_trainers_accelerator_never_sees_the_mapped_config(tmp_path):
    """A plain ``Trainer`` (one process) with HF's arguments refuses SP without FSDP/DeepSpeed in
    accelerate; with ours it gets no ``ParallelismConfig`` at all, so no device mesh is built."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2))
    hf_args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                parallelism_config=ParallelismConfig(sp_size=2))
    with pytest.raises(ValueError, match="ParallelismConfig"):  # the control: accelerate acts on it
        Trainer(model=model, args=hf_args)
    args = _args(tmp_path, pp_degree=2, parallelism_config=ParallelismConfig(sp_size=2))
    trainer = Trainer(model=model, args=args)
    assert trainer.accelerator.parallelism_config is None
    assert isinstance(trainer.model, torch.nn.Module)


def test_deepspeed_is_refused_with_our_message_before_transformers_imports_it(tmp_path, monkeypatch):
    if importlib.util.find_spec("deepspeed") is None:  # this environment: transformers' error would come first
        from transformers import TrainingArguments
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        try:
            with pytest.raises(Exception) as info:
                TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                  deepspeed={"zero_optimization": {"stage": 3}})
        finally:  # the failed construction leaves a half-built global config behind
            unset_hf_deepspeed_config()
        assert "deepspeed" in str(info.value).lower() and "EPPTrainer" not in str(info.value)
    with pytest.raises(ValueError, match=r"deepspeed=\{.*\}: deepspeed cannot be combined with EPPTrainer.*pp_degree"):
        _args(tmp_path, pp_degree=2, deepspeed={"zero_optimization": {"stage": 3}})
    with pytest.raises(ValueError, match="deepspeed='ds_config.json': deepspeed cannot be combined"):
        _args(tmp_path, pp_degree=2, deepspeed="ds_config.json")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match=r"ACCELERATE_USE_DEEPSPEED=true \(accelerate launch --use_deepspeed\)"):
        _args(tmp_path, pp_degree=2)


def test_sft_config_maps_and_refuses_alike(tmp_path):
    pytest.importorskip("trl")
    from infinipipe_hf.trainer.sft.config import EPPSFTConfig

    args = _args(tmp_path, EPPSFTConfig, pp_degree=2, bf16=False,
                 parallelism_config=ParallelismConfig(sp_size=2, dp_shard_size=2))
    assert _layout(args) == (2, 2, "sp+dp") and args.parallelism_config is None
    with pytest.raises(ValueError, match="cp_size=2.*sp_size=2"):
        _args(tmp_path, EPPSFTConfig, pp_degree=2, bf16=False, parallelism_config=ParallelismConfig(cp_size=2))
    with pytest.raises(ValueError, match="deepspeed cannot be combined with EPPTrainer"):
        _args(tmp_path, EPPSFTConfig, pp_degree=2, bf16=False, deepspeed={"zero_optimization": {"stage": 2}})


def test_fsdp_is_refused(tmp_path):
    with pytest.raises(ValueError, match="fsdp cannot be combined with EPPTrainer.*shard='dp'"):
        _args(tmp_path, pp_degree=2, fsdp="full_shard")
