"""Hand-made plans for runtime tests, independent of the real planner.

``one_f_one_b`` orders each DP replica's units with a tick-by-tick simulation of 1F1B: every stage
runs at most one action per tick, a backward whenever its inputs are ready, otherwise a forward
while fewer than ``pp - stage + K - 1`` units are in flight (K: longest run of slices of one
sequence).  Because every action in the produced lists ran in the simulation only after the actions
it depends on, the lists cannot deadlock.  A long sequence's slices must be consecutive units; the
backward of a sequence's slices runs last slice first, FIFO across sequences.
"""
from __future__ import annotations

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Segment, Unit


def _chains(units: list[Unit], lengths: list[int]) -> list[list[int]]:
    """Groups of consecutive unit positions linked by slices of one sequence."""
    chains: list[list[int]] = []
    open_seq = None
    for i, u in enumerate(units):
        continues = open_seq is not None and open_seq in u.seqs
        if continues:
            chains[-1].append(i)
        else:
            chains.append([i])
        cont = [s for s in u.segments if s.end < lengths[s.seq]]
        assert len(cont) <= 1, f"unit {u.id} continues two sequences"
        open_seq = cont[0].seq if cont else None
    return chains


def one_f_one_b(units: list[Unit], lengths: list[int], pp: int) -> list[list[Action]]:
    chains = _chains(units, lengths)
    border = [i for c in chains for i in reversed(c)]  # backward order (positions)
    k = max(len(c) for c in chains)
    n = len(units)
    f_done = [[-1] * n for _ in range(pp)]  # tick at which F of position i finished on stage s
    b_done = [[-1] * n for _ in range(pp)]
    nf, nb = [0] * pp, [0] * pp
    out: list[list[Action]] = [[] for _ in range(pp)]
    tick = 0
    while any(nb[s] < n for s in range(pp)):
        progressed = False
        for s in range(pp):
            if nb[s] < n:
                i = border[nb[s]]
                ready = 0 <= f_done[s][i] < tick and (s == pp - 1 or 0 <= b_done[s + 1][i] < tick)
                if ready:
                    b_done[s][i] = tick
                    out[s].append(Action("B", units[i].id))
                    nb[s] += 1
                    progressed = True
                    continue
            if nf[s] < n and nf[s] - nb[s] < pp - s + k - 1:
                i = nf[s]
                if s == 0 or 0 <= f_done[s - 1][i] < tick:
                    f_done[s][i] = tick
                    out[s].append(Action("F", units[i].id))
                    nf[s] += 1
                    progressed = True
        tick += 1
        assert progressed or tick < 4 * n * pp + 10, "1F1B simulation made no progress"
    return out


def make_plan(lengths: list[int], units_per_dp: list[list[list[tuple[int, int, int]]]], pp: int,
              layers_per_stage: list[int], checkpoint=None, schedule: str = "epp") -> Plan:
    """``units_per_dp[d]`` lists replica d's units in forward order, each a list of
    ``(seq, start, end)``; ``checkpoint(stage, unit_id, layers) -> int`` checkpointed layers."""
    units: list[Unit] = []
    actions: dict[int, list[list[Action]]] = {}
    for d, segs_list in enumerate(units_per_dp):
        mine = []
        for segs in segs_list:
            mine.append(Unit(len(units) + len(mine), tuple(Segment(*s) for s in segs), 0, d))
        units.extend(mine)
        actions[d] = one_f_one_b(mine, lengths, pp) if mine else [[] for _ in range(pp)]
    ck: dict[int, dict[int, int]] = {}
    if checkpoint is not None:
        for s in range(pp):
            ck[s] = {u.id: int(checkpoint(s, u.id, layers_per_stage[s])) for u in units}
    return Plan(schedule=schedule, pp_degree=pp, dp_degree=len(units_per_dp), sequences=list(lengths),
                units=units, actions=actions, checkpoint_layers=ck,
                layers_per_stage=list(layers_per_stage))
