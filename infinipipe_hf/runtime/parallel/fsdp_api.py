"""What the runtime uses of torch's FSDP2, checked up front, and helpers for tensors that may be
``DTensor`` s (sharded parameters, their gradients and optimizer states)."""
from __future__ import annotations

import importlib
from typing import Any

import torch

# What the runtime calls on FSDP2: the public FSDPModule controls, and the two root-state hooks
# torch.distributed.pipelining also drives by hand (lazy init, end-of-backward callback).
_MODULE_API = ("set_requires_gradient_sync", "set_is_last_backward", "set_reshard_after_backward",
               "set_reshard_after_forward", "set_gradient_divide_factor",
               "set_force_sum_reduction_for_comms", "set_reduce_scatter_unused_params",
               "reset_iter_state", "unshard", "reshard")
_STATE_API = ("_lazy_init", "_root_post_backward_final_callback")


def fsdp2_api(setting: str):
    """``(fully_shard, MixedPrecisionPolicy, FSDPModule)`` or a ``ValueError`` saying what is missing;
    ``setting``: the layout setting that runs FSDP2, as the user wrote it (``"shard='sp'"``)."""
    try:
        import torch.distributed as dist

        if not dist.is_available():
            raise ImportError("torch.distributed is not available")
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
        importlib.import_module("torch.distributed.tensor")  # DTensor
    except ImportError as exc:
        raise ValueError(f"{setting} needs torch's FSDP2 (torch.distributed.fsdp.fully_shard), "
                         f"which this torch {torch.__version__} lacks ({exc}); upgrade torch (tested "
                         f"with 2.13) or use shard='none'") from exc
    missing = [n for n in _MODULE_API if not hasattr(FSDPModule, n)]
    missing += [n for n in _STATE_API if not hasattr(FSDPState, n)]
    if missing:
        raise ValueError(f"{setting}: this torch {torch.__version__} has FSDP2 without "
                         f"{', '.join(missing)}; upgrade torch (tested with 2.13) or use shard='none'")
    return fully_shard, MixedPrecisionPolicy, FSDPModule


# --- tensors that may be DTensors ---------------------------------------------------------------
def is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard (the storage itself, so in-place ops change the DTensor) or ``t``."""
    if not is_dtensor(t):
        return t
    with torch.no_grad():
        return t.to_local()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor; collective over the DTensor's mesh when sharded."""
    return t.full_tensor() if is_dtensor(t) else t


@torch.no_grad()
def copy_full_(dst: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``full`` (the whole tensor, on any device) into ``dst``; a DTensor takes only the rows
    of its own shard, so only those cross to the device.  No communication."""
    if tuple(full.shape) != tuple(dst.shape):
        raise ValueError(f"shape {tuple(full.shape)} does not match the parameter's {tuple(dst.shape)}")
    if not is_dtensor(dst):
        dst.copy_(full)
        return
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(dst.shape, dst.device_mesh, dst.placements)
    piece = full
    for dim, (n, start) in enumerate(zip(shape, offset)):
        if n != full.shape[dim]:
            piece = piece.narrow(dim, start, n)
    local = dst.to_local()
    if tuple(local.shape) != tuple(shape):
        raise AssertionError(f"local shard {tuple(local.shape)} != DTensor's {tuple(shape)}")
    local.copy_(piece)
