"""Validator: reject a bad plan before it runs, with the stage-by-time grid and the culprit marked.

Design: checks run from the data outwards -- structure, token coverage, placement of sequences,
SP rounds (:mod:`.sp_round_checks`), per-stage action completeness, forward-before-backward, slice
order, send/receive pairing between neighbouring stages, deadlock freedom (a dependency replay
must finish), checkpoint counts, memory (the busiest SP rank's) -- and the first failure raises
:class:`PlanValidationError`.  Each check knows which action is to blame, so the message carries
the grid of that DP replica (:mod:`~infinipipe_hf.planner.simulate.grid`) with the action
printed ``[B7]!``.  Later checks rely on earlier ones (the replay assumes complete, paired
lists), which is why they stop at the first failure rather than collect every problem.

Trade-off: one pass per check over all actions (linear in the plan) instead of one fused pass;
the clarity of separate checks is worth a few milliseconds on a 512-unit plan.
"""
from __future__ import annotations

from typing import Sequence

from infinipipe_hf.ir.actions import Action, ActionKind, B, F
from infinipipe_hf.ir.levels import PLAN_LEVELS
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.rank_views import rank_classes, rank_view
from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.planner.checkpointing.memory_walk import stage_timeline
from infinipipe_hf.planner.checkpointing.points import memory_points, point_bytes, stage_peak_bytes
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.registry import SCHEDULES
from infinipipe_hf.planner.simulate.grid import format_grid, slot_replay
from infinipipe_hf.planner.validate import host_checks, sp_round_checks


class PlanValidationError(ValueError):
    """A plan that must not run; ``problem`` names it, ``grid`` shows where (empty if no replica)."""

    def __init__(self, problem: str, grid: str = "", dp_rank: int | None = None,
                 marks: Sequence[tuple[int, int]] = ()):
        self.problem = problem
        self.grid = grid
        self.dp_rank = dp_rank
        self.marks = list(marks)
        super().__init__(problem + ("\n" + grid if grid else ""))


def validate(plan: Plan, cost: CostModel | None = None, *, max_tokens_per_unit: int | None = None,
             check_memory: bool = True) -> None:
    """Raise :class:`PlanValidationError` unless ``plan`` is complete, ordered, runnable and fits."""
    cost = cost.for_plan(plan) if hasattr(cost, "for_plan") else cost  # as the plan was priced
    _Checker(plan, cost, max_tokens_per_unit, check_memory).run()


