"""Model states of a stage per rank, sharded or not, and the collectives sharding adds.

Bytes.  A stage's parameters are the tensors the runtime keeps on it: each decoder layer's
q/k/v/o and gate/up/down projections and two norms, the embedding on the first stage, the final
norm and LM head on the last (a tied head on a one-stage pipeline is the embedding itself).
Unsharded, a rank holds ``state_bytes_per_param`` per parameter (fp32 weights + fp32 gradients +
two fp32 Adam moments = 16; bf16 mixed precision keeps fp32 masters, so also 16: the profile's
figure).  FSDP2 (``fully_shard``) splits every tensor along dim 0 over the shard group, padding it
to a multiple of the group: a rank holds ``ceil(rows / g)`` rows of each (:func:`stage_state_bytes_per_rank`,
the figure to compare with parameter + gradient + optimizer bytes summed over a rank's local
shards after a step).

Peak during a step (:meth:`ShardedStates.peak_static_bytes`), what the runtime does:
- weights and optimizer moments stay sharded;
- gradients accumulate over all of the step's units and are reduce-scattered once, after the
  stage's last backward (FSDP2 with gradient sync off until then).  Until that reduce-scatter,
  FSDP2 keeps each parameter's *unsharded* gradient in the reduce dtype (fp32): 4 bytes per
  parameter of the whole stage, not divided by the shard degree.  This is the price of reducing
  once per step instead of once per unit;
- the layer running now and the next one (prefetched) are gathered unsharded in the compute dtype
  (bf16 under mixed precision), plus, in backward, the running layer's unsharded gradient in that
  dtype before it is added to the fp32 accumulator: three copies of the largest FSDP unit.

Time.  Every forward gathers each FSDP unit (decoder layer; embedding; final norm + head) of the
stage (reshard after forward) and every backward gathers them again.  FSDP2 issues the next unit's
all-gather while the current one computes, so an action costs ``one gather (the largest unit's) +
max(compute, all-gathers of the stage)`` (:meth:`ShardedStates.overlapped`): only the first
gather shows when compute dominates, the gathers when they do.  The reduce-scatter (fp32
gradients) of each unit, plus the all-reduce of its shard over the replica group when there is
one, runs once per step, behind the stage's last backward: a chain of ``n`` per-unit reductions
of ``r`` seconds each behind ``n`` units of backward compute shows ``max(r, n r - (n - 1) c)``
(:meth:`ShardedStates.gradient_sync_time`).  Unsharded stages all-reduce their whole gradient after
the last backward, not overlapped (the runtime's gradient sync does exactly that).  Assumed: the
gathers of one action do not slow its compute, and gathers and reductions do not contend.

Shard groups that span DP replicas (``"dp"``, ``"sp+dp"``).  Replicas run different unit lists,
so the runtime cannot all-gather per unit over them (the collectives would not line up): it
gathers every FSDP unit once when the step starts and reshards after the reduction.  Such a stage
holds its whole unsharded weights (compute dtype) during the step instead of three working
copies, and pays the gathers once per step, exposed before its first forward
(:attr:`ShardedStates.gathers_per_step`).

``grad_reduce="unit"`` (the runtime's per-unit reduction, ``ir.grad_reduce``; the planner picks
it per layout): every backward reduce-scatters its gradients, so no unsharded gradient outlives a
unit (one unit's fp32 gradient is the reduce-scatter's input) at the price of a reduce-scatter per
unit and layer, overlapped with the backward like the gathers, the last one exposed.

State offload (``dims.state_offload``; host bytes and the CPU optimizer step: :mod:`state_host`).
``optimizer``: the device keeps weights and gradients, not the ``optimizer_bytes_per_param``.
``states``: it keeps no shard; every action copies each unit's weight shard up before gathering it
(``fetch_s``, at ``host_bandwidth_bytes_per_s``), every backward reduces each unit's gradient and
copies its shard down to be added to the host's accumulated gradient (``drain_s``; the add is
memory-bound like the CPU optimizer's step, so it runs :data:`ADD_OVER_ADAMW` times the step's
parameter rate), in the chain the gathers overlap compute in.  So it holds
the three working copies, one unit's gradient and one fetched shard (:func:`unit_reduced_state_bytes`).
Shard groups that span DP replicas fetch and gather once per step instead.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims, StateOffload
from infinipipe_hf.planner.cost.calibration import overlap_terms, overlapped_with
from infinipipe_hf.planner.cost.collectives import all_gather_time, all_reduce_time, reduce_scatter_time
from infinipipe_hf.planner.cost.profile import HardwareProfile

GRAD_REDUCE_MODES = ("step", "unit")


@dataclass(frozen=True)
class StatePrecision:
    """Bytes per parameter of the model states and of the copies sharding makes."""

    state_bytes_per_param: float = 16.0
    """Weights + gradients + optimizer states kept per parameter (fp32 AdamW: 4 + 4 + 8)."""
    grad_bytes_per_param: float = 4.0
    """The gradient's part of ``state_bytes_per_param`` (fp32)."""
    compute_bytes_per_param: float = 4.0
    """The unsharded copy a sharded unit is gathered into (4 in fp32, 2 under bf16 mixed precision)."""
    reduce_bytes_per_param: float = 4.0
    """Gradients as they are accumulated and reduced (fp32 reduction)."""
    optimizer_bytes_per_param: float = 8.0
    """The optimizer's part of ``state_bytes_per_param`` (AdamW's two fp32 moments: 8): what the
    ``optimizer`` state offload moves to host memory besides the fp32 master weights."""

    def __post_init__(self) -> None:
        for name in ("state_bytes_per_param", "grad_bytes_per_param", "compute_bytes_per_param",
                     "reduce_bytes_per_param"):
            if not getattr(self, name) > 0:
                raise ValueError(f"StatePrecision.{name} must be > 0, got {getattr(self, name)!r}")
        if self.grad_bytes_per_param > self.state_bytes_per_param:
            raise ValueError(f"grad_bytes_per_param={self.grad_bytes_per_param} exceeds "
                             f"state_bytes_per_param={self.state_bytes_per_param}")
        if not 0 <= self.optimizer_bytes_per_param <= self.state_bytes_per_param - self.grad_bytes_per_param:
            raise ValueError(f"optimizer_bytes_per_param={self.optimizer_bytes_per_param} must be in [0, "
                             f"state_bytes_per_param - grad_bytes_per_param = "
                             f"{self.state_bytes_per_param - self.grad_bytes_per_param}]")

    @property
    def weight_bytes_per_param(self) -> float:
        """The weights' part of the states (what is neither gradient nor optimizer state: fp32, 4)."""
        return self.state_bytes_per_param - self.grad_bytes_per_param - self.optimizer_bytes_per_param

    def kept_bytes_per_param(self, offload: StateOffload) -> float:
        """Device bytes per parameter of a rank's shard kept through a step, gradients apart: weights
        and optimizer states; weights (``optimizer`` offload); nothing (``states`` offload)."""
        if offload.weights_on_host:
            return 0.0
        kept = self.state_bytes_per_param - self.grad_bytes_per_param
        return kept - self.optimizer_bytes_per_param if offload.optimizer_on_host else kept

    @staticmethod
    def from_profile(profile: HardwareProfile) -> "StatePrecision":
        """The profile's states (``state_bytes_per_param``), gathered in its activation dtype; AdamW's
        8 bytes of moments, or less when the profile's states leave less beside the gradient."""
        state = profile.state_bytes_per_param
        return StatePrecision(state, 4.0, float(profile.bytes_per_element), 4.0, min(8.0, max(0.0, state - 4.0)))


