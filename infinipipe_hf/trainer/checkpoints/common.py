"""What every checkpoint file shares: file names, who writes, whole tensors from (sharded) stages.

A checkpoint written by N stages is what ``save_pretrained`` writes for the unsplit model, so
``from_pretrained`` (or ``PeftModel.from_pretrained``) loads it in one process.  One rank per stage
writes; all ranks must see one shared filesystem (rank 0 reads the other stages' files).
"""
from __future__ import annotations

import torch

from infinipipe_hf.runtime.parallel.fsdp_api import full_tensor

LAYOUT_NAME = "epp_layout.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_INDEX_NAME = "model.safetensors.index.json"
ADAPTER_NAME = "adapter_model.safetensors"
TIED_HEAD = "lm_head.weight"
TIED_EMBED = "model.embed_tokens.weight"


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def is_tied(engine) -> bool:
    return bool(getattr(engine.stage, "tie_word_embeddings", False))


def is_sharded(engine) -> bool:
    return getattr(engine, "sharding", None) is not None


def is_writer(engine) -> bool:
    """One rank per stage writes its files (the others hold the same tensors or shards of them)."""
    return engine.layout.dp_rank == 0 and engine.layout.sp_rank == 0


def gathered(items, keep: bool) -> dict[str, torch.Tensor]:
    """Whole tensors on CPU, gathered one at a time (collective when sharded: every rank of the
    stage iterates the same names in the same order); ``keep=False`` drops each after gathering."""
    out = {}
    for name, t in items:
        full = full_tensor(t.detach())
        if keep:
            out[name] = full.to("cpu").contiguous()
    return out
