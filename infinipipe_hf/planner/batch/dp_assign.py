"""Assign a global batch's sequences to data-parallel replicas so their step times balance.

Design: greedy LPT (longest processing time first).  A sequence's cost is its per-layer
forward+backward time without the per-unit constant, ``a1 s^2 + a2 s``: attention makes a long
sequence dearer per token, so balancing tokens alone would overload the replica holding the
longest document.  Sequences go, longest first (ties by seq id), to the replica with the least
load so far (ties by replica index): deterministic, so every rank computes the same assignment.

A batch of fewer sequences than replicas leaves the last replicas without work (idle: they run
no action and contribute zero gradients to the step's all-reduce): planning never fails on it.
The trainer's sampler gives every replica its own sequences whenever the data has enough of them,
and the layout search rules such layouts out; :func:`idle_replicas` counts them for messages.

Trade-off: LPT is within 4/3 of the optimal makespan and runs in O(n log n); the per-unit
constant and the pipeline's bubbles are ignored here (they depend on the units the sequence
processor makes later), which is a second-order error for batches of many sequences.
"""
from __future__ import annotations

import heapq
from typing import Sequence

from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.batch.layer_time import LayerTime
from infinipipe_hf.planner.batch.select import select_sequences
from infinipipe_hf.planner.cost.model import CostModel


def sequence_cost(length: int, lt: LayerTime) -> float:
    """Per-layer forward+backward seconds of one whole sequence, without the per-unit constant."""
    return lt.a1 * float(length) * length + lt.a2 * length


def assign_sequences(lengths: Sequence[int], dp_degree: int, cost: CostModel) -> list[list[int]]:
    """Sequence ids per DP replica; every sequence exactly once, each list longest first (a
    replica beyond the batch's sequence count gets an empty list)."""
    if int(dp_degree) != dp_degree or dp_degree < 1:
        raise ValueError(f"dp_degree must be a positive integer, got {dp_degree!r}")
    chosen = select_sequences(lengths, None)
    lt = LayerTime.of(cost)
    order = sorted(chosen, key=lambda s: (-int(lengths[s]), s))
    heap = [(0.0, r) for r in range(dp_degree)]  # (load, replica): ties go to the lower replica
    replicas: list[list[int]] = [[] for _ in range(dp_degree)]
    for s in order:
        load, r = heapq.heappop(heap)
        replicas[r].append(s)
        heapq.heappush(heap, (load + sequence_cost(int(lengths[s]), lt), r))
    # Appended in global longest-first order, so each list is already longest first.
    return replicas


def idle_replicas(num_sequences: int, dims: ParallelDims) -> int:
    """DP replicas of ``dims`` a batch of ``num_sequences`` sequences leaves without work."""
    return max(dims.dp_degree - int(num_sequences), 0)


def replica_loads(lengths: Sequence[int], replicas: Sequence[Sequence[int]], cost: CostModel) -> list[float]:
    """Estimated per-layer seconds of each replica's sequences (for reports and tests)."""
    lt = LayerTime.of(cost)
    return [sum(sequence_cost(int(lengths[s]), lt) for s in seqs) for seqs in replicas]
