"""Building one rank's engine: the checks before any process group exists, then the stage.

Every check runs before the first process group is built, so every rank fails the same way,
early, instead of some ranks hanging in a collective the others never join.  The stage is cut out
of the HF model in place; with sharding it is sharded on the host/meta device first, so only this
rank's shards are ever put on the device.
"""
from __future__ import annotations

import os

import torch

from infinipipe_hf.config import InfiniPipeConfig
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims, state_offload
from infinipipe_hf.runtime.parallel.fsdp import StageSharding
from infinipipe_hf.runtime.parallel.fsdp_api import fsdp2_api
from infinipipe_hf.runtime.parallel.mesh import ParallelLayout
from infinipipe_hf.runtime.parallel.sequence_parallel import SequenceParallel


def dist_or_none():
    """``torch.distributed`` when a process group is initialised, else ``None``."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def tied_embeddings(model) -> bool:
    # Same rule as build_stage, so every rank agrees on whether the tied-embedding groups exist.
    return bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))


def default_device() -> torch.device:
    """This process's CUDA device (``LOCAL_RANK``), else the CPU."""
    if torch.cuda.is_available():
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def check_inputs(model, config: InfiniPipeConfig, dist) -> ModelSpec:
    """A process group when one is needed, and an HF model: the model's ``ModelSpec``."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if dist is None and (config.pp_degree > 1 or config.sp_degree > 1 or launched > 1):
        raise ValueError(f"torch.distributed is not initialised (pp_degree={config.pp_degree}, "
                         f"sp_degree={config.sp_degree}, WORLD_SIZE={launched}); call "
                         f"torch.distributed.init_process_group() before building the "
                         f"PipelineEngine (launch with torchrun)")
    if getattr(model, "config", None) is None:
        raise ValueError(f"{type(model).__name__} has no HF `config`; pass a transformers "
                         f"AutoModelForCausalLM model (Llama, Mistral, Qwen2, Qwen3)")
    return ModelSpec.from_hf_config(model.config)


def build_dims(config: InfiniPipeConfig, spec: ModelSpec, world: int, compute_dtype: torch.dtype | None) -> ParallelDims:
    """The job's layout, built once: the degrees against the world and the model
    (``ParallelDims``' checks), and the shard mode against this torch."""
    mode, offload = config.shard_row(), state_offload(config.state_offload)
    fsdp = mode.sharded or offload.weights_on_host
    if fsdp:  # first: without FSDP2 no world makes the shard mode run
        fsdp2_api(f"shard={mode.name!r}" if mode.sharded else f"state_offload={offload.name!r}")
    dims = config.layout(world, model=spec)
    if not fsdp and compute_dtype is not None:
        raise ValueError(f"compute_dtype={compute_dtype} is FSDP2 mixed precision and needs "
                         f"shard != 'none'; without sharding cast the model (model.to(dtype))")
    return dims


def build_stage(model, config: InfiniPipeConfig, spec: ModelSpec, layout: ParallelLayout,
                device: torch.device, compute_dtype: torch.dtype | None):
    """``(layers_per_stage, stage, sharding or None)``: this rank's stage, on ``device``."""
    from infinipipe_hf.ir.partition import partition_layers
    from infinipipe_hf.runtime.stage.module import build_stage as cut_stage

    ranges = partition_layers(spec.num_layers, layout.pp_degree, layer_split=config.layer_split,
                              last_stage_extra=spec.embedding_params / spec.layer_params)
    stage = cut_stage(model, layout.stage_index, ranges[layout.stage_index])
    if config.compile_layers:  # before FSDP2 wraps the layers, as torchtitan does
        from infinipipe_hf.runtime.stage.compile import compile_stage_layers, layer_compile_settings

        compile_stage_layers(stage, layer_compile_settings(config))
    sharding = None
    if layout.dims.shard.sharded or layout.dims.state_offload.weights_on_host:
        # Sharded on the host/meta device: only this rank's shards are put on the device (with
        # state_offload='states': kept in host memory, an unsharded stage sharded over its rank alone).
        sharding = StageSharding(stage, layout, device, compute_dtype=compute_dtype)
    else:
        stage.to(device)
    return [len(r) for r in ranges], stage, sharding


def build_sequence_parallel(config: InfiniPipeConfig, spec: ModelSpec,
                            layout: ParallelLayout) -> SequenceParallel | None:
    if layout.sp_degree <= 1:
        return None
    return SequenceParallel(layout, num_heads=spec.num_attention_heads,
                            num_kv_heads=spec.num_key_value_heads, timeout_s=config.p2p_timeout_s)
