"""Hand-made plans with SP sub-groups and rounds (``ir.rounds``), independent of the planner.

A round is a list of members ``(offset, size, segments)``: the unit of ``segments`` (each
``(seq, start, end)``) runs on SP ranks ``offset .. offset + size - 1``.  The rounds are scheduled
with ``plans.one_f_one_b`` as if each round were one unit, so a round's forwards (and backwards)
are consecutive on every stage.  Slices of a sequence must sit in consecutive rounds on one
sub-group: consecutive rounds linked by a continuing sequence form one chain of pseudo slices, so
1F1B runs the chain's backwards last round first, as the K/V gradients need.
"""
from __future__ import annotations

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.sp_rounds import SubGroup
from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.layout import shard_mode
from tests.distributed.plans import one_f_one_b

Member = tuple[int, int, list[tuple[int, int, int]]]


def _round_chains(rounds: list[list[Member]], lengths: list[int]) -> list[bool]:
    """``links[r]``: round ``r`` continues a sequence into round ``r + 1``."""
    links = []
    for r, members in enumerate(rounds):
        cont = {seq for _, _, segs in members for seq, _, end in segs if end < lengths[seq]}
        if cont:
            nxt = {seq for _, _, segs in rounds[r + 1] for seq, _, _ in segs} if r + 1 < len(rounds) else set()
            assert cont <= nxt, f"round {r} continues sequences {sorted(cont - nxt)} outside round {r + 1}"
        links.append(bool(cont))
    return links


def round_actions(rounds: list[list[Member]], ids: list[list[int]], lengths: list[int],
                  pp: int) -> list[list[Action]]:
    """1F1B over the rounds (one pseudo unit each), expanded into each round's units."""
    links = _round_chains(rounds, lengths)
    pseudo, pseudo_lengths, chain, pos = [], [], 0, 0
    for r in range(len(rounds)):
        pseudo.append(Unit(r, (Segment(chain, pos, pos + 1),)))
        pos += 1
        if not links[r]:
            pseudo_lengths.append(pos)
            chain, pos = chain + 1, 0
    per_stage = one_f_one_b(pseudo, pseudo_lengths, pp)
    return [[Action(a.kind, u) for a in acts for u in ids[a.unit]] for acts in per_stage]


def rounds_plan(lengths: list[int], rounds_per_dp: list[list[list[Member]]], *, pp: int, sp: int,
                layers_per_stage: list[int], checkpoint=None, levels=None, shard: str = "none") -> Plan:
    """A plan running ``rounds_per_dp[d]`` on replica ``d``.  ``checkpoint(stage, round, layers)``:
    whole checkpointed layers; ``levels(stage, round, layers, whole)``: finer levels; both per
    round, so a round's units share one checkpoint mix."""
    units: list[Unit] = []
    groups: dict[int, SubGroup] = {}
    all_rounds: list[list[int]] = []
    actions: dict[int, list[list[Action]]] = {}
    round_index: dict[int, int] = {}  # unit -> index of its round in all_rounds
    for d, rounds in enumerate(rounds_per_dp):
        ids = []
        for members in rounds:
            mine = []
            for offset, size, segs in members:
                u = Unit(len(units), tuple(Segment(*s) for s in segs), 0, d)
                units.append(u)
                mine.append(u.id)
                round_index[u.id] = len(all_rounds)
                if size != sp:
                    groups[u.id] = SubGroup(offset, size)
            ids.append(mine)
            all_rounds.append(mine)
        actions[d] = round_actions(rounds, ids, lengths, pp)
    ckpt: dict[int, dict[int, int]] = {}
    finer: dict[int, dict[int, dict[str, int]]] = {}
    for s, layers in enumerate(layers_per_stage):
        for u in units:
            r = round_index[u.id]
            whole = int(checkpoint(s, r, layers)) if checkpoint is not None else 0
            ckpt.setdefault(s, {})[u.id] = whole
            per = levels(s, r, layers, whole) if levels is not None else {}
            if per:
                finer.setdefault(s, {})[u.id] = per
    return Plan("epp", pp, len(rounds_per_dp), list(lengths), units, actions, ckpt,
                layers_per_stage=list(layers_per_stage), sp_degree=sp, shard=shard_mode(shard),
                checkpoint_levels=finer, sp_groups=groups, rounds=all_rounds)
