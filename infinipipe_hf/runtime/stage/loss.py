"""Chunked LM head + cross-entropy on the last stage.

Design: logits of a long unit would dominate memory (T x vocab), so the head and the loss run in
chunks of ``loss_chunk_tokens`` label tokens, each under activation checkpointing: a chunk's
logits exist only while that chunk runs (forward, and again in its backward).  Only tokens with a
label (!= -100) go through the head at all, which also skips the last token of every sequence.
The sum of token losses is divided by the step's *global* label-token count, so every split,
packing, pipeline and DP replica adds up to the unsplit model's mean token loss.  Half-precision
logits are upcast to float32 for the softmax, as HF's loss does; float64 stays float64.

Label smoothing is ``cross_entropy(label_smoothing=x)`` per token, which is exactly HF's
``LabelSmoother`` term by term: ``(1 - x) * nll + x * mean over the vocabulary of -log p``; summed
and divided by the same global label count, it stays exact under every split.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def _chunk_ce_sum(lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                  label_smoothing: float = 0.0) -> torch.Tensor:
    logits = lm_head(hidden)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits, labels, reduction="sum", label_smoothing=label_smoothing)


def chunked_lm_loss(lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                    label_token_count: int, loss_chunk_tokens: int = 4096,
                    label_smoothing: float = 0.0, label_index: torch.Tensor | None = None) -> torch.Tensor:
    """Sum of token cross-entropies over ``labels != -100``, divided by ``label_token_count``.

    ``hidden`` is the final-normed ``[1, T, H]``; ``labels`` ``[1, T]`` are already shifted.
    ``label_smoothing`` as in ``torch.nn.functional.cross_entropy`` (and HF's ``LabelSmoother``).
    ``label_index``: the flat positions of ``labels != -100`` if known (found on the host, they
    spare the device synchronisation of ``nonzero``).
    """
    if label_token_count < 1:
        raise ValueError(f"label_token_count must be >= 1 (the step's global number of label tokens), "
                         f"got {label_token_count}; is every label -100?")
    if loss_chunk_tokens < 1:
        raise ValueError(f"loss_chunk_tokens must be >= 1, got {loss_chunk_tokens}")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).to(h.device)
    idx = (y != -100).nonzero(as_tuple=True)[0] if label_index is None else label_index.to(h.device)
    if idx.numel() == 0:
        # Keep the graph connected so backward still returns a (zero) gradient upstream.
        return h.sum() * 0.0
    h, y = h.index_select(0, idx), y.index_select(0, idx)
    total = None
    grad = torch.is_grad_enabled()
    for a in range(0, h.shape[0], loss_chunk_tokens):
        hc, yc = h[a:a + loss_chunk_tokens], y[a:a + loss_chunk_tokens]
        part = (checkpoint(_chunk_ce_sum, lm_head, hc, yc, label_smoothing, use_reentrant=False) if grad
                else _chunk_ce_sum(lm_head, hc, yc, label_smoothing))
        total = part if total is None else total + part
    return total / label_token_count
