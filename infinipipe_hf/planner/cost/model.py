"""The cost model of one pipeline stage: its parts, built from one shared stage context.

:class:`StageContext` is everything a stage's costs depend on: the model, the hardware profile,
the job's :class:`~infinipipe_hf.layout.ParallelDims`, the layer split, the memory budget, the SP
ranks a unit runs on.  :class:`CostModel` holds one context and builds its *parts* from it, each
on first use: ``coefficients`` (the per-layer time fits), ``ulysses`` (SP all-to-alls, ``None``
on one rank), ``states`` (model states, sharded or not: :mod:`states`), ``state_host`` (their
host memory and CPU optimizer step when offloaded: :mod:`state_host`), ``acts`` (activation,
KV and working bytes), ``compute`` (seconds per action), ``levels`` (checkpoint levels inside a
layer), ``working`` (the phase model of working memory, when the profile measured it) and
``host`` (offloaded layer inputs and KV stores in host memory: :mod:`host`).  A part
is a class with a ``from_stage(ctx, cost)`` constructor; adding a mechanism is its module plus
one :func:`stage_part` line here.  Callers ask the part (``cost.compute.forward_time``,
``cost.acts.static_bytes``); the model itself only composes what spans parts
(:meth:`CostModel.backward_time`: compute plus the recompute the levels price).

Every time and byte is *per GPU*: with ``sp_degree > 1`` a stage is a group of GPUs sharing each
unit (Ulysses SP, :mod:`ulysses`), and with a sharding shard mode its model states are sharded
(FSDP2, :mod:`states`; the groups in :mod:`infinipipe_hf.layout`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

from infinipipe_hf.ir.levels import FULL
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.partition import balanced_layer_split
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.activations import StageActivations
from infinipipe_hf.planner.cost.compute import ComputeCoefficients, StageCompute, UnitShape
from infinipipe_hf.planner.cost.host import HostTierCost
from infinipipe_hf.planner.cost.levels import LevelCosts
from infinipipe_hf.planner.cost.profile import HardwareProfile, default_profile
from infinipipe_hf.planner.cost.state_host import StateHostCost
from infinipipe_hf.planner.cost.states import GRAD_REDUCE_MODES, ShardedStates, StatePrecision
from infinipipe_hf.planner.cost.ulysses import UlyssesCost
from infinipipe_hf.planner.cost.working import WorkingMemory

GIB = 1024**3


@dataclass(frozen=True)
class StageContext:
    """What every part of a stage's cost model is built from."""

    spec: ModelSpec
    """The model (sizes from its HF config)."""
    profile: HardwareProfile
    """Per-layer costs, bytes, bandwidths of the hardware."""
    dims: ParallelDims
    """The job's layout: degrees, shard mode, node size."""
    layers_per_stage: tuple[int, ...]
    """Decoder layers of each stage."""
    memory_budget_bytes: float
    """Memory per GPU a plan must stay under."""
    state_precision: StatePrecision
    """Bytes of model states per parameter (weights, gradients, optimizer states)."""
    loss_chunk_tokens: int = 4096
    """Tokens per LM-head + loss chunk on the last stage."""
    group_size: int = 1
    """SP ranks a unit runs on: the stage's whole SP group, or an aligned sub-group of it."""
    grad_reduce: str = "step"
    """When sharded gradients are reduced: ``step`` (once per step) or ``unit`` (after every backward)."""
    host_budget_bytes: float = 0.0
    """Host memory per GPU a plan may hold (offloaded activations, KV store, states); 0: no host tier."""

    def __post_init__(self) -> None:
        layers = self.layers_per_stage
        pp = self.dims.pp_degree
        if len(layers) != pp or sum(layers) != self.spec.num_layers or min(layers) < 1:
            raise ValueError(f"layers_per_stage={list(layers)} must be {pp} positive counts summing to the "
                             f"model's {self.spec.num_layers} layers")
        if self.group_size < 1 or self.dims.sp_degree % self.group_size:
            raise ValueError(f"an SP sub-group of {self.group_size} ranks does not divide "
                             f"sp_degree={self.dims.sp_degree}")
        if self.grad_reduce not in GRAD_REDUCE_MODES:
            raise ValueError(f"grad_reduce={self.grad_reduce!r} is not known; use 'step' (reduce-scatter once "
                             f"per step) or 'unit' (after every backward)")
        if not self.host_budget_bytes >= 0:
            raise ValueError(f"host_budget_bytes={self.host_budget_bytes!r} must be >= 0 (0: no host tier)")


