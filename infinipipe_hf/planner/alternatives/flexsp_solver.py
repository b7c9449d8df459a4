"""FlexSP's per-round problem: split the GPUs into SP groups and give every sequence a group.

Given the sequences of one round (micro-batch), ``world_size`` GPUs and the allowed group sizes
(powers of two), choose a multiset of group sizes using at most ``world_size`` GPUs and assign
every sequence to one group, so that the slowest group is as fast as possible and every group's
tokens fit its memory (Wang et al., FlexSP, ASPLOS 2025, section 4).  A group of size ``g`` with
sequences ``S`` takes ``fixed[g] + sum(per_seq[g][s] for s in S)`` seconds (the cost model is
affine in pairs and, past a few tokens per GPU, in tokens, so a packed group's time splits per
sequence: ``flexsp_build.round_problem``; padding to a multiple of ``g`` is left to the exact
simulation) and fits when ``sum(len(s)) <= cap[g]`` tokens.

Placement: groups of power-of-two sizes placed largest first, each at a multiple of its size,
always tile ``world_size`` (a buddy allocation), and a group of ``g <= gpus_per_node`` GPUs then
stays inside one node; so only the multiset of sizes matters, and the solvers work on that.

Two solvers:

- :func:`milp_groups`: FlexSP's formulation as a MILP (``scipy.optimize.milp``, HiGHS) on
  *buckets* of similar lengths (:func:`bucketize`: FlexSP's dynamic programme, boundaries that
  minimise the total rounding-up of lengths to their bucket's longest).  Variables: per candidate
  group (up to ``world_size / g`` slots per size) a binary "used" and per bucket an integer count,
  and the makespan; symmetric slots are ordered to cut the search.  A bucket's sequences count
  their longest's tokens against memory (safe) and their mean time against the makespan; the
  answer is priced exactly afterwards.  With one bucket per sequence it is exact.
- :func:`greedy_groups`: a faster stand-in -- binary search on the makespan ``T``, each probe a
  first-fit-decreasing packing (longest sequence first into the fullest group that still meets
  ``T`` and its memory; otherwise a new group of the smallest size that meets ``T``; when the GPUs
  run out, a group doubled or two merged to make room), feasible when it uses at most
  ``world_size`` GPUs.  It may miss a memory-tight round that has a plan (the blaster then uses
  one more round).

Trade-off: the MILP's answer is only as good as the buckets and its time limit; the greedy has no
optimality guarantee but costs milliseconds, which is why it is the default.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix


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
def bucketize(lengths: Sequence[int], num_buckets: int) -> list[list[int]]:
    """Indices of ``lengths`` in at most ``num_buckets`` buckets of consecutive sorted lengths,
    minimising the total rounding-up to each bucket's longest (dynamic programming)."""
    order = np.argsort(lengths, kind="stable")
    s = np.asarray(lengths, dtype=float)[order]
    n = len(s)
    k = max(1, min(int(num_buckets), n))
    prefix = np.concatenate([[0.0], np.cumsum(s)])
    a = np.arange(n)[:, None]  # bucket s[a:b] costs (b - a) * s[b - 1] - sum(s[a:b])
    b = np.arange(1, n + 1)[None, :]
    span = np.where(a < b, (b - a) * s[b - 1] - (prefix[b] - prefix[a]), np.inf)
    best = span[0].copy()  # best[b]: one bucket covering s[0:b]
    choice = [np.zeros(n, dtype=int)]
    for _ in range(1, k):
        total = best[:-1, None] + span[1:, :]  # row a-1: earlier buckets cover s[0:a], the new one s[a:b]
        total = np.vstack([np.full((1, n), np.inf), total])
        arg = np.argmin(total, axis=0)
        new = total[arg, np.arange(n)]
        better = new < best
        best = np.where(better, new, best)
        choice.append(np.where(better, arg, -1))
    # Walk back from the end: the last layer that improved tells where each bucket starts.
    buckets, end = [], n
    layer = len(choice) - 1
    while end > 0:
        while layer > 0 and choice[layer][end - 1] < 0:
            layer -= 1
        start = int(choice[layer][end - 1]) if layer > 0 else 0
        buckets.append([int(i) for i in order[start:end]])
        end, layer = start, layer - 1
    return buckets[::-1]


def milp_groups(prob: RoundProblem, num_buckets: int | None = None, time_limit_s: float = 1.0
                ) -> list[tuple[int, list[int]]] | None:
    """FlexSP's MILP (module docstring); ``num_buckets=None`` gives every sequence its own bucket."""
    n = len(prob.lengths)
    buckets = [[i] for i in range(n)] if num_buckets is None or num_buckets >= n else bucketize(prob.lengths, num_buckets)
    rep = [max(prob.lengths[i] for i in b) for b in buckets]
    count = [len(b) for b in buckets]
    slots = [(g, k) for g in prob.sizes for k in range(min(prob.world_size // g, n))]
    xs = [(bi, j) for j, (g, _) in enumerate(slots) for bi in range(len(buckets)) if rep[bi] <= prob.cap_tokens[g]]
    nx, ny = len(xs), len(slots)
    if any(not any(bi == b for b, _ in xs) for bi in range(len(buckets))):
        return None  # some bucket fits no group size
    nv = nx + ny + 1
    t_col = nv - 1
    data, rr, cc, lo, hi = [], [], [], [], []

    def row(entries, lower, upper):
        for col, v in entries:
            data.append(v), rr.append(len(lo)), cc.append(col)
        lo.append(lower), hi.append(upper)

    for bi in range(len(buckets)):
        row([(c, 1.0) for c, (b, _) in enumerate(xs) if b == bi], count[bi], count[bi])
    for j, (g, k) in enumerate(slots):
        mine = [(c, bi) for c, (bi, jj) in enumerate(xs) if jj == j]
        for c, bi in mine:  # a used slot only: x <= count * y
            row([(c, 1.0), (nx + j, -count[bi])], -np.inf, 0.0)
        row([(c, float(rep[bi])) for c, bi in mine] + [(nx + j, -float(prob.cap_tokens[g]))], -np.inf, 0.0)
        row([(c, float(np.mean(prob.per_seq_s[g][buckets[bi]]))) for c, bi in mine]
            + [(nx + j, prob.fixed_s[g]), (t_col, -1.0)], -np.inf, 0.0)
        if k > 0:
            row([(nx + j, 1.0), (nx + j - 1, -1.0)], -np.inf, 0.0)
    row([(nx + j, float(g)) for j, (g, _) in enumerate(slots)], -np.inf, float(prob.world_size))
    upper = np.concatenate([[count[bi] for bi, _ in xs], np.ones(ny), [np.inf]])
    integrality = np.concatenate([np.ones(nx + ny), [0]])
    c = np.zeros(nv)
    c[t_col] = 1.0
    res = milp(c, integrality=integrality, bounds=Bounds(np.zeros(nv), upper),
               constraints=[LinearConstraint(coo_matrix((data, (rr, cc)), shape=(len(lo), nv)).tocsr(),
                                             np.array(lo), np.array(hi))],
               options={"time_limit": max(time_limit_s, 1e-3), "disp": False})
    if res.x is None:
        return None
    x = np.round(res.x).astype(int)
    pending = {bi: sorted(b, key=lambda i: -prob.lengths[i]) for bi, b in enumerate(buckets)}
    groups: dict[int, list[int]] = {}
    for c_i, (bi, j) in enumerate(xs):
        for _ in range(x[c_i]):
            groups.setdefault(j, []).append(pending[bi].pop(0))
    return [(slots[j][0], members) for j, members in sorted(groups.items())]