class _Checker:
    def __init__(self, plan: Plan, cost: CostModel | None, max_tokens: int | None, check_memory: bool):
        self.plan = plan
        self.cost = cost
        self.max_tokens = max_tokens
        self.check_memory = check_memory

    # --- reporting -----------------------------------------------------------------------
    def fail(self, problem: str, dp_rank: int | None = None, marks: Sequence[tuple[int, int]] = ()) -> None:
        grid = ""
        if dp_rank is not None and dp_rank in self.plan.actions:
            grid = format_grid(self.plan.actions[dp_rank], marks, dp_rank=dp_rank, sub_groups=self.plan.sp_groups)
        raise PlanValidationError(f"invalid {self.plan.schedule!r} plan: {problem}", grid, dp_rank, marks)

    def fail_unit(self, problem: str, unit: Unit, kind: ActionKind = ActionKind.FORWARD, stage: int = 0) -> None:
        """Fail marking ``kind`` of ``unit`` on ``stage`` of its replica (if the action exists)."""
        acts = self.plan.actions.get(unit.dp_rank, [])
        marks = [(stage, i) for i, a in enumerate(acts[stage]) if a == Action(kind, unit.id)] if stage < len(acts) else []
        self.fail(problem, unit.dp_rank, marks[:1])

    def report(self, problem: sp_round_checks.Problem) -> None:
        """Fail with a check's ``(problem, dp_rank, marks)`` unless it is None."""
        if problem is not None:
            self.fail(*problem)

    # --- checks --------------------------------------------------------------------------
    def run(self) -> None:
        self.structure()
        self.coverage()
        self.placement()
        self.tail_slices()
        self.report(sp_round_checks.rounds_structure(self.plan))
        self.report(sp_round_checks.one_group_per_sequence(self.plan))
        for r in sorted(self.plan.actions):
            self.completeness(r)
            if self.plan.rounds:
                self.report(sp_round_checks.contiguous_rounds(self.plan, r))
            self.slice_order(r)
            self.pairing(r)
            self.deadlock(r)
        self.checkpoints()
        self.report(sp_round_checks.one_mix_per_round(self.plan))
        self.report(host_checks.offload_kv_stages(self.plan))
        if self.check_memory and self.cost is not None:
            for r in sorted(self.plan.actions):
                self.memory(r)
                self.report(host_checks.host_memory(self.plan, self.cost, r))

    def structure(self) -> None:
        plan = self.plan
        if plan.pp_degree < 1 or plan.dp_degree < 1 or plan.sp_degree < 1:
            self.fail(f"pp_degree={plan.pp_degree}, dp_degree={plan.dp_degree}, sp_degree={plan.sp_degree}; "
                      f"all must be >= 1")
        dims = None if self.cost is None else self.cost.dims
        cost_layout = None if dims is None else (dims.sp_degree, dims.shard)
        if dims is not None and cost_layout != (plan.sp_degree, plan.shard):
            self.fail(f"the plan is for sp_degree={plan.sp_degree}, shard={plan.shard.name!r} but the cost model "
                      f"for sp_degree={cost_layout[0]}, shard={cost_layout[1].name!r}; validate with a "
                      f"CostModel built for the plan's layout")
        if sorted(plan.actions) != list(range(plan.dp_degree)):
            self.fail(f"action lists are keyed by dp ranks {sorted(plan.actions)}; expected 0..{plan.dp_degree - 1}")
        ids = [u.id for u in plan.units]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            self.fail(f"unit ids {dup} are used by more than one unit; give every unit its own id")
        for u in plan.units:
            if not 0 <= u.dp_rank < plan.dp_degree:
                self.fail(f"unit {u.id} is on dp replica {u.dp_rank}, outside 0..{plan.dp_degree - 1}")
            if self.max_tokens is not None and u.num_tokens > self.max_tokens:
                self.fail_unit(f"unit {u.id} has {u.num_tokens} tokens, over the token budget of "
                               f"{self.max_tokens} per unit", u)
        if self.cost is not None and len(self.cost.layers_per_stage) != plan.pp_degree:
            self.fail(f"the cost model has {len(self.cost.layers_per_stage)} stages but the plan "
                      f"pp_degree={plan.pp_degree}; build both for the same pp_degree")

    def coverage(self) -> None:
        """Every token of every sequence in exactly one segment."""
        plan = self.plan
        by_seq: dict[int, list[tuple[Segment, Unit]]] = {}
        for u in plan.units:
            for s in u.segments:
                if not 0 <= s.seq < len(plan.sequences) or s.end > plan.sequences[s.seq]:
                    n = len(plan.sequences)
                    self.fail_unit(f"unit {u.id} has segment {s.to_list()} outside the batch "
                                   f"({n} sequences{'' if not 0 <= s.seq < n else f', sequence {s.seq} has {plan.sequences[s.seq]} tokens'})", u)
                by_seq.setdefault(s.seq, []).append((s, u))
        for seq, length in enumerate(plan.sequences):
            segs = sorted(by_seq.get(seq, []), key=lambda x: (x[0].start, x[0].end))
            if not segs:
                if length > 0:
                    self.fail(f"sequence {seq} ({length} tokens) is in no unit; every token must be "
                              f"in exactly one segment", 0)
                continue
            covered = 0
            prev: Unit | None = None
            for s, u in segs:
                if s.start > covered:
                    self.fail_unit(f"tokens [{covered}, {s.start}) of sequence {seq} are in no segment "
                                   f"(a gap before unit {u.id}'s segment {s.to_list()})", u)
                if s.start < covered:
                    self.fail_unit(f"tokens [{s.start}, {min(covered, s.end)}) of sequence {seq} are in two "
                                   f"segments (units {prev.id if prev else '?'} and {u.id})", u)
                covered, prev = s.end, u
            if covered != length:
                self.fail_unit(f"tokens [{covered}, {length}) of sequence {seq} are in no segment "
                               f"(after unit {prev.id if prev else '?'})", prev)  # type: ignore[arg-type]

    def placement(self) -> None:
        """All segments of a sequence in one dp replica and one pipeline."""
        where: dict[int, tuple[int, int, int]] = {}
        for u in self.plan.units:
            for s in u.segments:
                first = where.setdefault(s.seq, (u.dp_rank, u.pipeline, u.id))
                if first[:2] != (u.dp_rank, u.pipeline):
                    self.fail_unit(f"sequence {s.seq} is split across dp replica/pipeline {first[:2]} "
                                   f"(unit {first[2]}) and {(u.dp_rank, u.pipeline)} (unit {u.id}); keep a "
                                   f"sequence's slices in one pipeline of one replica", u)

    def tail_slices(self) -> None:
        """A schedule whose units hold at most one tail slice (EPP's) gets no unit with two."""
        schedule = SCHEDULES.get(self.plan.schedule)
        if schedule is None or not schedule.one_tail_per_unit:
            return
        for u in self.plan.units:
            tails = [s for s in u.segments if s.start > 0 and s.end == self.plan.sequences[s.seq]]
            if len(tails) > 1:
                self.fail_unit(f"unit {u.id} holds the tail slices of sequences {[s.seq for s in tails]}; "
                               f"an EPP unit holds at most one tail slice", u)

    def completeness(self, r: int) -> None:
        """Each unit of the replica exactly once as F and once as B per stage, F first."""
        plan = self.plan
        mine = {u.id for u in plan.units_of(r)}
        for s, acts in enumerate(plan.actions[r]):
            seen: dict[Action, int] = {}
            for i, a in enumerate(acts):
                if a.unit not in mine:
                    other = plan.unit_by_id.get(a.unit)
                    why = "is not a unit of the plan" if other is None else f"belongs to dp replica {other.dp_rank}"
                    self.fail(f"stage {s} of dp replica {r} runs {a}, but unit {a.unit} {why}", r, [(s, i)])
                if a in seen:
                    self.fail(f"stage {s} of dp replica {r} runs {a} twice (#{seen[a]} and #{i})", r, [(s, i)])
                seen[a] = i
                if not a.is_forward and F(a.unit) not in seen:
                    self.fail(f"stage {s} of dp replica {r} runs {a} before F{a.unit}; a unit's forward "
                              f"must precede its backward on every stage", r, [(s, i)])
            for uid in sorted(mine):
                for kind, other in ((ActionKind.FORWARD, B), (ActionKind.BACKWARD, F)):
                    if Action(kind, uid) not in seen:
                        partner = seen.get(other(uid))
                        self.fail(f"stage {s} of dp replica {r} never runs {kind}{uid}",
                                  r, [(s, partner)] if partner is not None else [])

    def slice_order(self, r: int) -> None:
        """Forward earlier slice first, backward later slice first, on every stage."""
        chains: dict[int, list[tuple[int, int]]] = {}
        for u in self.plan.units_of(r):
            for seg in u.segments:
                chains.setdefault(seg.seq, []).append((seg.start, u.id))
        chains = {q: [uid for _, uid in sorted(c)] for q, c in chains.items() if len({uid for _, uid in c}) > 1}
        for s, acts in enumerate(self.plan.actions[r]):
            pos = {a: i for i, a in enumerate(acts)}
            for q in sorted(chains):
                c = chains[q]
                for earlier, later in zip(c, c[1:]):
                    if earlier == later:
                        continue
                    if pos[F(earlier)] > pos[F(later)]:
                        self.fail(f"stage {s}: F{later} (later slice of sequence {q}) runs before F{earlier} "
                                  f"(earlier slice); slices must run forward in order", r,
                                  [(s, pos[F(later)])])
                    if pos[B(earlier)] < pos[B(later)]:
                        self.fail(f"stage {s}: B{earlier} (earlier slice of sequence {q}) runs before B{later} "
                                  f"(later slice); slices must run backward last slice first", r,
                                  [(s, pos[B(earlier)])])

    def pairing(self, r: int) -> None:
        """What stage s sends, stage s+1 receives in the same order (forwards and backwards)."""
        stages = self.plan.actions[r]
        for s in range(len(stages) - 1):
            for kind, direction in ((ActionKind.FORWARD, "forward"), (ActionKind.BACKWARD, "backward")):
                here = [(i, a.unit) for i, a in enumerate(stages[s]) if a.kind == kind]
                there = [(i, a.unit) for i, a in enumerate(stages[s + 1]) if a.kind == kind]
                for (i, u), (j, v) in zip(here, there):
                    if u != v:
                        self.fail(f"stages {s} and {s + 1} run their {direction}s in different orders: "
                                  f"{kind}{u} on stage {s} is matched by {kind}{v} on stage {s + 1}; "
                                  f"sends and receives would pair the wrong units", r, [(s, i), (s + 1, j)])

    def deadlock(self, r: int) -> None:
        stages = self.plan.actions[r]
        rep = slot_replay(stages)
        if not rep.complete:
            stuck = rep.stuck(stages)
            desc = ", ".join(f"{stages[s][i]} on stage {s}" for s, i in stuck)
            self.fail(f"dp replica {r} deadlocks: {desc} wait for each other forever; reorder so every "
                      f"stage's next action has its input produced", r, stuck)

    def checkpoints(self) -> None:
        plan = self.plan
        layers = plan.layers_per_stage or (list(self.cost.layers_per_stage) if self.cost is not None else [])
        for s, uid, unit, n in self.stage_units(plan.checkpoint_layers, "checkpoint_layers"):
            top = layers[s] if s < len(layers) else None
            if n < 0 or (top is not None and n > top):
                self.fail_unit(f"stage {s} checkpoints {n} layers of unit {uid}, outside [0, {top}] "
                               f"(the stage has {top} decoder layers)", unit, ActionKind.BACKWARD, s)
        self.checkpoint_levels(layers)
        for key in ("mlp_tile_tokens", "attention_tile_tokens"):
            for uid, n in sorted(getattr(plan, key).items()):
                if uid not in plan.unit_by_id or isinstance(n, bool) or not isinstance(n, int) or n < 1:
                    self.fail(f"{key}[{uid}] = {n!r}: each entry maps a unit of the plan to a positive "
                              f"number of tokens per tile")

    def stage_units(self, per_stage: dict, name: str):
        """``(stage, unit id, unit, value)`` of a per-(stage, unit) plan field, in order; a stage or
        unit the plan does not have fails."""
        plan = self.plan
        for s, per_unit in sorted(per_stage.items()):
            if not 0 <= s < plan.pp_degree:
                self.fail(f"{name} names stage {s}, outside 0..{plan.pp_degree - 1}")
            for uid, value in sorted(per_unit.items()):
                unit = plan.unit_by_id.get(uid)
                if unit is None:
                    self.fail(f"{name}[{s}] names unit {uid}, which is not in the plan")
                yield s, uid, unit, value

    def checkpoint_levels(self, layers: list[int]) -> None:
        """Finer levels: known names, counts >= 0, whole + finer layers within the stage's layers."""
        plan = self.plan
        for s, uid, unit, per in self.stage_units(plan.checkpoint_levels, "checkpoint_levels"):
            bad = sorted(set(per) - set(PLAN_LEVELS))
            if bad:
                self.fail_unit(f"checkpoint_levels[{s}][{uid}] has unknown level(s) {bad}; the entry holds "
                               f"{', '.join(PLAN_LEVELS)} (whole layers go in "
                               f"checkpoint_layers)", unit, ActionKind.BACKWARD, s)
            for lv, n in sorted(per.items()):
                if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                    self.fail_unit(f"checkpoint_levels[{s}][{uid}][{lv!r}] = {n!r}; level counts are "
                                   f"non-negative ints (layers of the stage)", unit, ActionKind.BACKWARD, s)
            top = layers[s] if s < len(layers) else None
            full = plan.checkpointed(s, uid)
            total = full + sum(per.values())
            if top is not None and total > top:
                self.fail_unit(f"stage {s} gives unit {uid} {full} whole + "
                               + " + ".join(f"{n} {lv}" for lv, n in sorted(per.items()))
                               + f" = {total} checkpointed layers, but the stage has {top} decoder "
                               f"layers; each layer takes at most one level", unit, ActionKind.BACKWARD, s)

    def memory(self, r: int) -> None:
        plan, cost = self.plan, self.cost
        assert cost is not None
        budget = cost.memory_budget_bytes
        for s in range(plan.pp_degree):
            ck = plan.checkpoint_layers.get(s, {})
            levels = plan.checkpoint_levels.get(s, {})
            peak = stage_peak_bytes(plan, cost, r, s, ck, checkpoint_levels=levels)
            if peak <= budget:
                continue
            # Only on failure: find the action at the peak (on the busiest SP rank) to mark it.
            cache: dict = {}
            view = max((rank_view(plan, rank) for rank in rank_classes(plan)),
                       key=lambda v: stage_peak_bytes(v, cost, r, s, ck, checkpoint_levels=levels,
                                                      timeline=stage_timeline(v, cost, r, s, cache)))
            points = memory_points(view, cost, r, s)
            worst = max(points, key=lambda p: point_bytes(p, view, cost, s, ck, levels))
            a = view.stage_actions(r, s)[worst.action_index]
            worst_index = plan.stage_actions(r, s).index(a)
            gib = 1024 ** 3
            self.fail(f"stage {s} of dp replica {r} needs {peak / gib:.2f} GiB at {a} "
                      f"({len(worst.live_units)} units live), over the budget of {budget / gib:.2f} GiB; "
                      f"checkpoint more layers, use smaller units or more pipelines", r, [(s, worst_index)])
