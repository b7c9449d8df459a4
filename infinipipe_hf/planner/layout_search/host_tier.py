"""The host tier in the layout search: which state-offload modes a layout is planned with, and
the host peak of a plan.

With a host budget (bytes per GPU; 0: no host tier) every layout of degrees and shard mode is
also a layout per state-offload mode (:data:`~infinipipe_hf.layout.STATE_OFFLOADS`), enumerated
like shard modes but pruned, since each mode moves states off the device at a price per step:
``optimizer`` is planned only where the layout's states take more than ``STATES_SHARE`` of the
GPU budget, and ``states`` only where ``optimizer`` still leaves them above that share and the
runtime runs it (:func:`offload_runs`) (:func:`with_offload_modes`).  Without a host budget only
``none`` is planned.
"""
from __future__ import annotations

from typing import Callable, Sequence

from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.layout.state_offload import STATE_OFFLOADS
from infinipipe_hf.planner.registry import ALTERNATIVES, get_schedule

STATES_SHARE = 0.25
"""A layout's states taking more than this share of the GPU budget make the next state-offload
mode worth planning (a long sequence's activations want the rest)."""


def offload_modes(host_budget_bytes: float, asked: Sequence[str] | None = None) -> tuple[str, ...]:
    """The state-offload modes a search may plan: ``asked`` (all without), ``none`` only without a
    host tier (``ValueError`` when an offloading mode is asked for without one)."""
    modes = tuple(STATE_OFFLOADS if asked is None else asked)
    for m in modes:
        if m not in STATE_OFFLOADS:
            raise ValueError(f"state_offload={m!r} is not known; use one of {', '.join(STATE_OFFLOADS)}")
    if host_budget_bytes > 0:
        return modes
    if asked is not None and any(m != "none" for m in modes):
        raise ValueError(f"state_offload in {modes} keeps model states in host memory, but the host budget is 0 "
                         f"(no host tier); give the host memory per GPU (--host-memory-gib / host_memory_gib)")
    return ("none",)


def with_offload_modes(layouts: Sequence[ParallelDims], modes: Sequence[str],
                       states_bytes: Callable[[ParallelDims], float], budget_bytes: float) -> list[ParallelDims]:
    """``layouts`` once per state-offload mode in ``modes`` worth planning: each mode is kept
    while the previous one (in ``STATE_OFFLOADS`` order) leaves its states above
    ``STATES_SHARE`` of ``budget_bytes`` (``states_bytes(layout)``: states per GPU on the
    fullest stage under the layout's mode).  A restriction to one mode keeps that mode."""
    out = []
    for lay in layouts:
        kept = []
        for m in STATE_OFFLOADS:
            if m not in modes:
                continue
            dims = lay if lay.state_offload.name == m else _replace_mode(lay, m)
            if not offload_runs(dims):
                continue
            if kept and len(modes) > 1 and states_bytes(kept[-1]) <= STATES_SHARE * budget_bytes:
                break  # the lighter mode already leaves room: offloading more only costs time
            kept.append(dims)
        out.extend(kept)
    return out


def offload_runs(dims: ParallelDims) -> bool:
    """Whether the runtime runs ``dims``' state offload: weights on host go through FSDP2's
    ``CPUOffloadPolicy``, over the shard group, or over each rank alone when a stage is one rank
    with no replica (``sp_degree = dp_degree = 1``; the runtime refuses unsharded ``states`` else)."""
    if not dims.state_offload.weights_on_host or dims.shard.sharded:
        return True
    return dims.sp_degree == 1 and dims.dp_degree == 1


def _replace_mode(dims: ParallelDims, mode: str) -> ParallelDims:
    return ParallelDims(dims.pp_degree, dims.sp_degree, dims.dp_degree, dims.shard, dims.gpus_per_node, mode)


def host_peak_bytes(result) -> float:
    """The host peak of a plan result (0.0 without a host tier or without a plan)."""
    if result is None:
        return 0.0
    value = result.summary().get("host_peak_memory_bytes")
    if value is None and result.plan is not None:
        value = getattr(result.plan, "info", {}).get("host_peak_memory_bytes")
    return float(value or 0.0)


def alternative_knobs(schedule: str, host_budget_bytes: float) -> dict:
    """Keyword arguments of ``plan_alternative`` for ``schedule`` beside the batch: the host budget
    for the alternatives that use host memory (``uses_host_tier``)."""
    if getattr(get_schedule(schedule), "uses_host_tier", False):
        return {"host_budget_bytes": float(host_budget_bytes)}
    return {}


def planned_alternatives(host_budget_bytes: float) -> tuple[str, ...]:
    """The non-pipeline alternatives to compare with: those that need host memory (``alst``) only
    when there is a host tier."""
    return tuple(n for n in ALTERNATIVES if host_budget_bytes > 0 or not getattr(get_schedule(n), "uses_host_tier",
                                                                                  False))
