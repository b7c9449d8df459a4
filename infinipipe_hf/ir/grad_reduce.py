"""When a sharded stage reduces its gradients: once per step, or after every unit's backward.

``step``: FSDP2's gradient sync is off while the step's units run; every parameter's unsharded
fp32 gradient accumulates until the stage's last backward, then one reduce-scatter (fewest
collectives, largest memory).  ``unit``: every backward reduce-scatters its gradients into the
sharded ``.grad``, so no unsharded gradient outlives a unit (what ZeRO-3 and FlexSP do; one
reduce-scatter per unit and layer).  ``auto`` (planner option only): the planner prices both
where ``unit`` can run and keeps the faster plan; the plan records the pick (``Plan.grad_reduce``)
and the runtime follows the plan.

``unit`` needs every rank of the FSDP group to run the same backwards in the same order, so its
reduce-scatters pair up.  The SP ranks of a stage do: they run one action list, and with elastic
SP rounds each rank runs exactly one unit per round (the rounds' sub-groups partition the SP
ranks, ``ir.sp_rounds.check_rounds``) and a round's backwards are consecutive with one checkpoint
mix (the validator).  DP replicas do not (their unit lists differ), so a group spanning replicas
(``dp``, ``sp+dp``, and ``hybrid``'s all-reduce over DP) refuses it unless ``dp_degree`` is 1.
"""
from __future__ import annotations

GRAD_REDUCE_CHOICES = ("auto", "step", "unit")
"""Accepted settings; plans hold ``step`` or ``unit``."""


def check_grad_reduce(value: str, *, allow_auto: bool = True) -> str:
    """``value`` when it is a known setting, else ``ValueError`` naming the choices."""
    choices = GRAD_REDUCE_CHOICES if allow_auto else GRAD_REDUCE_CHOICES[1:]
    if value not in choices:
        raise ValueError(f"grad_reduce={value!r} is not known; use {', '.join(map(repr, choices))} ('step': "
                         f"reduce-scatter once per step; 'unit': after every unit's backward"
                         + ("; 'auto': the planner's choice)" if allow_auto else ")"))
    return value


def unit_reduce_problem(dims) -> str | None:
    """Why ``grad_reduce="unit"`` cannot run on the layout ``dims`` (``ParallelDims``), or ``None``."""
    mode = dims.shard
    if not mode.sharded:
        return (f"grad_reduce='unit' reduce-scatters sharded gradients, but shard={mode.name!r} keeps whole "
                f"states on every rank; shard over SP (shard='sp') or use grad_reduce='step'")
    spans_dp = "dp" in mode.shard_dims or mode.hsdp
    if spans_dp and dims.dp_degree > 1:
        return (f"grad_reduce='unit' needs every rank of the shard group to run the same backwards in the "
                f"same order, but shard={mode.name!r} at dp_degree={dims.dp_degree} reduces over DP replicas, "
                f"whose unit lists differ (the collectives would not pair up); use shard='sp' (DP replicas "
                f"then sum once per step) or grad_reduce='step'")
    return None
