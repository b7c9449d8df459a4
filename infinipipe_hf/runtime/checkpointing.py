"""Per-layer activation checkpointing, switched per (stage, unit) from the plan.

Design: the stage runs its first ``num_checkpointed`` decoder layers under
``torch.utils.checkpoint`` (non-reentrant, so keyword arguments such as the unit context pass
through and backward works with inputs that do not require grad) and the rest normally.  The
planner's solver chooses the count per unit: long units trade recompute time for memory, short
ones keep everything.  Checkpointing the *first* layers (rather than the last) means the layers
whose activations are kept are the ones backward needs first, so they are freed earliest.
The KV store's ``put`` is idempotent, so a checkpointed slice's recompute reuses its stored K/V.
HF's own ``gradient_checkpointing`` stays off on stage models (the stage builder turns it off);
nesting both would recompute twice.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def run_decoder_layers(layers: Sequence[tuple[int, nn.Module]], hidden: torch.Tensor, *,
                       num_checkpointed: int, position_ids: torch.Tensor,
                       position_embeddings: tuple[torch.Tensor, torch.Tensor], unit_ctx) -> torch.Tensor:
    """Run ``layers`` in order; the first ``num_checkpointed`` under activation checkpointing."""
    if not 0 <= num_checkpointed <= len(layers):
        raise ValueError(f"num_checkpointed={num_checkpointed} must be between 0 and the stage's "
                         f"{len(layers)} decoder layers; fix the plan's checkpoint_layers")
    kwargs = dict(attention_mask=None, position_ids=position_ids,
                  position_embeddings=position_embeddings, epp_unit=unit_ctx)
    grad = torch.is_grad_enabled()
    for n, (_, layer) in enumerate(layers):
        if grad and n < num_checkpointed:
            hidden = checkpoint(layer, hidden, use_reentrant=False, **kwargs)
        else:
            hidden = layer(hidden, **kwargs)
        if isinstance(hidden, tuple):  # older decoder layers return (hidden,) tuples
            hidden = hidden[0]
    return hidden
