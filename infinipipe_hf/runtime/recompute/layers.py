"""Per-layer activation checkpointing, switched per (stage, unit) from the plan.

Design: the stage runs its first ``num_checkpointed`` decoder layers under
``torch.utils.checkpoint`` (non-reentrant, so keyword arguments such as the unit context pass
through and backward works with inputs that do not require grad), the next ones at the plan's
finer levels (``keep_attn``: the same checkpoint with the attention core's output kept,
``keep_attn.py``; then ``mlp`` and ``mlp_act`` inside the MLP: ``mlp_levels.py``)
and the rest normally.  The planner's solver chooses the counts per unit: long units trade recompute time for
memory, short ones keep everything.  Heaviest level first (rather than last) means the layers
whose activations are kept are the ones backward needs first, so they are freed earliest, and the
layers that rebuild the most rebuild when the most has been freed.
An ``offload`` layer is a ``full`` one whose saved input waits in the stage's host tier (the KV
store's, ``runtime/offload/activation_hooks.py``) between the forward and the backward; an
``offload_attn`` layer (first of all) is a ``keep_attn`` one whose input goes the same way and
whose kept attention output and log-sum-exp wait in the same tier (a host ``KeptAttention``);
``offload_pair`` layers (next) are ``offload_attn`` ones in pairs whose second layer keeps no
input: its backward rebuilds it by replaying the first layer without grad (``offload_pair.py``).
The KV store's ``put`` is idempotent, so a checkpointed slice's recompute reuses its stored K/V.
HF's own ``gradient_checkpointing`` stays off on stage models (the stage builder turns it off);
nesting both would recompute twice.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Mapping, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from infinipipe_hf.ir.levels import FULL, HOST_LEVELS, KEEP_ATTN, OFFLOAD, OFFLOAD_ATTN, OFFLOAD_PAIR, CheckpointMix
from infinipipe_hf.runtime.recompute.keep_attn import KeptAttention
from infinipipe_hf.runtime.recompute.mlp_levels import mlp_level
from infinipipe_hf.runtime.recompute.offload_pair import HostSavedInputs
from infinipipe_hf.runtime.recompute.tiled_attention import tiled_layer_call


def run_decoder_layers(layers: Sequence[tuple[int, nn.Module]], hidden: torch.Tensor, *,
                       num_checkpointed: int, position_ids: torch.Tensor,
                       position_embeddings: tuple[torch.Tensor, torch.Tensor], unit_ctx,
                       finer_levels: Mapping[str, int] | None = None,
                       mlp_tile_tokens: int | None = None,
                       attention_tile_tokens: int | None = None) -> torch.Tensor:
    """Run ``layers`` in order: the first ``finer_levels["offload_attn"]`` at ``keep_attn`` with
    everything kept in the host tier, the next ``finer_levels["offload_pair"]`` as those but in
    pairs whose second layer's input is rebuilt, the next ``finer_levels["offload"]`` checkpointed with their
    input in the host tier, the next ``num_checkpointed`` under activation checkpointing, the
    next ``finer_levels["keep_attn"]``, ``finer_levels["mlp"]`` and ``finer_levels["mlp_act"]``
    at those levels; with ``mlp_tile_tokens`` every layer's MLP runs in tiles (``tiled_mlp.py``), with
    ``attention_tile_tokens`` every layer's token-wise parts (``tiled_attention.py``)."""
    if not 0 <= num_checkpointed <= len(layers):
        raise ValueError(f"num_checkpointed={num_checkpointed} must be between 0 and the stage's "
                         f"{len(layers)} decoder layers; fix the plan's checkpoint_layers")
    grad = torch.is_grad_enabled()
    per_layer = CheckpointMix.of(num_checkpointed, finer_levels if grad else None).layer_levels(len(layers))
    kwargs = dict(attention_mask=None, position_ids=position_ids,
                  position_embeddings=position_embeddings, epp_unit=unit_ctx)
    tier = unit_ctx.store.host_tier if any(lv in HOST_LEVELS for lv in per_layer) else None
    # One store per unit call and level: the checkpoints' saved kwargs keep it alive until backward.
    host_store = functools.partial(KeptAttention, host_tier=tier, tag=unit_ctx.unit_id)
    stores = {KEEP_ATTN: KeptAttention, OFFLOAD_ATTN: host_store, OFFLOAD_PAIR: host_store}
    kept_kwargs = {lv: dict(kwargs, epp_unit=dataclasses.replace(unit_ctx, kept_attention=make()))
                   for lv, make in stores.items() if lv in per_layer}
    host_inputs = HostSavedInputs(per_layer, tier, unit_ctx.unit_id) if tier is not None else None
    for i, ((_, layer), level) in enumerate(zip(layers, per_layer)):
        call = tiled_layer_call(layer, mlp_tile_tokens, attention_tile_tokens)  # replays run tiled too
        if grad and level == FULL:
            hidden = checkpoint(call, hidden, use_reentrant=False, **kwargs)
        elif level in HOST_LEVELS:
            # The forward's hooks take the checkpoint's saved input (a pair's second layer's is
            # rebuilt instead); a host store puts its own tensors in the same tier.  The replay (in
            # backward) runs outside these hooks.
            layer_kwargs = kept_kwargs.get(level, kwargs)
            with host_inputs.saved(i, hidden, call, layer_kwargs):
                hidden = checkpoint(call, hidden, use_reentrant=False, **layer_kwargs)
        elif level == KEEP_ATTN:
            hidden = checkpoint(call, hidden, use_reentrant=False, **kept_kwargs[KEEP_ATTN])
        else:
            with mlp_level(layer, None if mlp_tile_tokens or attention_tile_tokens else level):
                hidden = call(hidden, **kwargs)
        if isinstance(hidden, tuple):  # older decoder layers return (hidden,) tuples
            hidden = hidden[0]
    return hidden


