"""EPPTrainingArguments carries every InfiniPipeConfig setting, generated from the config itself.

The config is the one declaration: every field appears on the arguments with its type, default
and docstring as help (or is read from the Trainer's own argument through the explicit table),
``to_infinipipe_config`` passes every value on, the command line parses them, and a field added
to a config class appears without any change to the trainer package.
"""
from __future__ import annotations

import dataclasses
import typing

import pytest

pytest.importorskip("transformers")

from transformers import HfArgumentParser  # noqa: E402

from infinipipe_hf.config import InfiniPipeConfig  # noqa: E402
from infinipipe_hf.trainer import pipeline_arguments as pa  # noqa: E402
from infinipipe_hf.trainer.arguments import EPPTrainingArguments  # noqa: E402


def _args(tmp_path, **kw):
    return EPPTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)


def test_every_config_field_is_an_argument_with_its_type_default_and_help():
    arg_fields = {f.name: f for f in dataclasses.fields(EPPTrainingArguments)}
    arg_hints = typing.get_type_hints(EPPTrainingArguments)
    cfg_hints = typing.get_type_hints(InfiniPipeConfig)
    docs = pa.field_docstrings(InfiniPipeConfig)
    for f in dataclasses.fields(InfiniPipeConfig):
        if f.name in pa.FROM_TRAINING_ARGUMENTS:
            source, _ = pa.FROM_TRAINING_ARGUMENTS[f.name]
            assert source in arg_fields, f"{f.name} is read from TrainingArguments.{source}, which is gone"
            continue
        name = pa.argument_name(f.name)
        assert name in arg_fields, f"InfiniPipeConfig.{f.name} is not on EPPTrainingArguments"
        # tuple-typed settings are lists on the command line (the config converts them back);
        # degrees the layout search may choose parse as an integer or "auto"
        want = pa._as_list_type(cfg_hints[f.name])
        if f.name in pa.AUTO_DEGREES:
            want = pa.DegreeOrAuto | None if type(None) in typing.get_args(want) else pa.DegreeOrAuto
        assert arg_hints[name] == want, name
        assert docs[f.name] and arg_fields[name].metadata["help"] == docs[f.name].replace("%", "%%")


def test_default_arguments_give_the_default_config(tmp_path):
    cfg = _args(tmp_path, ddp_timeout=InfiniPipeConfig().p2p_timeout_s).to_infinipipe_config()
    assert cfg == InfiniPipeConfig()


def test_non_default_values_reach_the_engine_config(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text("{}")
    values = dict(pp_degree=2, dp_degree=3, sp_degree=2, shard="sp", epp_schedule="gpipe",
                  memory_budget_gib=7.5, memory_reserve_gib=1.0, profile=str(profile), layer_split=[1, 3],
                  checkpointing="full", max_tokens_per_unit=77, num_slices=[2, 3], attention_backend="sdpa",
                  loss_chunk_tokens=99, seed_plan_on_rank0=True)
    cfg = _args(tmp_path, label_smoothing_factor=0.2, ddp_timeout=123, **values).to_infinipipe_config()
    for name, value in values.items():
        assert getattr(cfg, "schedule" if name == "epp_schedule" else name) == value, name
    assert cfg.label_smoothing == 0.2 and cfg.p2p_timeout_s == 123.0


def test_command_line_parses_the_pipeline_fields(tmp_path):
    (args,) = HfArgumentParser(EPPTrainingArguments).parse_args_into_dataclasses([
        "--output_dir", str(tmp_path), "--use_cpu", "--pp_degree", "4", "--num_slices", "2", "4",
        "--attention_backend", "sdpa", "--loss_chunk_tokens", "512", "--memory_reserve_gib", "3.5",
        "--seed_plan_on_rank0", "--epp_schedule", "seq1f1b", "--layer_split", "2", "2", "1", "3",
        "--ddp_timeout", "45", "--label_smoothing_factor", "0.1", "--checkpoint_levels", "mlp"])
    cfg = args.to_infinipipe_config()
    assert (cfg.pp_degree, cfg.num_slices, cfg.attention_backend, cfg.loss_chunk_tokens,
            cfg.memory_reserve_gib, cfg.seed_plan_on_rank0, cfg.schedule, cfg.layer_split,
            cfg.p2p_timeout_s, cfg.label_smoothing, cfg.checkpoint_levels) == (
        4, [2, 4], "sdpa", 512, 3.5, True, "seq1f1b", [2, 2, 1, 3], 45.0, 0.1, ("mlp",))


def test_a_new_config_field_appears_without_touching_the_trainer():
    @dataclasses.dataclass
    class FutureConfig(InfiniPipeConfig):
        overlap_grad_sync: bool = False
        """Overlap the gradient all-reduce with the cool-down."""

    specs = {name: (tp, f) for name, tp, f in pa.pipeline_argument_fields(FutureConfig)}
    assert specs["overlap_grad_sync"][0] is bool
    assert specs["overlap_grad_sync"][1].metadata["help"] == "Overlap the gradient all-reduce with the cool-down."
    generated = dataclasses.make_dataclass("Generated", list(pa.pipeline_argument_fields(FutureConfig)))
    assert generated().overlap_grad_sync is False and generated().epp_schedule == "epp"


def test_a_config_field_named_like_a_trainer_argument_is_refused():
    @dataclasses.dataclass
    class Clashing(InfiniPipeConfig):
        seed: int = 0
        """Would shadow TrainingArguments.seed."""

    with pytest.raises(TypeError, match="collides with TrainingArguments.seed"):
        pa.pipeline_argument_fields(Clashing)


def test_config_errors_use_the_argument_names(tmp_path):
    with pytest.raises(ValueError, match="^epp_schedule='1f1b' is not known"):
        _args(tmp_path, epp_schedule="1f1b")
    with pytest.raises(ValueError, match="^label_smoothing_factor must be in"):
        _args(tmp_path, label_smoothing_factor=1.5)
    with pytest.raises(ValueError, match="shard='zero3' is not known"):
        _args(tmp_path, shard="zero3")
    with pytest.raises(ValueError, match="layer_split=\\[3\\] must list 2"):
        _args(tmp_path, pp_degree=2, layer_split=[3])


def test_help_renders(capsys):
    with pytest.raises(SystemExit):
        HfArgumentParser(EPPTrainingArguments).parse_args_into_dataclasses(["--help"])
    out = capsys.readouterr().out
    assert "--attention_backend" in out and "--seed_plan_on_rank0" in out and "--sp_degree" in out


def test_degrees_parse_as_auto_or_integers_on_the_command_line():
    """``--pp_degree auto`` (and sp/dp) reach the layout search; integers stay integers; anything
    else is argparse's error naming the argument."""
    import pytest
    from transformers import HfArgumentParser

    from infinipipe_hf import EPPTrainingArguments

    parser = HfArgumentParser(EPPTrainingArguments)

    def parse(*argv):
        (a,) = parser.parse_args_into_dataclasses(["--output_dir", "/tmp/epp_args", "--use_cpu", "true", *argv])
        return a.pp_degree, a.sp_degree, a.dp_degree

    assert parse("--pp_degree", "auto", "--sp_degree", "auto", "--dp_degree", "auto") == ("auto", "auto", "auto")
    assert parse("--pp_degree", "2", "--sp_degree", "4") == (2, 4, None)
    assert parse() == (1, 1, None)
    with pytest.raises(SystemExit):
        parse("--pp_degree", "two")
