"""The cost model of one pipeline stage: its time and bytes parts behind one object.

:class:`CostModel` builds, for one model on one profile and parallel layout, the per-GPU seconds
of a stage's actions (:class:`~.compute.StageCompute`), their bytes
(:class:`~.activations.StageActivations`), the checkpoint levels' savings and recompute
(:class:`~.levels.LevelCosts`) and, when the profile measured it, the phase model of working
memory (:class:`~.working.WorkingMemory`), and answers for all of them: the planner, solver,
simulator and validator take one ``cost`` object.  Every time and byte is *per GPU*: with
``sp_degree > 1`` a stage is a group of GPUs sharing each unit (Ulysses SP, :mod:`ulysses`), and
with ``shard != "none"`` its model states are sharded (FSDP2, :mod:`states`; the groups in
:mod:`infinipipe_hf.layout`).
"""
from __future__ import annotations

from functools import cached_property
from typing import Iterable, Sequence

from infinipipe_hf.ir.levels import FULL
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.partition import balanced_layer_split
from infinipipe_hf.ir.units import Segment
from infinipipe_hf.layout import LayoutSpec
from infinipipe_hf.planner.cost.activations import StageActivations
from infinipipe_hf.planner.cost.compute import ComputeCoefficients, StageCompute, UnitShape
from infinipipe_hf.planner.cost.levels import LevelCosts
from infinipipe_hf.planner.cost.profile import HardwareProfile, default_profile
from infinipipe_hf.planner.cost.states import ShardedStates, StatePrecision
from infinipipe_hf.planner.cost.ulysses import UlyssesCost
from infinipipe_hf.planner.cost.working import WorkingMemory

GIB = 1024**3


def unit_cost_map(plan, cost: "CostModel") -> dict:
    """Unit id -> the cost of the SP sub-group it runs on, for the units of ``plan`` that run on a
    sub-group (:meth:`CostModel.for_group`); empty when every unit runs on the whole SP group."""
    return {u: cost.for_group(g.size) for u, g in plan.sp_groups.items() if g.size != plan.sp_degree}


