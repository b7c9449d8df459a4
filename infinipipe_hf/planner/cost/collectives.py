"""Time of the collectives a parallel layout runs, in the alpha-beta (latency-bandwidth) model.

Every function prices one collective over ``group_size`` ranks, each rank's link carrying
``bandwidth_bytes_per_s`` per direction (the figure NCCL's tests call *bus bandwidth*), with a
fixed ``latency_s`` per algorithm step.  ``nbytes`` is stated per function: the size of the
*whole* tensor for all-gather / reduce-scatter / all-reduce, and the size of one rank's buffer
for all-to-all (what each rank holds before and after).

- ring all-gather, ring reduce-scatter: ``g - 1`` steps, each moving ``nbytes / g``:
  ``(g - 1) * latency + (g - 1) / g * nbytes / bandwidth``.
- ring all-reduce = reduce-scatter + all-gather: twice that.
- pairwise all-to-all: ``g - 1`` exchange rounds, each rank sending ``1 / g`` of its buffer to
  each peer: ``(g - 1) * latency + (g - 1) / g * nbytes / bandwidth``.  When the group spans
  nodes, the share that crosses nodes goes at the inter-node bandwidth and the rest at the
  intra-node one, concurrently (:func:`all_to_all_time_two_level`).

A group of one rank costs nothing.  Trade-off: no contention between concurrent collectives, no
protocol switch for small messages (NCCL's LL/LL128 have lower latency than ``latency_s`` per
step suggests), and ring rather than tree or NVLS algorithms, so large collectives are priced at
the bus bandwidth and small ones somewhat pessimistically.  Pure Python, no torch.
"""
from __future__ import annotations

import math


def _check(nbytes: float, group_size: int, bandwidth_bytes_per_s: float, latency_s: float) -> None:
    if int(group_size) != group_size or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    if not nbytes >= 0 or math.isinf(nbytes):
        raise ValueError(f"nbytes must be a finite number >= 0, got {nbytes!r}")
    if not bandwidth_bytes_per_s > 0:
        raise ValueError(f"bandwidth_bytes_per_s must be > 0, got {bandwidth_bytes_per_s!r}")
    if not latency_s >= 0:
        raise ValueError(f"latency_s must be >= 0, got {latency_s!r}")


def _ring(nbytes: float, group_size: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    _check(nbytes, group_size, bandwidth_bytes_per_s, latency_s)
    if group_size == 1:
        return 0.0
    g = group_size
    return (g - 1) * latency_s + (g - 1) / g * nbytes / bandwidth_bytes_per_s


def all_gather_time(nbytes: float, group_size: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Ring all-gather producing a ``nbytes`` tensor on every rank (each contributes ``nbytes / g``)."""
    return _ring(nbytes, group_size, bandwidth_bytes_per_s, latency_s)


def reduce_scatter_time(nbytes: float, group_size: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Ring reduce-scatter of a ``nbytes`` tensor held by every rank (each keeps ``nbytes / g``)."""
    return _ring(nbytes, group_size, bandwidth_bytes_per_s, latency_s)


def all_reduce_time(nbytes: float, group_size: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Ring all-reduce of a ``nbytes`` tensor: a reduce-scatter followed by an all-gather."""
    return 2.0 * _ring(nbytes, group_size, bandwidth_bytes_per_s, latency_s)


def all_to_all_time(nbytes: float, group_size: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Pairwise all-to-all where every rank holds ``nbytes`` before and after (keeps ``1 / g``)."""
    return _ring(nbytes, group_size, bandwidth_bytes_per_s, latency_s)


def all_to_all_time_two_level(nbytes: float, group_size: int, ranks_per_node: int,
                              intra_bandwidth_bytes_per_s: float, inter_bandwidth_bytes_per_s: float,
                              latency_s: float) -> float:
    """:func:`all_to_all_time` for a group of ``group_size`` ranks spread ``ranks_per_node`` per node.

    Each rank sends ``(ranks_per_node - 1) / g`` of its buffer to peers on its node and
    ``(g - ranks_per_node) / g`` to other nodes; both go at once, so the slower share decides.
    ``ranks_per_node >= group_size`` is the one-node case.
    """
    _check(nbytes, group_size, intra_bandwidth_bytes_per_s, latency_s)
    _check(nbytes, group_size, inter_bandwidth_bytes_per_s, latency_s)
    if int(ranks_per_node) != ranks_per_node or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
    g = group_size
    if g == 1:
        return 0.0
    local = min(int(ranks_per_node), g)
    intra = (local - 1) / g * nbytes / intra_bandwidth_bytes_per_s
    inter = (g - local) / g * nbytes / inter_bandwidth_bytes_per_s
    return (g - 1) * latency_s + max(intra, inter)
