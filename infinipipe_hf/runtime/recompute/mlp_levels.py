"""Checkpoint levels inside a decoder layer's gated MLP, chosen per (unit, layer) call.

The planner may recompute part of a layer instead of all of it (``ir/levels.py``):
``mlp`` reruns the MLP in backward and keeps only its input; ``mlp_act`` keeps the gate and up
outputs and reruns only ``act_fn(g) * u``.  Design: :func:`install_mlp_levels` gives each layer's
MLP module an instance ``forward`` (the module, its class and its parameter names stay as they
are, so state dicts, PEFT adapters and FSDP see the same model) that reads a per-call level set by
:func:`mlp_level` around the layer's call; with no level set it is the class's own forward.
Both levels are non-reentrant ``torch.utils.checkpoint`` regions, whose replay stops as soon as
everything backward needs is rebuilt: the product that ``down_proj`` saved is rebuilt before
``down_proj`` would run again, so ``mlp_act`` redoes two elementwise kernels and ``mlp`` the gate
and up projections plus those, never ``down_proj``'s GEMM.  The projections are called as modules,
so LoRA-wrapped ones work (with LoRA on ``down_proj`` the replay also reruns its base GEMM before
it reaches the adapter's saved input: exact, a little slower than the planner assumes).

Trade-off: the level is mutable state on the module, set and reset around one layer call.  A
whole-layer checkpoint replays the layer with no level set (the state's default), the same as
its first forward, because a layer is given at most one level.
"""
from __future__ import annotations

from contextlib import contextmanager
from types import MethodType
from typing import Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from infinipipe_hf.ir.levels import MLP, MLP_ACT, MLP_LEVELS

_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")
_LEVEL_ATTR = "_epp_checkpoint_level"


def install_mlp_levels(layer: nn.Module) -> bool:
    """Make ``layer.mlp`` switchable per call; ``False`` (nothing changed) if it is not a gated MLP
    the levels understand or already has its own instance ``forward`` (another library's hook)."""
    mlp = getattr(layer, "mlp", None)
    if mlp is None:
        return False
    if _LEVEL_ATTR in vars(mlp):
        return True
    if any(getattr(mlp, name, None) is None for name in _PARTS) or "forward" in vars(mlp):
        return False
    setattr(mlp, _LEVEL_ATTR, None)
    mlp.forward = MethodType(_leveled_forward, mlp)
    return True


def supports_levels(layer: nn.Module) -> bool:
    mlp = getattr(layer, "mlp", None)
    return mlp is not None and _LEVEL_ATTR in vars(mlp)


@contextmanager
def mlp_level(layer: nn.Module, level: str | None) -> Iterator[None]:
    """Run the layer's MLP at ``level`` (``mlp``, ``mlp_act`` or ``None``) inside the block."""
    if level is None:
        yield
        return
    if level not in MLP_LEVELS:
        raise ValueError(f"unknown MLP checkpoint level {level!r}; use one of {', '.join(MLP_LEVELS)}")
    if not supports_levels(layer):
        raise ValueError(f"{type(layer).__name__} has no switchable gated MLP (gate_proj, up_proj, "
                         f"down_proj, act_fn) so it cannot run checkpoint level {level!r}; plan with "
                         f"checkpoint_levels=() (whole layers only)")
    mlp = layer.mlp
    setattr(mlp, _LEVEL_ATTR, level)
    try:
        yield
    finally:
        setattr(mlp, _LEVEL_ATTR, None)


def _leveled_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    level = getattr(self, _LEVEL_ATTR)
    if level is None or not torch.is_grad_enabled():
        return type(self).forward(self, x)
    if level == MLP_ACT:
        return checkpoint(_act_and_down, self, self.gate_proj(x), self.up_proj(x), use_reentrant=False)
    if level == MLP:
        return checkpoint(_whole_mlp, self, x, use_reentrant=False)
    raise ValueError(f"unknown MLP checkpoint level {level!r}; use one of {', '.join(MLP_LEVELS)}")


def _act_and_down(mlp: nn.Module, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(mlp.act_fn(g) * u)


def _whole_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