FP32_ADAM = StatePrecision(16.0, 4.0, 4.0, 4.0)
"""fp32 weights, gradients and AdamW moments; layers gathered in fp32."""
BF16_MIXED_ADAM = StatePrecision(16.0, 4.0, 2.0, 4.0)
"""bf16 compute with fp32 masters, gradients and AdamW moments (the shipped H100 profile)."""


def layer_param_shapes(spec: ModelSpec) -> list[tuple[int, ...]]:
    """Shapes of one decoder layer's parameters (sums to ``spec.layer_params``)."""
    h, q, kv, i = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size
    return [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i), (h,), (h,)]


def stage_param_shapes(spec: ModelSpec, num_layers: int, *, embedding: bool, head: bool,
                       head_is_embedding: bool = False) -> list[list[tuple[int, ...]]]:
    """Parameter shapes of a stage grouped by FSDP unit: [embedding], layers..., [norm + head]."""
    units: list[list[tuple[int, ...]]] = []
    if embedding:
        units.append([(spec.vocab_size, spec.hidden_size)])
    units.extend(layer_param_shapes(spec) for _ in range(num_layers))
    if head:
        units.append([(spec.hidden_size,)] + ([] if head_is_embedding else [(spec.vocab_size, spec.hidden_size)]))
    return units


