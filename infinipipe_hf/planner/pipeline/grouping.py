"""Pipeline grouping: split a step's ordered units into consecutive 1F1B pipelines (docs/algorithms.md).

Design: the units arrive as consecutive *blocks* (one per slice count, longest first).  Every
pipeline pays a fill/drain bubble, so fewer pipelines are cheaper in bubbles, but one long
pipeline holds more units in flight and may force recompute; the caller's ``pipeline_time``
prices a candidate pipeline (typically by building and simulating it), and a dynamic program over
block boundaries picks the contiguous partition with the least total time:
``best[j] = min_i best[i] + time(blocks i..j-1)``.

Trade-off: only contiguous unions of blocks are considered (G(G+1)/2 candidate pipelines for G
blocks, each priced once and cached), which keeps the longest-first order that 1F1B needs and
the search quadratic instead of exponential in the number of blocks.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from infinipipe_hf.ir.units import Unit

MAX_GROUPING_BLOCKS = 24
"""Most blocks the grouping DP sees; more are merged (smallest neighbours first)."""


def group_pipelines(groups: Sequence[Sequence[int]],
                    pipeline_time: Callable[[Sequence[int]], float]) -> list[list[int]]:
    """Contiguous unions of ``groups`` (one list of unit ids per pipeline) minimising total time."""
    blocks = [list(g) for g in groups]
    if not blocks:
        return []
    if any(not b for b in blocks):
        raise ValueError(f"group_pipelines got an empty block among {len(blocks)} blocks; drop empty "
                         f"slice-count groups before grouping")
    g = len(blocks)
    cache: dict[tuple[int, int], float] = {}

    def cost(i: int, j: int) -> float:
        if (i, j) not in cache:
            ids = [uid for b in blocks[i:j] for uid in b]
            t = float(pipeline_time(ids))
            if math.isnan(t):
                raise ValueError(f"pipeline_time returned NaN for units {ids[:8]}...; return a time in "
                                 f"seconds (math.inf for an infeasible pipeline)")
            cache[(i, j)] = t
        return cache[(i, j)]

    best = [0.0] + [math.inf] * g
    cut = [0] * (g + 1)
    for j in range(1, g + 1):
        # Strict '<' with i rising keeps the longest last pipeline on ties (fewer pipelines), and
        # cut[j] = 0 (one pipeline) when every option is infeasible (inf).
        for i in range(j):
            t = best[i] + cost(i, j)
            if t < best[j]:
                best[j], cut[j] = t, i
    groups_out: list[list[int]] = []
    j = g
    while j > 0:
        i = cut[j]
        groups_out.append([uid for b in blocks[i:j] for uid in b])
        j = i
    groups_out.reverse()
    return groups_out


def blocks_by_slice_count(units: Sequence[Unit], slice_counts: dict[int, int]) -> list[list[int]]:
    """Grouping blocks: one per slice chain of a long sequence, one per run of packed units.

    A chain never straddles two pipelines; separate blocks per chain let the grouping DP put a
    pipeline boundary between two long sequences (their K/V stores then never coexist).
    """
    blocks: list[list[int]] = []
    last_is_chain = False
    for u in units:
        count = max(slice_counts.get(s.seq, 1) for s in u.segments)
        continues_chain = any(s.start > 0 for s in u.segments)
        starts_chain = count > 1 and not continues_chain
        if not blocks or starts_chain or (count == 1 and last_is_chain):
            blocks.append([u.id])
            last_is_chain = starts_chain
        else:
            blocks[-1].append(u.id)
    return blocks


def merge_blocks(blocks: list[list[int]], limit: int) -> list[list[int]]:
    """Merge neighbouring blocks (smallest first) until at most ``limit`` remain."""
    blocks = [list(b) for b in blocks]
    while len(blocks) > limit:
        i = min(range(len(blocks) - 1), key=lambda j: len(blocks[j]) + len(blocks[j + 1]))
        blocks[i:i + 2] = [blocks[i] + blocks[i + 1]]
    return blocks