def stage_part(build: Callable[[StageContext, "CostModel"], object]) -> cached_property:
    """A part of :class:`CostModel`, built from its context (and other parts) on first use."""
    return cached_property(lambda cost: build(cost.ctx, cost))


class UnitMemo(dict):
    """A bounded memo of per-unit facts: emptied when it reaches ``UNIT_MEMO_LIMIT`` entries (a
    cost model that plans batch after batch would otherwise keep every unit it saw), and pickled
    empty (a cost model sent to a worker process)."""

    def __setitem__(self, key, value) -> None:
        if len(self) >= UNIT_MEMO_LIMIT:
            self.clear()
        super().__setitem__(key, value)

    def __reduce__(self):
        return (UnitMemo, ())


UNIT_MEMO_LIMIT = 200_000
"""Most entries a :class:`UnitMemo` keeps."""


def unit_cost_map(plan, cost: "CostModel") -> dict:
    """Unit id -> the cost of the SP sub-group it runs on, for the units of ``plan`` that run on a
    sub-group (:meth:`CostModel.for_group`); empty when every unit runs on the whole SP group."""
    return {u: cost.for_group(g.size) for u, g in plan.sp_groups.items() if g.size != plan.sp_degree}


class CostModel:
    """Times (seconds) and bytes of the actions of one stage, per GPU (module docstring).

    ``dims`` (default: one GPU) is the job's layout; ``layers_per_stage`` defaults to
    :func:`balanced_layer_split` with the embedding and head priced on ``reference_tokens``-token
    units; ``memory_budget_bytes`` to the profile's memory; ``state_precision`` to the profile's
    (:meth:`StatePrecision.from_profile`); ``grad_reduce`` to ``"step"``.
    """

    ulysses = stage_part(UlyssesCost.from_stage)
    coefficients = stage_part(ComputeCoefficients.from_stage)
    states = stage_part(ShardedStates.from_stage)
    acts = stage_part(StageActivations.from_stage)
    compute = stage_part(StageCompute.from_stage)
    levels = stage_part(LevelCosts.from_stage)
    working = stage_part(WorkingMemory.from_stage)
    host = stage_part(HostTierCost.from_stage)
    state_host = stage_part(StateHostCost.from_stage)
    unit_memo = cached_property(lambda cost: UnitMemo())
    """Facts of units on this cost's stages the planner's memory walk asks for repeatedly
    (:func:`~infinipipe_hf.planner.checkpointing.memory_walk._memoized_unit`)."""

    def __init__(self, spec: ModelSpec, profile: HardwareProfile | None = None, dims: ParallelDims | None = None,
                 *, layers_per_stage=None, memory_budget_bytes: float | None = None, loss_chunk_tokens: int = 4096,
                 reference_tokens: int = 4096, state_precision: StatePrecision | None = None,
                 grad_reduce: str = "step", host_budget_bytes: float = 0.0):
        p = profile or default_profile()
        dims = ParallelDims() if dims is None else dims
        if layers_per_stage is None:
            ulysses = UlyssesCost.of(spec, p, dims) if dims.sp_degree > 1 else None
            extras = ComputeCoefficients.of(spec, p, ulysses).stage_extras(p, reference_tokens)
            layers_per_stage = balanced_layer_split(spec.num_layers, dims.pp_degree, *extras)
        self.ctx = StageContext(spec, p, dims, tuple(int(n) for n in layers_per_stage),
                                float(p.memory_gib * GIB if memory_budget_bytes is None else memory_budget_bytes),
                                state_precision or StatePrecision.from_profile(p), loss_chunk_tokens,
                                dims.sp_degree, grad_reduce, float(host_budget_bytes or 0.0))
        self._family: dict[int, CostModel] = {dims.sp_degree: self}

    @classmethod
    def of_context(cls, ctx: StageContext, family: dict | None = None) -> "CostModel":
        cost = cls.__new__(cls)
        cost.ctx = ctx
        cost._family = {ctx.group_size: cost} if family is None else family
        return cost

    def for_group(self, size: int) -> "CostModel":
        """The cost of a unit run on an aligned sub-group of ``size`` of the stage's SP ranks
        (:mod:`infinipipe_hf.ir.sp_rounds`): compute per GPU at ``ceil(T / size)`` tokens, Ulysses
        all-to-alls within the sub-group (none for one rank), the same layer split, memory budget
        and model states (sharded over the whole SP group with shard ``sp``).  Cached."""
        size = int(size)
        if size not in self._family:
            self._family[size] = CostModel.of_context(dataclasses.replace(self.ctx, group_size=size), self._family)
        return self._family[size]

    def for_plan(self, plan) -> "CostModel":
        """This cost as ``plan`` was priced: a sharded plan marked ``grad_reduce="unit"``
        (``ir.grad_reduce``) is replayed and checked with per-unit reduction.  Only towards
        ``unit``: plans under construction carry the default ``step`` whatever they are priced
        with, so a cost built with ``unit`` is kept."""
        if getattr(plan, "grad_reduce", "step") != "unit" or self.ctx.grad_reduce == "unit" \
                or not self.dims.shard.sharded:
            return self
        return CostModel.of_context(dataclasses.replace(self.ctx, grad_reduce="unit"))

    # --- the context ---------------------------------------------------------------------
    @property
    def spec(self) -> ModelSpec:
        return self.ctx.spec

    @property
    def profile(self) -> HardwareProfile:
        return self.ctx.profile

    @property
    def dims(self) -> ParallelDims:
        return self.ctx.dims

    @property
    def layers_per_stage(self) -> list[int]:
        return list(self.ctx.layers_per_stage)

    @property
    def memory_budget_bytes(self) -> float:
        return self.ctx.memory_budget_bytes

    @property
    def host_budget_bytes(self) -> float:
        """Host memory per GPU a plan may hold (0: no host tier)."""
        return self.ctx.host_budget_bytes

    @property
    def loss_chunk_tokens(self) -> int:
        return self.ctx.loss_chunk_tokens

    @property
    def group_size(self) -> int:
        """SP ranks a unit runs on: the whole SP group, or an aligned sub-group (:meth:`for_group`)."""
        return self.ctx.group_size

    def num_layers(self, stage_index: int) -> int:
        return self.ctx.layers_per_stage[stage_index]

    def shape_of(self, segments) -> UnitShape:
        """A unit's :class:`UnitShape` as this profile's attention kernel counts its pairs."""
        return UnitShape.of(segments, self.ctx.profile.context_pairs)

    # --- what spans parts --------------------------------------------------------------------
    def recompute_time(self, stage_index: int, shape: UnitShape, checkpointed_layers: int) -> float:
        """Replay of whole checkpointed layers (their forward less ``down_proj``: :mod:`levels`)."""
        return checkpointed_layers * self.levels.layer_recompute_s(FULL, shape)

    def backward_time(self, stage_index: int, shape: UnitShape, checkpointed_layers: int = 0) -> float:
        """Backward of the stage on the unit, including the recompute of checkpointed layers."""
        return self.compute.backward_time(stage_index, shape,
                                          self.recompute_time(stage_index, shape, checkpointed_layers))