def sharded_numel(shapes: Sequence[tuple[int, ...]], shard_degree: int) -> int:
    """Elements one rank holds of ``shapes`` sharded on dim 0 over ``shard_degree`` ranks (padded)."""
    total = 0
    for shape in shapes:
        rest = 1
        for d in shape[1:]:
            rest *= d
        total += -(-shape[0] // shard_degree) * rest
    return total


def unit_reduced_state_bytes(offload: StateOffload, shard_numel: Sequence[int], numel: Sequence[int],
                              precision: StatePrecision, working: float | None = None) -> float:
    """Device bytes of a rank's states during a step when every backward reduces its units'
    gradients (``grad_reduce="unit"``, ZeRO-3, ``states`` offload), ``shard_numel`` / ``numel`` the elements
    of each FSDP unit on the rank / unsharded: the kept shard (:meth:`StatePrecision.kept_bytes_per_param`)
    and its gradient (on host with ``states`` offload), the gathered copies (``working``; default
    three of the largest unit in the compute dtype), the largest unit's gradient in the reduce
    dtype and, with ``states`` offload, one shard fetched up in the weights' dtype."""
    p, on_host, largest = precision, offload.weights_on_host, max(numel)
    kept = sum(shard_numel) * (p.kept_bytes_per_param(offload) + (0.0 if on_host else p.grad_bytes_per_param))
    working = 3 * largest * p.compute_bytes_per_param if working is None else working
    return kept + working + largest * p.reduce_bytes_per_param + (max(shard_numel) * p.weight_bytes_per_param
                                                                 if on_host else 0.0)


def host_fetch_s(shard_numel: Sequence[int], precision: StatePrecision, profile: HardwareProfile) -> list[float]:
    """Seconds to copy each unit's shard of weights (``shard_numel``: elements) up from host memory."""
    return [n * precision.weight_bytes_per_param / profile.host_bandwidth_bytes_per_s for n in shard_numel]


ADD_OVER_ADAMW = 28 / 12
"""How many parameters a memory-bound CPU gradient add covers in the time an AdamW step takes for one:
fp32 AdamW reads weight, gradient and two moments and writes three (28 bytes per parameter), the
add reads two gradients and writes one (12 bytes)."""


def host_drain_s(shard_numel: Sequence[int], precision: StatePrecision, profile: HardwareProfile) -> list[float]:
    """Seconds to copy each unit's reduced gradient shard down and add it to the host's accumulated
    gradient (the add at :data:`ADD_OVER_ADAMW` times the CPU optimizer's rate, module docstring)."""
    bw, rate = profile.host_bandwidth_bytes_per_s, profile.host_optimizer_params_per_s * ADD_OVER_ADAMW
    return [n * precision.reduce_bytes_per_param / bw + n / rate for n in shard_numel]


def stage_state_bytes_per_rank(spec: ModelSpec, num_layers: int, *, embedding: bool, head: bool,
                               shard_degree: int = 1, precision: StatePrecision = FP32_ADAM,
                               head_is_embedding: bool = False) -> float:
    """Weights + gradients + optimizer states one rank holds for a stage between steps.

    ``embedding`` / ``head``: the stage holds the input embedding / the final norm and LM head
    (``head_is_embedding``: a tied head on the same stage, so no second matrix).  Dtype-aware
    through ``precision`` (:data:`FP32_ADAM`, :data:`BF16_MIXED_ADAM` or
    :meth:`StatePrecision.from_profile`).
    """
    if int(shard_degree) != shard_degree or shard_degree < 1:
        raise ValueError(f"shard_degree must be a positive integer, got {shard_degree!r}")
    units = stage_param_shapes(spec, num_layers, embedding=embedding, head=head,
                               head_is_embedding=head_is_embedding)
    return sum(sharded_numel(u, shard_degree) for u in units) * precision.state_bytes_per_param


class ShardedStates:
    """Memory and collective times of one stage layout's sharded states (module docstring)."""

    def __init__(self, spec: ModelSpec, profile: HardwareProfile, dims: ParallelDims,
                 layers_per_stage: Sequence[int], precision: StatePrecision | None = None,
                 grad_reduce: str = "step"):
        if grad_reduce not in GRAD_REDUCE_MODES:
            raise ValueError(f"grad_reduce={grad_reduce!r} is not known; use 'step' (reduce-scatter once "
                             f"per step) or 'unit' (after every backward)")
        self.grad_reduce = grad_reduce
        self._peak: dict[int, float] = {}
        self._overlap_terms: dict[tuple[int, bool], tuple] = {}
        self.dims = dims
        self.precision = precision or StatePrecision.from_profile(profile)
        self.calibration = profile.calibration
        pp = dims.pp_degree
        head_is_embedding = spec.tie_word_embeddings and pp == 1
        self.units = [stage_param_shapes(spec, n, embedding=s == 0, head=s == pp - 1,
                                         head_is_embedding=head_is_embedding)
                      for s, n in enumerate(layers_per_stage)]
        self.unit_numel = [[sharded_numel(u, 1) for u in units] for units in self.units]
        g = dims.shard_degree
        bw = (profile.inter_node_bandwidth_bytes_per_s if dims.shard_crosses_nodes
              else profile.intra_node_bandwidth_bytes_per_s)
        rep_bw = (profile.inter_node_bandwidth_bytes_per_s if dims.replica_crosses_nodes
                  else profile.intra_node_bandwidth_bytes_per_s)
        lat = profile.collective_latency_s
        p = self.precision
        self.gather_s = [[all_gather_time(n * p.compute_bytes_per_param, g, bw, lat) for n in numel]
                         for numel in self.unit_numel]
        # Reduce-scatter of each unit's fp32 gradient, then all-reduce of the shard over the replicas.
        self.reduce_s = [[reduce_scatter_time(n * p.reduce_bytes_per_param, g, bw, lat)
                          + all_reduce_time(n * p.reduce_bytes_per_param / g, dims.replica_degree, rep_bw, lat)
                          for n in numel] for numel in self.unit_numel]
        # Unsharded: one all-reduce of the stage's gradient over its SP x DP ranks.
        self.allreduce_s = [all_reduce_time(sum(numel) * p.reduce_bytes_per_param, dims.replica_degree,
                                            rep_bw, lat) for numel in self.unit_numel]
        self.offload = dims.state_offload
        self.shard_numel = [[sharded_numel(u, g) for u in units] for units in self.units]
        """Elements of each FSDP unit one rank holds (all of them unsharded)."""
        self._host_copies(profile)

    def _host_copies(self, profile: HardwareProfile) -> None:
        """Per-unit host copies of ``states`` offload (module docstring) and the chains an action
        overlaps with its compute: ``action_gathers`` (gathers, after fetches), ``action_reduces``."""
        on_host = self.offload.weights_on_host
        self.fetch_s = [host_fetch_s(shard, self.precision, profile) if on_host else [0.0] * len(shard)
                        for shard in self.shard_numel]
        self.drain_s = [host_drain_s(shard, self.precision, profile) if on_host else [0.0] * len(shard)
                        for shard in self.shard_numel]
        if not on_host:
            self.action_gathers, self.action_reduces = self.gather_s, self.reduce_s
            return
        self.action_gathers = [[a + b for a, b in zip(g, f)] for g, f in zip(self.gather_s, self.fetch_s)]
        self.action_reduces = [[a + b for a, b in zip(r, d)] for r, d in zip(self.reduce_s, self.drain_s)]

    @staticmethod
    def from_stage(ctx, cost) -> "ShardedStates":
        """The stage's part (:mod:`.model`): states live on the whole SP group, whichever
        sub-group a unit runs on."""
        return ShardedStates(ctx.spec, ctx.profile, ctx.dims, ctx.layers_per_stage, ctx.state_precision,
                             ctx.grad_reduce)

    @cached_property
    def sharded(self) -> bool:
        return self.dims.shard_degree > 1

    @cached_property
    def gathers_per_step(self) -> bool:
        """The shard group spans DP replicas: parameters are gathered once per step, not per unit."""
        return self.sharded and self.dims.shard.per_step_gather

    @cached_property
    def offloaded(self) -> bool:
        """Some of the states live in host memory (``optimizer`` or ``states`` offload)."""
        return self.offload.offloaded

    @cached_property
    def gathered(self) -> bool:
        """Layers run from a copy gathered for them: sharded, or copied up from host memory."""
        return self.sharded or self.offload.weights_on_host

    @cached_property
    def reduces_per_unit(self) -> bool:
        """Every backward reduces its units' gradients (``grad_reduce="unit"``; ``states`` offload,
        whose gradients accumulate in host memory) instead of once after the stage's last backward."""
        return (self.sharded and self.grad_reduce == "unit") or (self.offload.weights_on_host
                                                                  and not self.gathers_per_step)

    def state_bytes_per_rank(self, stage_index: int) -> float:
        """:func:`stage_state_bytes_per_rank` of the stage (between steps)."""
        return sum(self.shard_numel[stage_index]) * self.precision.state_bytes_per_param

    def peak_static_bytes(self, stage_index: int) -> float:
        """States alive during a step on one rank of the stage (module docstring)."""
        if stage_index not in self._peak:
            self._peak[stage_index] = self._peak_static_bytes(stage_index)
        return self._peak[stage_index]

    def _peak_static_bytes(self, stage_index: int) -> float:
        p = self.precision
        numel, shard = self.unit_numel[stage_index], self.shard_numel[stage_index]
        if not self.gathered:  # every state on the device, less the optimizer's when it is on host
            on_host = p.optimizer_bytes_per_param if self.offload.optimizer_on_host else 0.0
            return sum(numel) * (p.state_bytes_per_param - on_host)
        working = (sum(numel) if self.gathers_per_step else 3 * max(numel)) * p.compute_bytes_per_param
        if self.reduces_per_unit:
            return unit_reduced_state_bytes(self.offload, shard, numel, p, working)
        accumulated = sum(numel) * p.reduce_bytes_per_param  # unsharded gradients until the reduction
        return sum(shard) * p.kept_bytes_per_param(self.offload) + accumulated + working

    def without_host_copies(self) -> "ShardedStates":
        """A copy whose action chains hold the gathers and reductions alone (no ``states`` host copies)."""
        bare = copy.copy(self)
        bare.action_gathers, bare.action_reduces, bare._overlap_terms = self.gather_s, self.reduce_s, {}
        return bare

    def overlapped(self, stage_index: int, compute_s: float, backward: bool = False) -> float:
        """An action's time when its ``compute_s`` overlaps the stage's all-gathers (and, reducing
        per unit, a backward's reduce-scatters; with ``states`` offload the host copies too);
        :attr:`gathered` stages only."""
        if self.gathers_per_step:
            return compute_s  # gathered once when the step starts (gradient_sync_time counts it)
        key = (stage_index, backward and self.reduces_per_unit)
        terms = self._overlap_terms.get(key)
        if terms is None:  # the same collectives for every action of the stage: summed once
            terms = self._overlap_terms[key] = overlap_terms(
                self.action_gathers[stage_index], self.action_reduces[stage_index] if key[1] else (), self.calibration)
        return overlapped_with(compute_s, terms)

    def gradient_sync_time(self, stage_index: int, last_backward_s: float) -> float:
        """Exposed seconds of the step's gradient reduction after the stage's last backward (and,
        when parameters are gathered once per step, of that gather before the first forward)."""
        upfront = sum(self.action_gathers[stage_index]) if self.gathers_per_step else 0.0
        if self.reduces_per_unit:
            return upfront  # reduced inside every backward (overlapped)
        if not self.sharded:
            return self.allreduce_s[stage_index]
        r = self.reduce_s[stage_index]
        n = len(r)
        per_unit_compute = last_backward_s / n
        return upfront + max(max(r), sum(r) - (n - 1) * per_unit_compute)
