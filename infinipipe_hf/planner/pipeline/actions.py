"""Per-stage action lists of one pipeline: warm-up, one-forward-one-backward, cool-down (docs/algorithms.md).

Design: a pipeline is two orders -- the forward order of its units and their backward order --
plus a warm-up count per stage (one entry per stage: the warm-up list is the stage count).
Stage ``r`` runs ``warmup[r]`` forwards, then alternates one
forward / one backward (as Megatron's 1F1B: the last stage, warm-up 0, runs ``F0 B0 F1 B1``),
then drains the remaining backwards.  Slices of one long sequence must run
backward last slice first (the K/V gradients of later slices flow into earlier ones), so
:func:`backward_order` derives that order from the segments, and :func:`build_pipeline_actions`
never emits a backward whose unit has not been forwarded on the stage yet: it takes the next
forward instead.  Because the backward order already puts later slices first, "forwarded before
backward" on every stage is exactly the slice-order rule.

Trade-off: the delay rule targets ``max(warmup + k + 1, forwards needed by the k-th backward)`` forwards
before the k-th backward instead of accumulating delays.  It keeps the in-flight window (memory)
as small as the orders allow, and since that target never grows from stage ``r`` to ``r + 1``
when the warm-ups are non-increasing, no stage waits on a forward that the previous stage has not
scheduled yet: the schedule is deadlock-free by construction (tested by replaying it).
"""
from __future__ import annotations

import heapq
from dataclasses import replace
from typing import Callable, Sequence

from infinipipe_hf.ir.actions import Action, B, F
from infinipipe_hf.ir.units import Unit
from infinipipe_hf.layout import ParallelDims


def backward_order(units: Sequence[Unit], lengths: Sequence[int]) -> list[int]:
    """Unit ids in backward order for ``units`` given in forward order.

    Forward order, except that a unit holding a later segment of a sequence runs backward before
    the unit holding the earlier segment; among units free to go, the one forwarded first goes first
    (FIFO).  For EPP's consecutive chains of slices (the last possibly a hybrid unit) this reverses
    each chain and keeps everything else in forward order.
    """
    pos = {u.id: i for i, u in enumerate(units)}
    if len(pos) != len(units):
        raise ValueError(f"backward_order got duplicate unit ids {[u.id for u in units]}; give each unit once")
    by_seq: dict[int, list[tuple[int, int]]] = {}
    for u in units:
        for s in u.segments:
            if not 0 <= s.seq < len(lengths) or s.end > lengths[s.seq]:
                raise ValueError(f"unit {u.id} has segment {s} outside the batch's sequence lengths "
                                 f"({len(lengths)} sequences); build units from the same lengths")
            by_seq.setdefault(s.seq, []).append((s.start, u.id))
    # blockers[u]: units whose backward must precede u's; unblocks[v]: units waiting on v.
    blockers: dict[int, set[int]] = {u.id: set() for u in units}
    unblocks: dict[int, list[int]] = {u.id: [] for u in units}
    for seq in sorted(by_seq):
        chain = sorted(by_seq[seq])
        for (_, earlier), (_, later) in zip(chain, chain[1:]):
            if earlier != later and later not in blockers[earlier]:
                blockers[earlier].add(later)
                unblocks[later].append(earlier)
    ready = [(pos[uid], uid) for uid, b in blockers.items() if not b]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        _, uid = heapq.heappop(ready)
        order.append(uid)
        for waiting in unblocks[uid]:
            blockers[waiting].discard(uid)
            if not blockers[waiting]:
                heapq.heappush(ready, (pos[waiting], waiting))
    if len(order) != len(units):
        stuck = sorted(uid for uid, b in blockers.items() if b)
        raise ValueError(f"units {stuck} hold segments of several sequences in crossing orders, so no "
                         f"backward order lets later slices run first; keep each sequence's slices in "
                         f"units ordered by start")
    return order


