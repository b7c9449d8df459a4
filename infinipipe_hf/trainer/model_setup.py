"""Turning the user's model into this rank's pipeline engine: PEFT unwrapping, dtype, engine build.

Design: the engine prunes the HF model *in place* to this rank's stage, so the object the user
passed (and that ``Trainer`` keeps as ``self.model``) afterwards holds exactly this rank's
parameters under their original names.  A ``peft`` ``PeftModel`` is unwrapped to its base model
(``get_base_model()``, which already contains the LoRA modules) for the stage build; the
``PeftModel`` wrapper stays valid and is what adapters are saved from.  Frozen base weights stay
frozen: the engine and the optimizer only touch parameters with ``requires_grad``.

bf16: ``bf16=True`` casts the model to bfloat16 before the stage is built (pure bf16 weights,
activations and point-to-point transfers, since the pipeline sends hidden states in the stage's
dtype).  With a sharded stage (``shard`` != ``"none"``) it is FSDP2 mixed precision instead: the
shards keep the model's dtype (float32 master weights), parameters are gathered and the stage
runs in bf16, gradients are reduced in float32.  On CPU it warns: CPU bf16 matmuls are slow.
"""
from __future__ import annotations

import os

import torch

from infinipipe_hf.layout import check_launch, shard_mode
from infinipipe_hf.runtime.engine.engine import PipelineEngine
from infinipipe_hf.trainer import notices
from infinipipe_hf.trainer.auto_layout import is_auto

# Dense bf16 peak TFLOP/s per device, for the MFU estimate when peak_tflops is not given.
_PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0,
                     "A10G": 125.0, "L4": 121.0}


def is_peft_model(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def hf_model_of(model):
    """The ``PreTrainedModel`` the stage is cut from (the base model of a ``PeftModel``)."""
    return model.get_base_model() if is_peft_model(model) else model


def count_parameters(model) -> int:
    """Parameters of the whole (unsplit) model, a tied weight counted once; for MFU."""
    return sum(p.numel() for p in hf_model_of(model).parameters())


def apply_precision(model, args, shard: str = "none") -> torch.dtype | None:
    """Cast for ``bf16=True``; with sharding return the compute dtype for FSDP2 instead."""
    if not args.bf16:
        return None
    if not torch.cuda.is_available():
        notices.warn("bf16=True on CPU: the stage weights, activations and transfers are cast to "
                     "bfloat16 and run slowly on most CPUs; drop bf16=True to train in the model's "
                     "dtype")
    if shard_mode(shard).sharded:
        return torch.bfloat16  # shards keep the model's dtype; FSDP2 computes in bf16
    model.to(torch.bfloat16)
    return None


def check_world(args) -> tuple[int, int]:
    """``(world_size, dp_degree)``; a clear error when pp_degree x sp_degree does not divide the
    world (before any process group is built, so every rank fails alike instead of hanging)."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else \
        int(os.environ.get("WORLD_SIZE", "1"))
    return world, check_launch(world, args.pp_degree, getattr(args, "sp_degree", 1) or 1)


def preflight(model, args) -> None:
    """Every layout, model and argument error that does not need the data, before any of it is
    tokenized (hours on a real corpus): a supported HF model, ``pp_degree`` against its layers,
    ``pp_degree x sp_degree`` against the launched processes, ``sp_degree`` against its heads, the
    shard mode against this torch."""
    from infinipipe_hf.ir.model_spec import ModelSpec
    from infinipipe_hf.runtime.engine.build import check_degrees

    _ = args.device  # starts the process group the launcher asked for (as Trainer does)
    base = hf_model_of(model)
    if getattr(base, "config", None) is None:
        raise ValueError(f"{type(base).__name__} has no HF `config`; pass a transformers "
                         f"AutoModelForCausalLM model (Llama, Mistral, Qwen2, Qwen3) or a PeftModel of one")
    if is_auto(args):
        return  # the layout is checked once the search has chosen it (auto_layout.py, build_engine)
    n_layers = getattr(base.config, "num_hidden_layers", None)
    if n_layers is not None and args.pp_degree > n_layers:
        raise ValueError(f"pp_degree={args.pp_degree} cannot split a model with {n_layers} decoder "
                         f"layers (each stage needs at least one); use pp_degree <= {n_layers}")
    spec = ModelSpec.from_hf_config(base.config)
    world, _ = check_world(args)
    config = args.to_infinipipe_config()
    sharded = shard_mode(config.shard).sharded
    check_degrees(config, spec, world, torch.bfloat16 if args.bf16 and sharded else None)


def build_engine(model, args, planner=None) -> PipelineEngine:
    """Cut this rank's stage out of ``model`` (in place) and wrap it in a ``PipelineEngine``."""
    preflight(model, args)
    base = hf_model_of(model)
    config = args.to_infinipipe_config()
    compute_dtype = apply_precision(model, args, config.shard)
    # Trainer users set the deadline of every wait with ddp_timeout: timeout errors name it.
    return PipelineEngine(base, config, planner=planner, compute_dtype=compute_dtype,
                          timeout_setting="ddp_timeout (EPPTrainingArguments)")


def peak_flops_per_device(args, device: torch.device) -> float | None:
    """Peak FLOP/s of one device: ``args.peak_tflops``, else a table of known GPUs, else None."""
    if args.peak_tflops is not None:
        return args.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in _PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None
