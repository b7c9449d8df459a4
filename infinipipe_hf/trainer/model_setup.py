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

from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.runtime.engine.engine import PipelineEngine
from infinipipe_hf.trainer import notices
from infinipipe_hf.trainer.auto_layout import is_auto
from infinipipe_hf.trainer.batches.fit_check import warn_if_too_long

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


def apply_precision(model, args, dims: ParallelDims) -> torch.dtype | None:
    """Cast for ``bf16=True``; with ``dims`` sharded return the compute dtype for FSDP2 instead."""
    if not args.bf16:
        return None
    if not torch.cuda.is_available():
        notices.warn("bf16=True on CPU: the stage weights, activations and transfers are cast to "
                     "bfloat16 and run slowly on most CPUs; drop bf16=True to train in the model's "
                     "dtype")
    if dims.shard.sharded:
        return torch.bfloat16  # shards keep the model's dtype; FSDP2 computes in bf16
    model.to(torch.bfloat16)
    return None


def launched_world_size() -> int:
    """Processes of this job: the process group's size, else the launcher's ``WORLD_SIZE``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def preflight(model, args) -> ParallelDims | None:
    """Every layout, model and argument error that does not need the data, before any of it is
    tokenized (hours on a real corpus): a supported HF model, and the job's layout built once
    (``pp_degree x sp_degree`` against the launched processes, against the model's layers and
    heads, the shard mode against this torch).  ``None`` with ``pp_degree="auto"``: the layout
    search builds it once it has chosen."""
    from infinipipe_hf.ir.model_spec import ModelSpec
    from infinipipe_hf.runtime.engine.build import build_dims

    _ = args.device  # starts the process group the launcher asked for (as Trainer does)
    base = hf_model_of(model)
    if getattr(base, "config", None) is None:
        raise ValueError(f"{type(base).__name__} has no HF `config`; pass a transformers "
                         f"AutoModelForCausalLM model (Llama, Mistral, Qwen2, Qwen3) or a PeftModel of one")
    if is_auto(args):
        return None
    spec = ModelSpec.from_hf_config(base.config)
    dims = build_dims(args.to_infinipipe_config(), spec, launched_world_size(), None)
    warn_if_too_long(args, spec, dims)  # the longest sequence a batch may hold against this layout
    return dims


def build_engine(model, args, planner=None, dims: ParallelDims | None = None) -> PipelineEngine:
    """Cut this rank's stage out of ``model`` (in place) and wrap it in a ``PipelineEngine`` on
    ``dims`` (the layout :func:`preflight` built; built here when not given)."""
    dims = preflight(model, args) if dims is None else dims
    base = hf_model_of(model)
    config = args.to_infinipipe_config()
    compute_dtype = apply_precision(model, args, dims)
    # Trainer users set the deadline of every wait with ddp_timeout: timeout errors name it.
    return PipelineEngine(base, config, planner=planner, compute_dtype=compute_dtype,
                          timeout_setting="ddp_timeout (EPPTrainingArguments)", dims=dims)


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
