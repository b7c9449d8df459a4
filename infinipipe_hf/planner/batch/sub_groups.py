"""Elastic SP rounds: EPP's units regrouped so short sequences run on small SP sub-groups.

A stage of ``sp`` GPUs can run several units side by side, each on an aligned sub-group of a
power-of-two size (:mod:`infinipipe_hf.ir.sp_rounds`).  A short sequence on one GPU pays no
all-to-all and no head rounding, while a long one keeps the whole group.  From the elastic units
of one slice count (:func:`~.elastic.make_elastic_units`, priced on the whole group):

1. **Chains stay whole.**  Slices of long sequences (and the hybrid unit holding a tail) stay on
   the whole SP group, one unit per round, so every slice of a sequence runs on the same ranks
   and its K/V never moves between sub-groups (the planner forbids a sequence on two sub-groups).
2. **Short sequences get the smallest group that holds them.**  The packed units' sequences form
   a pool; a unit on ``g`` GPUs may hold ``token_budget * g / sp`` tokens, so every rank holds at
   most what a whole-group unit puts on it, and a sequence needs the smallest ``g`` whose cap
   holds it.  Longest first, each goes to the open unit of at least that size with the least time
   slack left under the time budget (best fit, as :mod:`.elastic` packs), else opens a unit of its
   own size.  Times are per decoder layer on the unit's own sub-group
   (:meth:`~infinipipe_hf.planner.cost.model.CostModel.for_group`).
3. **Units into rounds.**  Slowest first, each unit takes the first round with a free aligned
   block of its size (a buddy allocation: sizes are powers of two, so blocks never fragment
   badly).  A round left with free ranks doubles its slowest unit that fits the gap until the
   group is covered (a round must cover every SP rank).  Rounds run slowest first after the chains.

Trade-off: the pool's groups follow a token cap rather than a joint solve of groups and rounds as
FlexSP's MILP does; the cap keeps every round's memory per rank at most a whole-group unit's, so
the checkpoint solver and the estimator see the same pressure as without rounds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from infinipipe_hf.ir.sp_rounds import SubGroup
from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.batch.elastic import SlicingResult
from infinipipe_hf.planner.batch.group_packing import RoundProblem, greedy_groups
from infinipipe_hf.planner.batch.layer_time import LayerTime
from infinipipe_hf.planner.batch.rounds import blast
from infinipipe_hf.planner.cost.model import CostModel

_REL_EPS = 1e-9


@dataclass
class _Member:
    """A unit being built: its group size, whole sequences and per-layer time on its group."""

    size: int
    seqs: list[int]
    time: float
    tokens: int


@dataclass(frozen=True)
class RoundedUnits:
    """One replica's units regrouped into rounds (module docstring)."""

    units: list[Unit]
    """Every unit in forward order: round by round, a round's units by sub-group offset."""
    rounds: list[list[int]]
    """Unit ids per round, in forward order."""
    sp_groups: dict[int, SubGroup] = field(default_factory=dict)
    """Units on a sub-group smaller than the SP group (the others run on all of it)."""

    def group_sizes(self) -> dict[int, int]:
        """Units per sub-group size (the whole group included)."""
        out: dict[int, int] = {}
        for members in self.rounds:
            for u in members:
                g = self.sp_groups[u].size if u in self.sp_groups else -1
                out[g] = out.get(g, 0) + 1
        return out


def group_sizes(dims: ParallelDims) -> list[int]:
    """Sub-group sizes of a stage's SP group: the powers of two dividing it (empty unless ``sp_degree``
    is itself a power of two above 1, the only groups that sub-groups tile)."""
    sp_degree = dims.sp_degree
    if sp_degree < 2 or sp_degree & (sp_degree - 1):
        return []
    return [1 << k for k in range(sp_degree.bit_length())]


