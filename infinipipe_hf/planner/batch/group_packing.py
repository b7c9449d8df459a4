"""Groups of GPUs for the sequences of one round: the problem and its greedy solver.

A round runs sequences side by side on disjoint groups of GPUs (power-of-two sizes, placed largest
first at multiples of their size, so they tile the GPUs and a group of at most a node's GPUs stays
inside one node).  :class:`RoundProblem` holds a round's lengths and per group size the time and
memory terms; :func:`greedy_groups` gives every sequence a group so that the slowest group is as
fast as it can find: binary search on the makespan ``T``, each probe a first-fit-decreasing
packing (longest sequence first into the fullest group that still meets ``T`` and its memory;
otherwise a new group of the smallest size that meets ``T``; when the GPUs run out, a group
doubled or two merged to make room).  EPP's SP sub-groups (:mod:`.sub_groups`) and FlexSP
(:mod:`infinipipe_hf.planner.alternatives.flexsp_solver`, which adds the exact MILP) share it.

Trade-off: no optimality guarantee, but milliseconds; it may miss a memory-tight round that has a
plan (the caller then uses one more round).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RoundProblem:
    """One round: sequence lengths, GPUs, and per group size its time and memory terms."""

    lengths: tuple[int, ...]
    world_size: int
    sizes: tuple[int, ...]
    """Allowed group sizes (powers of two, increasing)."""
    fixed_s: dict[int, float]
    """Seconds a group of that size spends whatever it holds (per-layer kernel overheads)."""
    per_seq_s: dict[int, np.ndarray]
    """Seconds each sequence adds to a group of that size."""
    cap_tokens: dict[int, int]
    """Most tokens a group of that size may hold (padding headroom already taken off)."""

    def group_time(self, size: int, seqs: Sequence[int]) -> float:
        return self.fixed_s[size] + float(sum(self.per_seq_s[size][i] for i in seqs))

    def fits(self, size: int, seqs: Sequence[int]) -> bool:
        return sum(self.lengths[i] for i in seqs) <= self.cap_tokens[size]

    def makespan(self, groups: Sequence[tuple[int, Sequence[int]]]) -> float:
        return max((self.group_time(g, s) for g, s in groups), default=0.0)

    def check(self, groups: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Raise unless ``groups`` assigns every sequence once, fits memory and the world."""
        seen = sorted(i for _, s in groups for i in s)
        if seen != list(range(len(self.lengths))):
            raise AssertionError(f"groups cover {seen}, not every sequence once")
        if sum(g for g, _ in groups) > self.world_size:
            raise AssertionError(f"groups use {sum(g for g, _ in groups)} GPUs of {self.world_size}")
        for g, s in groups:
            if not s or not self.fits(g, s):
                raise AssertionError(f"group of {g} GPUs with sequences {list(s)} is empty or over memory")


def smallest_sizes(prob: RoundProblem) -> list[int | None]:
    """Per sequence, the smallest group size that can hold it (None: no size can)."""
    out = []
    for n in prob.lengths:
        out.append(next((g for g in prob.sizes if n <= prob.cap_tokens[g]), None))
    return out


# --- greedy -------------------------------------------------------------------------------
def _pack_under(prob: RoundProblem, order: np.ndarray, smallest: list[int], limit: float):
    """First-fit-decreasing packing where no group exceeds ``limit`` seconds (None: over the GPUs).

    A sequence goes into the fullest group that still meets ``limit`` and its memory, else into a
    new group of the smallest size that meets ``limit``; when the GPUs are used up, a group is
    doubled (with free GPUs) or two equal groups are merged, if the result holds the sequence.
    """
    sizes, loads, tokens, members = [], [], [], []
    caps = prob.cap_tokens
    used = 0
    for i in order:
        n = prob.lengths[i]
        best, best_load = -1, -1.0
        for j, g in enumerate(sizes):
            add = prob.per_seq_s[g][i]
            if tokens[j] + n <= caps[g] and loads[j] + add <= limit and loads[j] + add > best_load:
                best, best_load = j, loads[j] + add
        if best >= 0:
            loads[best] = best_load
            tokens[best] += n
            members[best].append(int(i))
            continue
        opened = _open_group(prob, i, smallest[i], used, limit)
        if opened is not None:
            g, t = opened
            sizes.append(g), loads.append(t), tokens.append(n), members.append([int(i)])
            used += g
            continue
        used = _grow_or_merge(prob, i, limit, sizes, loads, tokens, members, used)
        if used is None:
            return None
    return list(zip(sizes, members))


def _open_group(prob: RoundProblem, i: int, smallest: int, used: int, limit: float) -> tuple[int, float] | None:
    """Size and time of the smallest new group (of free GPUs) holding sequence ``i`` within ``limit``."""
    for g in prob.sizes:
        if g < smallest or used + g > prob.world_size:
            continue
        t = prob.fixed_s[g] + prob.per_seq_s[g][i]
        if t <= limit:
            return g, t
    return None


def _grow_or_merge(prob: RoundProblem, i: int, limit: float, sizes: list, loads: list, tokens: list,
                   members: list, used: int) -> int | None:
    """Make room for sequence ``i``: double a group into free GPUs, or merge two equal groups (the
    cheapest option within ``limit``).  Updates the groups in place; returns the GPUs used, or
    None when no option holds the sequence."""
    caps = prob.cap_tokens
    n = prob.lengths[i]

    def load_at(g, seqs):
        return prob.fixed_s[g] + float(sum(prob.per_seq_s[g][k] for k in seqs))

    options = []
    for j, g in enumerate(sizes):
        if 2 * g in caps and used + g <= prob.world_size and tokens[j] + n <= caps[2 * g]:
            options.append((load_at(2 * g, members[j] + [i]), "grow", j, -1))
        for k in range(j + 1, len(sizes)):
            if sizes[k] == g and 2 * g in caps and tokens[j] + tokens[k] + n <= caps[2 * g]:
                options.append((load_at(2 * g, members[j] + members[k] + [i]), "merge", j, k))
    options = [o for o in options if o[0] <= limit]
    if not options:
        return None
    t, how, j, k = min(options)
    g = sizes[j]
    if how == "grow":
        used += g
    else:
        members[j] += members[k]
        tokens[j] += tokens[k]
        del sizes[k], loads[k], tokens[k], members[k]
    sizes[j], loads[j] = 2 * g, t
    tokens[j] += n
    members[j].append(int(i))
    return used


def greedy_groups(prob: RoundProblem, rel_tol: float = 2e-3) -> list[tuple[int, list[int]]] | None:
    """Groups found by binary search on the makespan (module docstring); None when infeasible."""
    smallest = smallest_sizes(prob)
    if any(g is None for g in smallest):
        return None
    order = np.argsort([-n for n in prob.lengths], kind="stable")
    best = _pack_under(prob, order, smallest, math.inf)
    if best is None:
        return None  # even packing for memory alone needs more GPUs than there are
    hi = prob.makespan(best)
    # No group finishes before its longest-running sequence alone on the fastest group it may use.
    lo = max(min(prob.fixed_s[g] + prob.per_seq_s[g][i] for g in prob.sizes if g >= smallest[i])
             for i in range(len(prob.lengths)))
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        got = _pack_under(prob, order, smallest, mid)
        if got is None:
            lo = mid
        else:
            best, hi = got, prob.makespan(got)
    return best


# --- MILP on buckets ----------------------------------------------------------------------
