"""``compile_layers`` settings: the config's checks, the trainer's ``torch_compile*`` arguments mapped
onto them (no longer warned as ignored), and the engine-side settings.  Nothing is compiled here."""
from __future__ import annotations

import warnings

import pytest

from infinipipe_hf.config import InfiniPipeConfig
from infinipipe_hf.runtime.stage.compile import LayerCompile, layer_compile_settings


def _args(tmp_path, **kw):
    from infinipipe_hf.trainer.arguments import EPPTrainingArguments

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        args = EPPTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)
    return args, [str(w.message) for w in seen]


def test_torch_compile_arguments_map_onto_compile_layers(tmp_path):
    pytest.importorskip("transformers")
    args, seen = _args(tmp_path, torch_compile=True)
    cfg = args.to_infinipipe_config()
    assert (cfg.compile_layers, cfg.compile_backend, cfg.compile_mode) == (True, "inductor", None)
    assert not any("torch_compile" in m and "ignored" in m for m in seen), seen
    # As in HF, a mode or backend alone turns torch_compile on.
    args, _ = _args(tmp_path, torch_compile_mode="max-autotune-no-cudagraphs", torch_compile_backend="aot_eager")
    cfg = args.to_infinipipe_config()
    assert (cfg.compile_layers, cfg.compile_backend, cfg.compile_mode) == (
        True, "aot_eager", "max-autotune-no-cudagraphs")
    assert _args(tmp_path)[0].to_infinipipe_config().compile_layers is False


def test_bad_compile_settings_are_value_errors_and_unused_ones_warn():
    with pytest.raises(ValueError, match="compile_mode='fastest' is not a torch.compile mode.*max-autotune"):
        InfiniPipeConfig(compile_layers=True, compile_mode="fastest")
    with pytest.raises(ValueError, match="compile_backend must name a torch.compile backend"):
        InfiniPipeConfig(compile_layers=True, compile_backend="")
    with pytest.warns(UserWarning, match="ignored: compile_layers=False"):
        InfiniPipeConfig(compile_mode="default")
    with pytest.raises(ValueError, match="compile_backend='nope' is not a torch.compile backend.*inductor"):
        layer_compile_settings(InfiniPipeConfig(compile_layers=True, compile_backend="nope"))


def test_engine_settings_from_the_config():
    assert layer_compile_settings(InfiniPipeConfig()) is None
    assert layer_compile_settings(InfiniPipeConfig(compile_layers=True)) == LayerCompile("inductor", None)
    with pytest.warns(UserWarning, match="records CUDA graphs"):
        got = layer_compile_settings(InfiniPipeConfig(compile_layers=True, compile_mode="reduce-overhead"))
    assert got == LayerCompile("inductor", "reduce-overhead")