def runnable_levels(levels: Sequence[str], layers: Sequence[nn.Module], device: torch.device,
                    dtype: torch.dtype = torch.float32) -> tuple[tuple[str, ...], str | None]:
    """The subset of ``levels`` these decoder layers can run on ``device`` in ``dtype``, and why
    any were dropped (``None`` when none was): the MLP levels need a switchable gated MLP,
    ``keep_attn``, ``offload_attn`` and ``offload_pair`` an attention kernel pair for the device and
    dtype (on CUDA: one that passed its self-check there) and no attention dropout."""
    from infinipipe_hf.runtime.recompute.keep_attn import kept_attention_supported
    from infinipipe_hf.runtime.recompute.mlp_levels import supports_levels

    kept, why = [], []
    for level in levels:
        if level == OFFLOAD:
            reason = None  # a whole-layer checkpoint: runs wherever ``full`` does
        elif level in (KEEP_ATTN, OFFLOAD_ATTN, OFFLOAD_PAIR):  # keep_attn in host memory, the last in pairs
            attns = [getattr(layer, "self_attn", None) for layer in layers]
            dropout = max((float(getattr(a, "attention_dropout", 0.0) or 0.0) for a in attns), default=0.0)
            head_dim = max((int(getattr(a, "head_dim", 0) or 0) for a in attns), default=0) or None
            reason = kept_attention_supported(device, dtype, dropout, head_dim)
            if reason is not None and level != KEEP_ATTN:
                reason = f"{level} (keep_attn in host memory{', in pairs' if level == OFFLOAD_PAIR else ''}): {reason}"
        elif not all(supports_levels(layer) for layer in layers):
            reason = ("mlp and mlp_act need a gated MLP (gate_proj, up_proj, down_proj, act_fn) to "
                      "switch, which this model's decoder layers do not have")
        else:
            reason = None
        if reason is None:
            kept.append(level)
        else:
            why.append(reason)
    return tuple(kept), ("; ".join(dict.fromkeys(why)) if why else None)  # both MLP levels: one reason
