"""A proven lower bound of the step time ``plan_step`` returns for one layout (the search's pruning).

The simulator's step ends no earlier than any stage's last action, and a stage runs its actions
one after another, so the step lasts at least the sum of one stage's action durations.  Each
duration is at least its compute: ``layers * (a1 * pairs + a2 * tokens + b)`` per GPU plus the
embedding and LM head on the end stages, before recompute, gathers' exposed part, transfers and
gradient sync are added (every one of them >= 0).  Two facts make that sum plan-independent:

- a sequence's segments own the causal band ``(C + s)^2 - C^2``, which telescopes to ``L^2`` over
  its slices, and tokens add up, so however a replica's sequences are sliced and packed its units'
  pairs sum to ``sum L^2`` and its tokens to ``sum L``; the per-unit fixed terms are dropped;
- with elastic SP rounds a round lasts as long as its slowest unit, at least the average over the
  stage's ``sp`` ranks of its units' per-GPU times weighted by the ranks each runs on (``g / sp``),
  so a unit is charged ``g / sp`` of its time on a sub-group of ``g`` ranks, the least over every
  ``g`` a unit may run on (whole group only when the plan has no rounds).

Sequences are assigned to DP replicas before units exist (:func:`~infinipipe_hf.planner.batch.
dp_assign.assign_sequences`, the same call ``plan_step`` makes), so the bound is the busiest
(replica, stage).  It is a bubble-free, recompute-free, communication-free step: loose where
recompute and bubbles are large, which only costs pruning, never a wrong pick.  What a stage
adds after its last action whatever the plan (the gradient reduction's least exposed part, a host
optimizer step: :func:`stage_end_s`) is added to its sum.  A cost model whose
fixed terms could be negative gets no bound (0), since dropping them would then overestimate.
"""
from __future__ import annotations

from infinipipe_hf.planner.batch.dp_assign import assign_sequences
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.search.api import resolve_sp_rounds


def group_sizes(cost: CostModel, sp_rounds: bool) -> list[int]:
    """SP (sub-)group sizes a unit of a plan on ``cost``'s layout may run on."""
    sp = cost.dims.sp_degree
    return [g for g in (2 ** i for i in range(sp.bit_length())) if sp % g == 0] if sp_rounds else [sp]


def stage_coefficients(cost: CostModel, stage_index: int, sizes: list[int]) -> tuple[float, float] | None:
    """``(per pair, per token)`` seconds of forward plus backward on ``stage_index``, per GPU averaged
    over the stage's SP ranks, the least over the group ``sizes``; None when a fixed term is negative."""
    sp = cost.dims.sp_degree
    last = cost.dims.pp_degree - 1
    layers = cost.num_layers(stage_index)
    best_pair, best_token = float("inf"), float("inf")
    for g in sizes:
        c = (cost if g == sp else cost.for_group(g)).compute
        if min(c.layer_fwd.fixed_s, c.layer_bwd.fixed_s, c.head_fwd.fixed_s, c.head_bwd.fixed_s,
               c.unit_fwd_s, c.unit_bwd_s) < 0:
            return None
        pair = layers * (c.layer_fwd.attn_pair_s + c.layer_bwd.attn_pair_s)
        token = layers * (c.layer_fwd.token_s + c.layer_bwd.token_s)
        if stage_index == 0:
            token += 2 * c.embedding_token_s
        if stage_index == last:  # the chunked loss recomputes its logits in backward
            pair += 2 * c.head_fwd.attn_pair_s + c.head_bwd.attn_pair_s
            token += 2 * c.head_fwd.token_s + c.head_bwd.token_s
        best_pair = min(best_pair, g / sp * pair)
        best_token = min(best_token, g / sp * token)
    return best_pair, best_token


def step_time_bound(lengths: list[int], cost: CostModel, sp_rounds: bool | None = None) -> float:
    """A lower bound of ``plan_step(lengths, ..., cost=cost)``'s simulated step time (module
    docstring); ``sp_rounds`` as ``PlanOptions.sp_rounds``.  0.0 when the cost model admits none."""
    rounds = resolve_sp_rounds(sp_rounds, cost.dims.sp_degree)
    sizes = group_sizes(cost, rounds)
    per_stage = [stage_coefficients(cost, p, sizes) for p in range(cost.dims.pp_degree)]
    if any(c is None for c in per_stage):
        return 0.0
    ends = [stage_end_s(cost, p) for p in range(cost.dims.pp_degree)]
    bound = 0.0
    for seqs in assign_sequences(lengths, cost.dims.dp_degree, cost):
        if not seqs:
            continue
        pairs = float(sum(float(lengths[s]) ** 2 for s in seqs))
        tokens = float(sum(lengths[s] for s in seqs))
        bound = max(bound, max(pair * pairs + token * tokens + end for (pair, token), end in zip(per_stage, ends)))
    return max(bound, 0.0)


def stage_end_s(cost: CostModel, stage_index: int) -> float:
    """Seconds a stage's step surely adds after its last action, whatever the plan: the least exposed
    gradient reduction (it shrinks as the last backward grows, so at an unbounded one) and the
    optimizer step of states in host memory."""
    try:
        sync = cost.compute.gradient_sync_time(stage_index, _UNBOUNDED_S)
    except (ValueError, ZeroDivisionError):  # no reduction buckets on the stage
        sync = 0.0
    tail = cost.state_host.step_tail_s(stage_index)
    return max(sync, 0.0) + max(tail, 0.0)


_UNBOUNDED_S = 1e18
"""A last backward longer than any step: the gradient reduction's exposed part at its least."""
