"""Chunked LM head + cross-entropy on the last stage.

Design: logits of a long unit would dominate memory (T x vocab), so the head and the loss run in
chunks of ``loss_chunk_tokens`` label tokens, each under activation checkpointing: a chunk's
logits exist only while that chunk runs (forward, and again in its backward).  Only tokens with a
label (!= -100) go through the head at all, which also skips the last token of every sequence.
The sum of token losses is divided by the step's *global* label-token count, so every split,
packing, pipeline and DP replica adds up to the unsplit model's mean token loss.

The cross-entropy on a chunk's logits is fused (:class:`LogitsCrossEntropySum`): its forward
reads the logits ``LOSS_BLOCK_ROWS`` rows at a time (half precision upcast to float32 a block at a
time, as HF's loss upcasts; float64 stays float64) and its backward turns the logits, in place,
into their gradient ``softmax - target`` (the softmax from the forward's log-sum-exp, which the
checkpoint's recompute gives the backward), so a chunk holds its logits once plus one float32 block,
not the logits, their log-softmax and two gradients autograd's ``cross_entropy`` holds.

Label smoothing is ``cross_entropy(label_smoothing=x)`` per token, which is exactly HF's
``LabelSmoother`` term by term: ``(1 - x) * nll + x * mean over the vocabulary of -log p``; summed
and divided by the same global label count, it stays exact under every split.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

LOSS_BLOCK_ROWS = 1024
"""Rows of a chunk's logits the fused cross-entropy works on at a time (one float32 block)."""


_HALF = (torch.float16, torch.bfloat16)


def _block_loss_sum(z: torch.Tensor, labels: torch.Tensor, label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The cross-entropy sum of one block of logits and its rows' log-sum-exp, through one float32
    (or float64) copy of the block."""
    work = z.float() if z.dtype in _HALF else z.clone()
    target = work.gather(1, labels[:, None]).squeeze(1)
    mean = work.mean(-1) if label_smoothing else None
    top = work.amax(-1)
    lse = work.sub_(top[:, None]).exp_().sum(-1).log_() + top
    if label_smoothing:
        return ((1 - label_smoothing) * (lse - target) + label_smoothing * (lse - mean)).sum(), lse
    return (lse - target).sum(), lse


def _block_gradient_(z: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor, label_smoothing: float,
                     scale: torch.Tensor) -> None:
    """Overwrite one block of logits with ``scale * (softmax - target)``, the gradient of
    :func:`_block_loss_sum`, the softmax from the forward's log-sum-exp ``lse`` (half precision
    through one float32 copy of the block)."""
    p = z.float() if z.dtype in _HALF else z
    p.sub_(lse[:, None]).exp_()
    if label_smoothing:
        p.sub_(label_smoothing / p.shape[-1])
    p.scatter_add_(1, labels[:, None], torch.full((p.shape[0], 1), label_smoothing - 1.0, dtype=p.dtype,
                                                   device=p.device))
    p.mul_(scale.to(p.dtype))
    if p is not z:
        z.copy_(p)


class LogitsCrossEntropySum(torch.autograd.Function):
    """``cross_entropy(logits, labels, reduction="sum", label_smoothing=x)``, with a backward that
    overwrites the saved logits with their gradient (nothing else may need them: the LM head's
    backward reads its input and weight, not its output)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float) -> torch.Tensor:
        parts = [_block_loss_sum(logits[a:a + LOSS_BLOCK_ROWS], labels[a:a + LOSS_BLOCK_ROWS], label_smoothing)
                 for a in range(0, logits.shape[0], LOSS_BLOCK_ROWS)]
        ctx.save_for_backward(logits, labels, torch.cat([lse for _, lse in parts]))
        ctx.label_smoothing = label_smoothing
        return sum(total for total, _ in parts)

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        for a in range(0, logits.shape[0], LOSS_BLOCK_ROWS):
            rows = slice(a, a + LOSS_BLOCK_ROWS)
            _block_gradient_(logits[rows], lse[rows], labels[rows], ctx.label_smoothing, grad_total)
        return logits, None, None


def _chunk_ce_sum(lm_head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
                  label_smoothing: float = 0.0) -> torch.Tensor:
    return LogitsCrossEntropySum.apply(lm_head(hidden), labels, label_smoothing)


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
