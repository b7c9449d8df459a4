"""``TokenBudgetBatchSampler``: pieces packed into global batches of at most ``tokens_per_step``.

Best-fit decreasing keeps batches full and puts every token of an epoch in exactly one batch.
Each epoch (``set_epoch``) reshuffles with ``seed + epoch``: ties between equally long pieces are
broken randomly and the batch order is shuffled.  Every rank builds the same batches: the pipeline
plans the whole global batch and assigns sequences to DP replicas itself.

Trade-off: the packer looks only at lengths, so the *number* of batches is the same every epoch
(HF's Trainer computes steps per epoch once, and exact resume relies on it), at the price of batch
composition varying across epochs only among pieces of equal length.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.utils.data import Sampler

from infinipipe_hf.planner.batch.packing import best_fit_decreasing


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Yields lists of piece indices, each list one global batch of <= ``tokens_per_step`` tokens."""

    def __init__(self, piece_lengths: Sequence[int], tokens_per_step: int, *, seed: int = 0,
                 shuffle: bool = True) -> None:
        if tokens_per_step < 2:
            raise ValueError(f"tokens_per_step must be >= 2, got {tokens_per_step}")
        too_long = [i for i, n in enumerate(piece_lengths) if n > tokens_per_step]
        if too_long:
            raise ValueError(f"piece {too_long[0]} has {piece_lengths[too_long[0]]} tokens, more than "
                             f"tokens_per_step={tokens_per_step}; split documents with split_documents")
        self.piece_lengths = [int(n) for n in piece_lengths]
        self.tokens_per_step = int(tokens_per_step)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.epoch = 0
        # Bin count is independent of the tie order, so it is computed once.
        self._num_batches = len(best_fit_decreasing(self.piece_lengths, range(len(self.piece_lengths)),
                                                    self.tokens_per_step))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def batches(self, epoch: int | None = None) -> list[list[int]]:
        """The batches of ``epoch`` (default: the current one), in the order they are yielded."""
        epoch = self.epoch if epoch is None else epoch
        n = len(self.piece_lengths)
        if not self.shuffle:
            bins = best_fit_decreasing(self.piece_lengths, range(n), self.tokens_per_step)
            return [sorted(b) for b in bins]
        g = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(n, generator=g).tolist()
        bins = best_fit_decreasing(self.piece_lengths, order, self.tokens_per_step)
        assert len(bins) == self._num_batches
        perm = torch.randperm(len(bins), generator=g).tolist()
        return [bins[i] for i in perm]

    def __iter__(self):
        return iter(self.batches())

    def __len__(self) -> int:
        return self._num_batches
