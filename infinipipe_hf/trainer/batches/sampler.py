"""``TokenBudgetBatchSampler``: pieces packed into global batches of ``tokens_per_step`` tokens.

``tokens_per_step`` is the budget of one global batch, all DP replicas together; each of the
``dp_degree`` replicas gets an even share (``tokens_per_step // dp_degree``).  Pieces are packed
best-fit decreasing into *replica batches* of at most one share; a piece longer than a share (up
to ``tokens_per_step``, the piece limit) is a replica batch on its own: one replica's work, never
split across replicas.  A step takes ``dp_degree`` replica batches of similar size, so every
replica has its own sequences and the replicas finish together; a step holding pieces longer than
a share therefore carries more than ``tokens_per_step`` tokens (at most ``dp_degree`` times it).
The pipeline's planner then deals the step's sequences to the replicas by cost.

Every token of an epoch is in exactly one batch; each epoch (``set_epoch``) reshuffles with
``seed + epoch`` (ties between equally long pieces broken randomly, the step order shuffled).
Every rank builds the same batches.  When the replica batches do not fill the last step, its
pieces are dealt over all replicas, or, fewer pieces than replicas, join the step before; only a
dataset with fewer pieces than replicas leaves a replica idle (warned).

Trade-off: the packer looks only at lengths, so the *number* of batches is the same every epoch
(HF's Trainer computes steps per epoch once, and exact resume relies on it), at the price of batch
composition varying across epochs only among pieces of equal length.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.utils.data import Sampler

from infinipipe_hf.planner.batch.packing import best_fit_decreasing
from infinipipe_hf.trainer import notices


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Yields lists of piece indices, each list one global batch (module docstring)."""

    def __init__(self, piece_lengths: Sequence[int], tokens_per_step: int, *, dp_degree: int = 1,
                 seed: int = 0, shuffle: bool = True, what: str = "the dataset") -> None:
        if tokens_per_step < 2:
            raise ValueError(f"tokens_per_step must be >= 2, got {tokens_per_step}")
        if isinstance(dp_degree, bool) or int(dp_degree) != dp_degree or dp_degree < 1:
            raise ValueError(f"dp_degree must be a positive integer, got {dp_degree!r}")
        if tokens_per_step // dp_degree < 2:
            raise ValueError(f"tokens_per_step={tokens_per_step} gives each of the dp_degree={dp_degree} replicas "
                             f"{tokens_per_step // dp_degree} token(s); raise tokens_per_step to at least "
                             f"{2 * dp_degree}")
        too_long = [i for i, n in enumerate(piece_lengths) if n > tokens_per_step]
        if too_long:
            raise ValueError(f"piece {too_long[0]} has {piece_lengths[too_long[0]]} tokens, more than "
                             f"tokens_per_step={tokens_per_step}; split documents with split_documents")
        self.piece_lengths = [int(n) for n in piece_lengths]
        self.tokens_per_step = int(tokens_per_step)
        self.dp_degree = int(dp_degree)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.epoch = 0
        # The count does not depend on the tie order, so it is computed once.
        self._num_batches = len(self._steps(list(range(len(self.piece_lengths)))))
        if 0 < len(self.piece_lengths) < self.dp_degree:
            notices.warn(f"{what} has {len(self.piece_lengths)} piece(s) for dp_degree={self.dp_degree} replicas: "
                         f"{self.dp_degree - len(self.piece_lengths)} replica(s) idle every step; add documents "
                         f"or lower dp_degree")

    @property
    def replica_share(self) -> int:
        """Tokens of one replica batch (a longer piece fills one alone)."""
        return self.tokens_per_step // self.dp_degree

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def batches(self, epoch: int | None = None) -> list[list[int]]:
        """The batches of ``epoch`` (default: the current one), in the order they are yielded."""
        epoch = self.epoch if epoch is None else epoch
        n = len(self.piece_lengths)
        if not self.shuffle:
            return [sorted(b) for b in self._steps(list(range(n)))]
        g = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(n, generator=g).tolist()
        steps = self._steps(order)
        assert len(steps) == self._num_batches
        perm = torch.randperm(len(steps), generator=g).tolist()
        return [steps[i] for i in perm]

    def _steps(self, order: list[int]) -> list[list[int]]:
        """Global batches (piece ids), ties between equal lengths broken by ``order``."""
        if self.dp_degree == 1:
            return best_fit_decreasing(self.piece_lengths, order, self.tokens_per_step)
        lengths, share = self.piece_lengths, self.replica_share
        long_ids = [i for i in order if lengths[i] > share]
        replica_batches = [[i] for i in long_ids]
        short = [i for i in order if lengths[i] <= share]
        replica_batches += best_fit_decreasing(lengths, short, share) if short else []
        rank = {item: pos for pos, item in enumerate(order)}
        # Largest first, so a step's replicas hold similar work; (tokens, pieces) profiles do not
        # depend on the tie order, so neither does the step count.
        replica_batches.sort(key=lambda b: (-sum(lengths[i] for i in b), -len(b), rank[b[0]]))
        return group_replica_batches(replica_batches, lengths, self.dp_degree)

    def __iter__(self):
        return iter(self.batches())

    def __len__(self) -> int:
        return self._num_batches


def group_replica_batches(replica_batches: list[list[int]], lengths: Sequence[int], dp_degree: int) -> list[list[int]]:
    """Consecutive groups of ``dp_degree`` replica batches, each flattened into one global batch.

    A last group of fewer replica batches is redealt (its pieces, longest first, each to the
    replica batch with the fewest tokens) when it has a piece per replica, else joins the group
    before it; a single group keeps what it has.
    """
    groups = [replica_batches[k:k + dp_degree] for k in range(0, len(replica_batches), dp_degree)]
    if groups and len(groups[-1]) < dp_degree:
        pieces = sorted((i for b in groups[-1] for i in b), key=lambda i: -lengths[i])
        if len(pieces) >= dp_degree:
            dealt: list[list[int]] = [[] for _ in range(dp_degree)]
            for i in pieces:
                min(dealt, key=lambda b: (sum(lengths[j] for j in b), len(b))).append(i)
            groups[-1] = dealt
        elif len(groups) > 1:
            groups[-2] = groups[-2] + [pieces]
            groups.pop()
    return [[i for b in group for i in b] for group in groups]