def elastic_rounds(res: SlicingResult, lengths: Sequence[int], cost: CostModel,
                   first_unit_id: int = 0) -> RoundedUnits | None:
    """Rounds of ``res``'s units on ``cost.dims.sp_degree`` GPUs per stage; None when no unit would run
    on a sub-group (then the plan is plain whole-group EPP)."""
    sp = cost.dims.sp_degree
    sizes = group_sizes(cost.dims)
    chains = [u for u in res.units if any(s.start > 0 or s.end < lengths[s.seq] for s in u.segments)]
    chained = {u.id for u in chains}
    pool = sorted((s.seq for u in res.units if u.id not in chained for s in u.segments),
                  key=lambda q: (-lengths[q], q))
    if not sizes or not pool:
        return None
    times = {g: LayerTime.of(cost.for_group(g)) for g in sizes}
    caps = {g: res.token_budget * g // sp for g in sizes}
    members = _pack_pool(pool, lengths, sizes, caps, times, res.time_budget_s)
    rounds = _assemble(members, times, lengths)
    solved = _solved_rounds(pool, lengths, sizes, caps, times, len(rounds))
    if solved is not None and _total(solved) < _total(rounds):
        rounds = solved
    rounds.sort(key=lambda r: -max(m.time for m in r))
    if all(m.size == sp for r in rounds for m in r):
        return None
    return _rounded(chains, rounds, lengths, sp, first_unit_id)


def rounds_of_groups(rounds: Sequence[Sequence[tuple[int, Sequence[int]]]], lengths: Sequence[int],
                     cost: CostModel, first_unit_id: int = 0) -> RoundedUnits | None:
    """Units on aligned sub-groups of the stage's SP ranks from given rounds of ``(GPUs, whole
    sequences)`` groups (a non-pipeline alternative's plan: FlexSP's or ZeRO-3 + Ulysses' step), in
    their order; a round that leaves ranks free has its slowest fitting unit doubled, as
    :func:`elastic_rounds` covers its own.  None when a round is empty, a group's size is not a
    sub-group size of ``cost.dims.sp_degree`` or a round holds more GPUs than it."""
    sizes = group_sizes(cost.dims)
    sp = cost.dims.sp_degree
    if not sizes or any(not r or sum(g for g, _ in r) > sp or any(g not in sizes or not seqs for g, seqs in r)
                        for r in rounds):
        return None
    times = {g: LayerTime.of(cost.for_group(g)) for g in sizes}
    members = []
    for r in rounds:
        here = [_Member(g, [int(q) for q in seqs], times[g].b + sum(times[g].segment(0, lengths[q]) for q in seqs),
                        sum(int(lengths[q]) for q in seqs)) for g, seqs in r]
        _cover(here, times, lengths)
        here.sort(key=lambda m: (-m.size, -m.time, m.seqs[0]))
        members.append(here)
    return _rounded([], members, lengths, sp, first_unit_id)


def _rounded(chains: list[Unit], rounds: list[list[_Member]], lengths: Sequence[int], sp: int,
             first_unit_id: int) -> RoundedUnits:
    """The chains (each a round of its own on the whole group), then ``rounds`` (each round's
    members in sub-group order), as units numbered from ``first_unit_id``."""
    units: list[Unit] = []
    ids: list[list[int]] = []
    groups: dict[int, SubGroup] = {}
    for u in chains:
        ids.append([first_unit_id + len(units)])
        units.append(Unit(first_unit_id + len(units), u.segments))
    for r in rounds:
        ids.append([])
        offset = 0
        for m in r:
            uid = first_unit_id + len(units)
            units.append(Unit(uid, tuple(Segment(q, 0, lengths[q]) for q in m.seqs)))
            ids[-1].append(uid)
            if m.size != sp:
                groups[uid] = SubGroup(offset, m.size)
            offset += m.size
    return RoundedUnits(units, ids, groups)


def _pack_pool(pool: list[int], lengths: Sequence[int], sizes: list[int], caps: dict[int, int],
               times: dict[int, LayerTime], budget_s: float) -> list[_Member]:
    """Step 2: pool sequences (longest first) into units of the smallest size that holds them, each
    into the open unit of at least that size left with the least time slack (ties: the first
    opened).  Vectorised per size with numpy."""
    limit = budget_s * (1 + _REL_EPS)
    cap = len(pool)
    slack = {g: np.empty(cap) for g in sizes}  # time slack left under the budget
    room = {g: np.empty(cap, dtype=np.int64) for g in sizes}  # tokens left under the cap
    order = {g: np.empty(cap, dtype=np.int64) for g in sizes}  # creation index of each unit
    where: dict[int, list[_Member]] = {g: [] for g in sizes}
    members: list[_Member] = []
    for q in pool:
        n = int(lengths[q])
        need = next((g for g in sizes if n <= caps[g]), sizes[-1])
        best = None  # (slack after adding, creation index, size, position)
        for g in sizes:
            k = len(where[g])
            if g < need or not k:
                continue
            left = slack[g][:k] - times[g].segment(0, n)
            ok = (left >= 0) & (room[g][:k] >= n)
            if ok.any():
                i = int(np.flatnonzero(ok)[np.argmin(left[ok])])
                cand = (float(left[i]), int(order[g][i]), g, i)
                best = cand if best is None or cand[:2] < best[:2] else best
        if best is None:
            g, i = need, len(where[need])
            m = _Member(g, [], times[g].b, 0)
            where[g].append(m)
            slack[g][i], room[g][i], order[g][i] = limit - times[g].b, caps[g], len(members)
            members.append(m)
        else:
            _, _, g, i = best
            m = where[g][i]
        dt = times[g].segment(0, n)
        m.seqs.append(q)
        m.tokens += n
        m.time += dt
        slack[g][i] -= dt
        room[g][i] -= n
    return members


def _assemble(members: list[_Member], times: dict[int, LayerTime], lengths: Sequence[int]) -> list[list[_Member]]:
    """Step 3: units into rounds covering the SP group, each round's units largest group first
    (``times``: per group size, the whole SP group the largest)."""
    sp = max(times)
    rounds: list[list[_Member]] = []
    free: list[list[tuple[int, int]]] = []  # per round: free aligned blocks (offset, size)
    for m in sorted(members, key=lambda m: (-m.time, -m.size, m.seqs[0])):
        for r, blocks in enumerate(free):
            fits = [b for b in blocks if b[1] >= m.size]
            if fits:
                _take(blocks, min(fits, key=lambda b: (b[1], b[0])), m.size)
                rounds[r].append(m)
                break
        else:
            rounds.append([m])
            free.append([(0, sp)])
            _take(free[-1], (0, sp), m.size)
    for r in rounds:
        _cover(r, times, lengths)
        r.sort(key=lambda m: (-m.size, -m.time, m.seqs[0]))
    return rounds


def _total(rounds: list[list[_Member]]) -> float:
    """Per-layer time of the rounds, each as long as its slowest unit."""
    return sum(max(m.time for m in r) for r in rounds)


def _solved_rounds(pool: list[int], lengths: Sequence[int], sizes: list[int], caps: dict[int, int],
                   times: dict[int, LayerTime], num_rounds: int) -> list[list[_Member]] | None:
    """FlexSP's arrangement of the pool in ``num_rounds`` rounds: sequences blasted into rounds,
    each round's groups chosen by its group solver (:func:`~infinipipe_hf.planner.alternatives.
    flexsp_solver.greedy_groups`) on the same per-layer times and caps; None when a round fails."""
    sp = sizes[-1]
    rounds = []
    for seqs in blast([lengths[q] for q in pool], num_rounds):
        lens = np.asarray([lengths[pool[i]] for i in seqs], dtype=float)
        prob = RoundProblem(tuple(int(n) for n in lens), sp, tuple(sizes), {g: times[g].b for g in sizes},
                            {g: times[g].a1 * lens * lens + times[g].a2 * lens for g in sizes}, dict(caps))
        groups = greedy_groups(prob)
        if groups is None:
            return None
        r = [_Member(g, [pool[seqs[i]] for i in members], 0.0, 0) for g, members in groups]
        for m in r:
            m.tokens = sum(lengths[q] for q in m.seqs)
            m.time = times[m.size].b + sum(times[m.size].segment(0, lengths[q]) for q in m.seqs)
        _cover(r, times, lengths)
        r.sort(key=lambda m: (-m.size, -m.time, m.seqs[0]))
        rounds.append(r)
    return rounds


def _take(blocks: list[tuple[int, int]], block: tuple[int, int], size: int) -> None:
    """Allocate ``size`` ranks at the start of the free ``block``, splitting off the rest as buddies."""
    blocks.remove(block)
    offset, have = block
    while have > size:
        have //= 2
        blocks.append((offset + have, have))


def _cover(members: list[_Member], times: dict[int, LayerTime], lengths: Sequence[int]) -> None:
    """Double the slowest unit that fits the round's free ranks until the round covers them all
    (the whole SP group: the largest size of ``times``)."""
    free = max(times) - sum(m.size for m in members)
    while free > 0:
        m = max((m for m in members if m.size <= free), key=lambda m: (m.time, -m.seqs[0]))
        free -= m.size
        m.size *= 2
        m.time = times[m.size].b + sum(times[m.size].segment(0, lengths[q]) for q in m.seqs)