class CostModel:
    """Times (seconds) and bytes of the actions of one stage, per GPU, for one model on one profile.

    ``sp_degree``, ``shard``, ``dp_degree`` and ``gpus_per_node`` (default: the profile's) describe
    the parallel layout (:class:`LayoutSpec`); ``state_precision`` the bytes of model states
    (default: from the profile, :meth:`StatePrecision.from_profile`); ``grad_reduce`` when sharded
    gradients are reduced (``"step"``, as the runtime does; ``"unit"`` is a what-if, see
    :mod:`states`).  ``layers_per_stage`` defaults to :func:`balanced_layer_split` with the
    embedding and head priced on ``reference_tokens``-token units.
    """

    def __init__(self, spec: ModelSpec, profile: HardwareProfile | None = None, *, pp_degree: int = 1,
                 layers_per_stage: Sequence[int] | None = None, memory_budget_bytes: float | None = None,
                 loss_chunk_tokens: int = 4096, reference_tokens: int = 4096, sp_degree: int = 1,
                 shard: str = "none", dp_degree: int = 1, gpus_per_node: int | None = None,
                 state_precision: StatePrecision | None = None, grad_reduce: str = "step",
                 group_size: int | None = None):
        self.spec = spec
        self.profile = p = profile or default_profile()
        self.pp_degree = pp_degree
        self.loss_chunk_tokens = loss_chunk_tokens
        self.layout = LayoutSpec(pp_degree, sp_degree, dp_degree, shard,
                                 p.gpus_per_node if gpus_per_node is None else gpus_per_node)
        self.sp_degree = sp_degree
        self.shard = shard
        self.dp_degree = dp_degree
        self.group_size = sp_degree if group_size is None else int(group_size)
        """SP ranks a unit runs on: the whole SP group, or an aligned sub-group (:meth:`for_group`)."""
        if self.group_size < 1 or sp_degree % self.group_size:
            raise ValueError(f"group_size={group_size!r} must divide sp_degree={sp_degree}")
        self.ulysses: UlyssesCost | None = (UlyssesCost.of(spec, p, self.layout, self.group_size)
                                            if self.group_size > 1 else None)
        coefficients = ComputeCoefficients.of(spec, p, self.ulysses)
        if layers_per_stage is None:
            layers_per_stage = balanced_layer_split(spec.num_layers, pp_degree,
                                                    *coefficients.stage_extras(p, reference_tokens))
        layers_per_stage = list(layers_per_stage)
        if len(layers_per_stage) != pp_degree or sum(layers_per_stage) != spec.num_layers or min(layers_per_stage) < 1:
            raise ValueError(f"layers_per_stage={layers_per_stage} must be {pp_degree} positive counts "
                             f"summing to the model's {spec.num_layers} layers")
        self.layers_per_stage = layers_per_stage
        self.states = ShardedStates(spec, p, self.layout, layers_per_stage, state_precision, grad_reduce)
        if memory_budget_bytes is None:
            memory_budget_bytes = p.memory_gib * GIB
        self.memory_budget_bytes = float(memory_budget_bytes)
        self.acts = StageActivations(spec, p, self.layout, layers_per_stage, self.states,
                                     loss_chunk_tokens=loss_chunk_tokens, ulysses=self.ulysses,
                                     group_size=self.group_size)
        self.compute = StageCompute(coefficients, p, self.layout, layers_per_stage, self.states,
                                    self.acts.hidden_bytes_per_token, group_size=self.group_size)
        self._bind_parts(coefficients)
        self._groups: dict[int, CostModel] = {self.group_size: self}

    def for_group(self, size: int) -> "CostModel":
        """The cost of a unit run on an aligned sub-group of ``size`` of the stage's SP ranks
        (:mod:`infinipipe_hf.ir.rounds`): compute per GPU at ``ceil(T / size)`` tokens, Ulysses
        all-to-alls within the sub-group (none for one rank), the same layer split, memory budget
        and model states (sharded over the whole SP group with ``shard="sp"``).  Cached."""
        size = int(size)
        if size not in self._groups:
            if size < 1 or self.sp_degree % size:
                raise ValueError(f"an SP sub-group of {size} ranks does not divide sp_degree={self.sp_degree}")
            lay = self.layout
            self._groups[size] = CostModel(
                self.spec, self.profile, pp_degree=self.pp_degree, layers_per_stage=self.layers_per_stage,
                memory_budget_bytes=self.memory_budget_bytes, loss_chunk_tokens=self.loss_chunk_tokens,
                sp_degree=self.sp_degree, shard=self.shard, dp_degree=self.dp_degree,
                gpus_per_node=lay.gpus_per_node, state_precision=self.states.precision,
                grad_reduce=self.states.grad_reduce, group_size=size)
            self._groups[size]._groups = self._groups  # every member of the family finds the others
        return self._groups[size]

    def _bind_parts(self, c: ComputeCoefficients) -> None:
        """The parts' figures as this object's own (callers and tests read them here)."""
        a = self.acts
        self._attn_ratio, self._linear_ratio, self._head_ratio = c.attn_ratio, c.linear_ratio, c.head_ratio
        self._act_ratio = a.act_ratio
        self.layer_fwd, self.layer_bwd = c.layer_fwd, c.layer_bwd
        self.head_fwd, self.head_bwd = c.head_fwd, c.head_bwd
        self.embedding_token_s = c.embedding_token_s
        self.act_bytes_per_token = a.act_bytes_per_token
        self.layer_working_bytes_per_token = a.layer_working_bytes_per_token
        self.hidden_bytes_per_token = a.hidden_bytes_per_token
        self.kv_bytes_per_token_per_layer = a.kv_bytes_per_token_per_layer

    @cached_property
    def levels(self) -> LevelCosts:
        """Bytes and recompute seconds of the checkpoint levels inside a layer (:mod:`levels`)."""
        return LevelCosts(self.compute, self.acts)

    @cached_property
    def working(self) -> WorkingMemory | None:
        """Phase model of a running action's working memory, when the profile measured it
        (:mod:`working`); None: :meth:`working_bytes` is the model."""
        return WorkingMemory(self.acts, self.levels) if self.profile.working_bytes_per_token else None

    def gpu_tokens(self, tokens: int) -> int:
        """Tokens of a unit of ``tokens`` on the busiest GPU of a stage (``ceil(tokens / sp)``)."""
        return self.acts.gpu_tokens(tokens)

    def num_layers(self, stage_index: int) -> int:
        return self.layers_per_stage[stage_index]

    # --- time: StageCompute ----------------------------------------------------------------
    def stage_extras(self, tokens: int = 4096) -> tuple[float, float]:
        """Embedding and LM-head+loss costs in decoder-layer equivalents (for partitioning)."""
        return self.compute.stage_extras(tokens)

    def forward_time(self, stage_index: int, shape: UnitShape) -> float:
        return self.compute.forward_time(stage_index, shape)

    def recompute_time(self, stage_index: int, shape: UnitShape, checkpointed_layers: int) -> float:
        """Replay of whole checkpointed layers (their forward less ``down_proj``: :mod:`levels`)."""
        return checkpointed_layers * self.levels.layer_recompute_s(FULL, shape)

    def backward_time(self, stage_index: int, shape: UnitShape, checkpointed_layers: int = 0) -> float:
        """Backward of the stage on the unit, including the recompute of checkpointed layers."""
        return self.compute.backward_time(stage_index, shape,
                                          self.recompute_time(stage_index, shape, checkpointed_layers))

    def slowest_stage_time(self, shape: UnitShape) -> float:
        """``max`` over stages of ``forward_time + backward_time`` (no checkpointing)."""
        return self.compute.slowest_stage_time(shape)

    def transfer_time(self, num_tokens: int) -> float:
        """One unit's hidden states to the next stage: each GPU sends its own token shard."""
        return self.compute.transfer_time(num_tokens)

    def message_cpu_time(self, num_tokens: int) -> float:
        """CPU seconds one unit's hidden-state message costs its two ends together."""
        return self.compute.message_cpu_time(num_tokens)

    def gradient_sync_time(self, stage_index: int, last_backward_s: float) -> float:
        """Exposed seconds of the step's gradient reduction on the stage after its last backward."""
        return self.compute.gradient_sync_time(stage_index, last_backward_s)

    # --- bytes: StageActivations -----------------------------------------------------------
    def stage_params(self, stage_index: int) -> int:
        return self.acts.stage_params(stage_index)

    def static_bytes(self, stage_index: int) -> float:
        """Model states of the stage per GPU (weights, gradients, optimizer states)."""
        return self.acts.static_bytes(stage_index)

    def activation_bytes(self, stage_index: int, tokens: int, checkpointed_layers: int) -> float:
        """Bytes a unit keeps alive on the stage from its forward to its backward."""
        return self.acts.activation_bytes(stage_index, tokens, checkpointed_layers)

    def activation_bytes_per_checkpointed_layer(self, stage_index: int, tokens: int) -> float:
        """Bytes saved by checkpointing one more layer of the unit (the solver's slope)."""
        return self.acts.activation_bytes_per_checkpointed_layer(stage_index, tokens)

    def context_bytes_per_layer(self, segments: Iterable[Segment]) -> float:
        """Extra bytes one non-checkpointed layer saves for segments that attend to context."""
        return self.acts.context_bytes_per_layer(segments)

    def unit_activation_bytes(self, stage_index: int, segments: Sequence[Segment],
                              checkpointed_layers: int) -> float:
        """:meth:`activation_bytes` of a unit with these segments, context copies included."""
        return self.acts.unit_activation_bytes(stage_index, segments, checkpointed_layers)

    def unit_checkpoint_saving(self, stage_index: int, segments: Sequence[Segment]) -> float:
        """Bytes saved by checkpointing one more layer of a unit with these segments."""
        return self.acts.unit_checkpoint_saving(stage_index, segments)

    def kv_bytes(self, stage_index: int, continuing_tokens: int) -> float:
        """KV-store bytes for tokens whose K/V later slices need: K/V plus pending gradients."""
        return self.acts.kv_bytes(stage_index, continuing_tokens)

    def working_bytes(self, stage_index: int, tokens: int, checkpointed_layers: int, backward: bool) -> float:
        """Transient bytes while the unit's forward or backward runs on the stage (linear bound)."""
        return self.acts.working_bytes(stage_index, tokens, checkpointed_layers, backward)
