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
- :func:`~infinipipe_hf.planner.batch.group_packing.greedy_groups`: a faster stand-in (binary
  search on the makespan, first-fit-decreasing probes), shared with EPP's SP sub-groups.  It may
  miss a memory-tight round that has a plan (the blaster then uses one more round).

Trade-off: the MILP's answer is only as good as the buckets and its time limit; the greedy has no
optimality guarantee but costs milliseconds, which is why it is the default.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from infinipipe_hf.planner.batch.group_packing import RoundProblem


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