def build_pipeline_actions(forward_order: Sequence[int], backward_order: Sequence[int],
                           warmup: Sequence[int]) -> list[list[Action]]:
    """Action lists of one pipeline, one list per stage of ``warmup`` (see the module docstring)."""
    fwd = list(forward_order)
    bwd = list(backward_order)
    n = len(fwd)
    if len(set(fwd)) != n or sorted(fwd) != sorted(bwd):
        raise ValueError(f"forward order {fwd} and backward order {bwd} must hold the same unit ids once each")
    if not warmup or any(w < 0 for w in warmup):
        raise ValueError(f"warmup must give a non-negative forward count for each stage (one stage or more), "
                         f"got {list(warmup)}")
    capped = [min(int(w), n) for w in warmup]
    if any(a < b for a, b in zip(capped, capped[1:])):
        raise ValueError(f"warmup {list(warmup)} grows from one stage to the next, so a stage would wait "
                         f"for forwards its predecessor has not run (deadlock); use non-increasing "
                         f"counts such as one_f_one_b_warmup's {list(range(len(warmup) - 1, -1, -1))}")
    fpos = {uid: i for i, uid in enumerate(fwd)}
    # need[k]: forwards that must have run before the k-th backward (its unit and all before it).
    need: list[int] = []
    so_far = 0
    for uid in bwd:
        so_far = max(so_far, fpos[uid] + 1)
        need.append(so_far)
    stages: list[list[Action]] = []
    for w in capped:
        acts: list[Action] = []
        done = 0
        for k, uid in enumerate(bwd):
            target = min(n, max(w + k + 1, need[k]))
            while done < target:
                acts.append(F(fwd[done]))
                done += 1
            acts.append(B(uid))
        assert done == n, (done, n)
        stages.append(acts)
    return stages


# Warm-up counts per stage; each pipeline schedule picks its own (``PipelineSchedule.warmup``).
def epp_warmup(dims: ParallelDims, first_num_slices: int) -> list[int]:
    """EPP warm-up: ``(pp_degree - 1 - r) + (first_num_slices - 1)`` forwards on stage ``r``.

    The extra ``first_num_slices - 1`` forwards let the first sequence's last slice reach the stage
    before its backward, which has to run first.
    """
    if first_num_slices < 1:
        raise ValueError(f"epp_warmup needs first_num_slices >= 1, got {first_num_slices}")
    return [w + first_num_slices - 1 for w in one_f_one_b_warmup(dims)]


def one_f_one_b_warmup(dims: ParallelDims) -> list[int]:
    """Classic 1F1B warm-up: ``pp_degree - 1 - r`` forwards on stage ``r``."""
    return [dims.pp_degree - 1 - r for r in range(dims.pp_degree)]


def gpipe_warmup(dims: ParallelDims, num_units: int) -> list[int]:
    """GPipe: every stage runs all forwards before any backward."""
    if num_units < 0:
        raise ValueError(f"gpipe_warmup needs num_units >= 0, got {num_units}")
    return [num_units] * dims.pp_degree


def concat_pipelines(per_pipeline: Sequence[list[list[Action]]]) -> list[list[Action]]:
    """Stage action lists of pipelines that run one after another on every stage."""
    if not per_pipeline:
        return []
    num_stages = len(per_pipeline[0])
    if any(len(p) != num_stages for p in per_pipeline):
        raise ValueError(f"pipelines have different stage counts {[len(p) for p in per_pipeline]}; "
                         f"build every pipeline for the same pp_degree")
    return [[a for p in per_pipeline for a in p[s]] for s in range(num_stages)]


def replica_actions(lengths, cost, pipelines: Sequence[Sequence[Unit]], dp_rank: int,
                    warmup: Callable[[list[Unit]], list[int]]) -> tuple[list[Unit], list[list]]:
    """Units (tagged with pipeline and replica) and per-stage actions of one DP replica;
    ``warmup(units)`` gives a pipeline's forwards per stage before its first backward."""
    units: list[Unit] = []
    per_pipeline = []
    for p_index, punits in enumerate(pipelines):
        tagged = [replace(u, pipeline=p_index, dp_rank=dp_rank) for u in punits]
        units.extend(tagged)
        warm = warmup(tagged)
        per_pipeline.append(build_pipeline_actions([u.id for u in tagged], backward_order(tagged, lengths), warm))
    return units, concat_pipelines(per_pipeline)
