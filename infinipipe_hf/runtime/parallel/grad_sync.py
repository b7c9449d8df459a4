"""Gradient collectives of one step: tied-embedding sum, the DP x SP all-reduce, the global norm.

Design: each rank's backward leaves the gradient of *its* share of the step (its replica's
units, its SP rank's tokens) in ``.grad``; the step's gradient is their sum.  ``sync`` therefore
(1) sums the tied embedding / LM-head gradients of the first and last stage of each replica and
SP rank, then (2) all-reduces every gradient over the stage's ranks of all replicas and SP ranks
(``layout.grad_group``), once per step, in flat buckets.  Afterwards every rank of a stage holds
the full gradient.  ``global_norm`` sums squared gradients over one replica's stages (the
others hold identical copies) with the tied weight counted once, as the unsplit model counts it.
``global_sum`` adds a scalar over the world (the loss parts of the last stages).

Sharded stages (``StageSharding``): FSDP2 reduce-scatters the accumulated gradients into each
rank's shard first (and all-reduces over DP under ``"hybrid"``), all at the end or, for a plan
with ``grad_reduce="unit"``, most of it already after each backward (only the shard group's own
reduce-scatters move: the local shards then hold the same sums); then the tied pair sums its local
shards (both ends are sharded alike over groups of the same size, so shard i meets shard i) and
the ranks FSDP did not cover (``sharding.extra_group``) sum theirs.  The norm adds local shard
squares over the world, each piece of the model counted once (``holds_distinct_shard``).

Trade-off: the all-reduce runs after the last backward rather than overlapping with the
cool-down (simple, exact, one bucketed collective per stage); bucketing bounds the extra memory
of flattening to ``_BUCKET_ELEMENTS`` elements.  Every wait has a deadline naming the ranks.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from infinipipe_hf.runtime.parallel.comm import wait_collective
from infinipipe_hf.runtime.parallel.fsdp_api import local_tensor
from infinipipe_hf.runtime.parallel.mesh import ParallelLayout

_BUCKET_ELEMENTS = 1 << 25


def _dist():
    import torch.distributed as dist

    return dist


class GradientSync:
    """The step's gradient collectives for one rank (see the module docstring)."""

    def __init__(self, layout: ParallelLayout, device: torch.device, timeout_s: float,
                 trainable: Callable[[], list[torch.nn.Parameter]],
                 tied: Callable[[], list[torch.nn.Parameter]], sharding=None) -> None:
        self.layout = layout
        self.device = device
        self.timeout_s = timeout_s
        self._trainable = trainable
        self._tied = tied
        self.sharding = sharding
        """``StageSharding`` when the stage's states are sharded, else ``None``."""

    def _wait(self, work, ranks: list[int], what: str, step: int, group=None) -> None:
        wait_collective(work, timeout_s=self.timeout_s, layout=self.layout, ranks=ranks, what=what,
                        step=step, group=group)

    def all_reduce(self, tensors: list[torch.Tensor], group, ranks: list[int], what: str,
                   step: int) -> None:
        """Sum ``tensors`` in place over ``group``, in flat buckets."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        start = 0
        while start < len(tensors):
            end, size = start, 0
            while end < len(tensors) and (end == start or size + tensors[end].numel() <= _BUCKET_ELEMENTS):
                size += tensors[end].numel()
                end += 1
            bucket = tensors[start:end]
            flat = _flatten_dense_tensors(bucket)
            self._wait(_dist().all_reduce(flat, group=group, async_op=True), ranks, what, step, group)
            for t, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                t.copy_(reduced)
            start = end

    def sync(self, step: int) -> None:
        """Tied-embedding sum, then the all-reduce over the stage's DP x SP ranks."""
        lay = self.layout
        if self.sharding is not None:  # also alone (state_offload='states' on one rank)
            self.sharding.reduce_gradients()
        if lay.world_size == 1:
            return
        params = self._trainable()
        for p in params:  # every rank of a group must reduce the same tensors
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        tied = self._tied()
        if tied:
            pair = [lay.global_rank(lay.dp_rank, 0), lay.global_rank(lay.dp_rank, lay.pp_degree - 1)]
            self.all_reduce([local_tensor(p.grad) for p in tied], lay.tied_group, pair,
                            "tied-embedding gradient sum", step)
        if self.sharding is not None:
            if self.sharding.extra_group is not None:
                self.all_reduce([local_tensor(p.grad) for p in params], self.sharding.extra_group,
                                self.sharding.extra_ranks, "gradient sum of ranks holding one shard",
                                step)
            return
        if lay.dp_degree * lay.sp_degree > 1:
            self.all_reduce([p.grad for p in params], lay.grad_group,
                            lay.grad_ranks_of_stage(lay.stage_index),
                            "data/sequence-parallel gradient all-reduce", step)

    def global_norm(self, step: int) -> float:
        """L2 norm of the whole model's gradient (every stage, the tied weight once)."""
        lay = self.layout
        skip = {id(p) for p in self._tied()} if lay.is_last_stage else set()
        squares: dict[torch.device, list[torch.Tensor]] = {}  # one device sync per device, not per tensor
        for p in self._trainable():
            if p.grad is not None and id(p) not in skip:
                g = local_tensor(p.grad).detach()
                squares.setdefault(g.device, []).append(g.double().pow(2).sum())
        local = sum(float(torch.stack(v).sum()) for v in squares.values())
        if self.sharding is not None:
            # Shards are spread over the shard group (and copies over the other groups): sum
            # over the world, each piece once.
            t = torch.tensor([local if self.sharding.holds_distinct_shard else 0.0],
                             dtype=torch.float64, device=self.device)
            self._wait(_dist().all_reduce(t, async_op=True), list(range(lay.world_size)),
                       "gradient-norm sum", step)
            return math.sqrt(float(t.item()))
        if lay.pp_degree > 1:
            # After the all-reduce every replica and SP rank holds the same gradients: one
            # replica's stages (with this SP rank) are enough.
            t = torch.tensor([local], dtype=torch.float64, device=self.device)
            self._wait(_dist().all_reduce(t, group=lay.pp_group, async_op=True),
                       lay.pp_ranks_of_replica(lay.dp_rank), "gradient-norm sum", step, lay.pp_group)
            local = float(t.item())
        return math.sqrt(local)

    def global_sum(self, value: float, what: str, step: int) -> float:
        """``value`` summed over every rank."""
        if self.layout.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        self._wait(_dist().all_reduce(t, async_op=True), list(range(self.layout.world_size)), what, step)
        return float(t.item())
