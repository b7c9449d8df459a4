"""A decoder layer's MLP computed over token tiles, chosen per unit by the plan (``mlp_tile_tokens``).

The gated MLP is per token, so running it tile by tile and concatenating the outputs is exact.
Each tile runs under a non-reentrant ``torch.utils.checkpoint``: between the forward and the
backward a tile keeps only its input (a view of the MLP's input), and its backward reruns the
gate and up projections of that tile alone, so at most one tile's ``g, act(g), u`` and product
(``4 * intermediate`` elements per token) and their gradients exist at a time instead of the
whole unit's.  This is what lets one long unit (a whole sequence, no K/V carried between slices)
run its layers without the MLP's intermediates growing with the sequence.

Design: :func:`mlp_tiles` gives the layer's MLP an instance ``forward`` for the duration of the
block and restores what was there (the class's forward, or the per-call level switch of
:mod:`.mlp_levels`), so state dicts, PEFT adapters and FSDP see the same modules.  A checkpointed
layer replays its forward in backward outside any ``with`` block of the caller, so such layers
are called through :func:`tiled_call` (or ``tiled_attention.tiled_layer_call``, which also
tiles the attention side), which enters the block on every call, replay included
(the replay then saves the same tensors as the first forward, as non-reentrant checkpointing
requires).  Inside a tiled layer the MLP levels ``mlp`` / ``mlp_act`` add nothing (the tiles
already recompute the MLP) and are not applied.
"""
from __future__ import annotations

from contextlib import contextmanager
from types import MethodType
from typing import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_TILE_ATTR = "_epp_mlp_tile_tokens"
TILE_ATTR = _TILE_ATTR
"""The attribute holding a tiled MLP's tokens per tile while its block runs."""
_PARTS = ("gate_proj", "up_proj", "down_proj")


def check_tile_tokens(tile_tokens: object, where: str = "mlp_tile_tokens") -> int:
    """``tile_tokens`` as a positive int; ``ValueError`` saying what was got otherwise."""
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"{where} must be a positive number of tokens per MLP tile, got {tile_tokens!r}")
    return tile_tokens


def supports_tiles(layer: nn.Module) -> bool:
    """Whether ``layer`` has a gated MLP (gate, up and down projections) that can run in tiles."""
    mlp = getattr(layer, "mlp", None)
    return mlp is not None and all(getattr(mlp, name, None) is not None for name in _PARTS)


@contextmanager
def mlp_tiles(layer: nn.Module, tile_tokens: int | None) -> Iterator[None]:
    """Run ``layer``'s MLP over tiles of ``tile_tokens`` tokens inside the block (``None``: as is)."""
    if tile_tokens is None:
        yield
        return
    check_tile_tokens(tile_tokens)
    if not supports_tiles(layer):
        raise ValueError(f"{type(layer).__name__} has no gated MLP (gate_proj, up_proj, down_proj) to run in "
                         f"tiles; plan without mlp_tile_tokens for this model")
    with instance_attributes(layer.mlp, forward=MethodType(_tiled_forward, layer.mlp), **{_TILE_ATTR: tile_tokens}):
        yield


@contextmanager
def instance_attributes(module: nn.Module, **values) -> Iterator[None]:
    """Set ``values`` as ``module``'s instance attributes inside the block and restore what was
    there after (also when blocks nest), so state dicts, PEFT adapters and FSDP see the same modules."""
    prior = {name: vars(module)[name] for name in values if name in vars(module)}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name in values:
            if name in prior:
                setattr(module, name, prior[name])
            else:
                delattr(module, name)


def tiled_call(layer: nn.Module, tile_tokens: int | None) -> Callable:
    """``layer`` itself (``None``), or a callable running it with its MLP in tiles on every call
    (use it as the function a checkpoint replays)."""
    if tile_tokens is None:
        return layer
    check_tile_tokens(tile_tokens)

    def run(*args, **kwargs):
        with mlp_tiles(layer, tile_tokens):
            return layer(*args, **kwargs)

    return run


def _tiled_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    tile = getattr(self, _TILE_ATTR)
    whole = type(self).forward
    n = x.shape[-2]
    if not torch.is_grad_enabled():
        return torch.cat([whole(self, x[..., s:s + tile, :]) for s in range(0, n, tile)], dim=-2)
    outs = [checkpoint(whole, self, x[..., s:s + tile, :], use_reentrant=False) for s in range(0, n, tile)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
