"""Seconds of one pipeline stage's actions, per GPU (docs/algorithms.md).

Time of one decoder layer on a unit with segments (context C_i, length s_i)::

    t = a1 * sum(s_i^2 + 2 C_i s_i) + a2 * sum(s_i) + b

The band term is the causal attention a slice owns ((C+s)^2 - C^2 pairs; a kernel that runs a
slice with context as a masked rectangle pays 2 s (C+s): ``HardwareProfile.context_pairs``); the token term the
projections and MLP; ``b`` the launch overhead and small-GEMM under-use that makes tiny slices
slow.  The coefficients come from a :class:`HardwareProfile` measured on a reference layer and
are rescaled to the model by FLOP ratios (attention by q-dimension, linear layers by parameter
count).  With ``sp_degree > 1`` a stage is a group of GPUs sharing each unit (Ulysses SP: per-GPU
coefficients and all-to-alls in :mod:`ulysses`); with a sharded layout its actions overlap the
FSDP2 gathers (:mod:`states`).  Everything is closed-form arithmetic on ``(pairs, tokens)`` so
the planner can call it millions of times per batch; units are summarised once by
:class:`UnitShape`.  What a stage pays once per unit whatever its depth (rotary tables, unit
tensors, launch gaps: the profile's ``stage_unit_s``, fitted from stages of two depths) is added
once per action, not per layer; an older profile without it charges 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.units import Segment
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.profile import HardwareProfile, TimeCoefficients, reference_spec
from infinipipe_hf.planner.cost.states import ShardedStates
from infinipipe_hf.planner.cost.ulysses import UlyssesCost, tokens_per_gpu


@dataclass(frozen=True)
class UnitShape:
    """What the cost model needs of a unit: attention band pairs and token count."""

    pairs: float
    tokens: int

    @staticmethod
    def of(segments: Iterable[Segment], context_pairs: str = "band") -> "UnitShape":
        """The shape of a unit, its pairs counted as :meth:`segment_pairs` says."""
        pairs = 0
        tokens = 0
        for s in segments:
            pairs += UnitShape.segment_pairs(s.start, s.end, context_pairs)
            tokens += s.end - s.start
        return UnitShape(float(pairs), tokens)

    @staticmethod
    def segment_pairs(start: int, end: int, context_pairs: str = "band") -> int:
        """Twice the causal band of tokens ``[start, end)``, ``s^2 + 2 C s``; with
        ``context_pairs="rectangle"`` (``HardwareProfile.context_pairs``) a slice with context counts
        its whole masked rectangle ``2 s (C + s)`` instead."""
        n = end - start
        return n * n + 2 * start * n + (n * n if start and context_pairs == "rectangle" else 0)


STAGE_UNIT_KEYS = ("forward", "backward")
"""The keys of ``HardwareProfile.stage_unit_s``."""


def stage_unit_costs(profile: HardwareProfile) -> tuple[float, float]:
    """(forward, backward) seconds a stage pays once per unit (``profile.stage_unit_s``; absent: 0)."""
    got = dict(profile.stage_unit_s or {})
    unknown = sorted(set(got) - set(STAGE_UNIT_KEYS))
    bad = {k: v for k, v in got.items() if k in STAGE_UNIT_KEYS and not float(v) >= 0}
    if unknown or bad:
        raise ValueError(f"profile {profile.name!r}: stage_unit_s must map {' and '.join(STAGE_UNIT_KEYS)} to "
                         f"seconds >= 0, got {got!r}; refit it from stages of two depths (docs/gpu.md) "
                         f"or drop the field (0 per unit)")
    return float(got.get("forward", 0.0)), float(got.get("backward", 0.0))


@dataclass(frozen=True)
class ComputeCoefficients:
    """Per-GPU time coefficients of one model's decoder layer, LM head and embedding."""

    attn_ratio: float
    """The model's attention work per pair over the reference layer's (q dimension)."""
    linear_ratio: float
    """The model's linear FLOPs per token over the reference layer's."""
    head_ratio: float
    layer_fwd: TimeCoefficients
    layer_bwd: TimeCoefficients
    head_fwd: TimeCoefficients
    head_bwd: TimeCoefficients
    embedding_token_s: float

    @staticmethod
    def from_stage(ctx, cost) -> "ComputeCoefficients":
        """The stage's part (:mod:`.model`): the fits of ``ctx``'s model at its SP (sub-)group."""
        return ComputeCoefficients.of(ctx.spec, ctx.profile, cost.ulysses)

    @staticmethod
    def of(spec: ModelSpec, profile: HardwareProfile, ulysses: UlyssesCost | None = None) -> "ComputeCoefficients":
        """The profile's coefficients scaled to ``spec``, per GPU of a stage of ``ulysses.sp_degree``."""
        p = profile
        ref = reference_spec(p)
        attn_ratio = spec.q_dim / ref.q_dim
        linear_ratio = spec.layer_linear_flops_per_token() / ref.layer_linear_flops_per_token()
        head_ratio = (spec.hidden_size * spec.vocab_size) / (ref.hidden_size * ref.vocab_size)
        layer_fwd = p.layer_forward.scaled(attn_ratio, linear_ratio)
        layer_bwd = p.layer_backward.scaled(attn_ratio, linear_ratio)
        head_fwd = p.head_forward.scaled(0.0, head_ratio)
        head_bwd = p.head_backward.scaled(0.0, head_ratio)
        embedding_token_s = p.embedding_token_s
        if ulysses is not None:
            sp = ulysses.sp_degree
            layer_fwd = ulysses.layer_coefficients(layer_fwd)
            layer_bwd = ulysses.layer_coefficients(layer_bwd)
            head_fwd = TimeCoefficients(0.0, head_fwd.token_s / sp, head_fwd.fixed_s)
            head_bwd = TimeCoefficients(0.0, head_bwd.token_s / sp, head_bwd.fixed_s)
            embedding_token_s = embedding_token_s / sp
        return ComputeCoefficients(attn_ratio, linear_ratio, head_ratio, layer_fwd, layer_bwd, head_fwd,
                                   head_bwd, embedding_token_s)

    def stage_extras(self, profile: HardwareProfile, tokens: int = 4096) -> tuple[float, float]:
        """Embedding and LM-head+loss costs in decoder-layer equivalents (for partitioning); the
        embedding at the profile's own per-token rate."""
        layer = self.layer_fwd(tokens * tokens, tokens) + self.layer_bwd(tokens * tokens, tokens)
        first = 2 * profile.embedding_token_s * tokens / layer
        last = (self.head_fwd(0, tokens) * 2 + self.head_bwd(0, tokens)) / layer
        return first, last


class StageCompute:
    """Seconds of the actions of one stage, per GPU, for one model on one profile and layout."""

    def __init__(self, coefficients: ComputeCoefficients, profile: HardwareProfile, dims: ParallelDims,
                 layers_per_stage: list[int], states: ShardedStates, hidden_bytes_per_token: float,
                 group_size: int | None = None):
        c = self.coefficients = coefficients
        self.layer_fwd, self.layer_bwd = c.layer_fwd, c.layer_bwd
        self.head_fwd, self.head_bwd = c.head_fwd, c.head_bwd
        self.embedding_token_s = c.embedding_token_s
        self.profile = profile
        self.dims = dims
        self.pp_degree = dims.pp_degree
        self.sp_degree = dims.sp_degree if group_size is None else group_size
        """Ranks a unit's tokens are split over: the stage's SP group, or a sub-group of it."""
        self.layers_per_stage = layers_per_stage
        self.states = states
        self.hidden_bytes_per_token = hidden_bytes_per_token
        """Bytes per token of the hidden states a stage sends to the next."""
        self.unit_fwd_s, self.unit_bwd_s = stage_unit_costs(profile)
        """Seconds a stage pays once per unit forward / backward, beside its layers."""

    @staticmethod
    def from_stage(ctx, cost) -> "StageCompute":
        """The stage's part (:mod:`.model`)."""
        return StageCompute(cost.coefficients, ctx.profile, ctx.dims, list(ctx.layers_per_stage), cost.states,
                            cost.acts.hidden_bytes_per_token, group_size=ctx.group_size)

    def gpu_tokens(self, tokens: int) -> int:
        """Tokens of a unit of ``tokens`` on the busiest GPU of a stage (``ceil(tokens / sp)``)."""
        return tokens if self.sp_degree == 1 else tokens_per_gpu(tokens, self.sp_degree)

    def stage_extras(self, tokens: int = 4096) -> tuple[float, float]:
        """Embedding and LM-head+loss costs in decoder-layer equivalents (for partitioning)."""
        return self.coefficients.stage_extras(self.profile, tokens)

    def forward_time(self, stage_index: int, shape: UnitShape) -> float:
        t = self.layers_per_stage[stage_index] * self.layer_fwd(shape.pairs, shape.tokens) + self.unit_fwd_s
        if stage_index == 0:
            t += self.embedding_token_s * shape.tokens
        if stage_index == self.pp_degree - 1:
            t += self.head_fwd(0, shape.tokens)
        if self.states.gathered:
            t = self.states.overlapped(stage_index, t)
        return t

    def backward_time(self, stage_index: int, shape: UnitShape, recompute_s: float = 0.0) -> float:
        """Backward of the stage on the unit, including ``recompute_s`` of checkpointed layers."""
        t = self.layers_per_stage[stage_index] * self.layer_bwd(shape.pairs, shape.tokens) + self.unit_bwd_s
        t += recompute_s
        if stage_index == 0:
            t += self.embedding_token_s * shape.tokens
        if stage_index == self.pp_degree - 1:
            # The chunked loss recomputes its logits in backward.
            t += self.head_bwd(0, shape.tokens) + self.head_fwd(0, shape.tokens)
        if self.states.gathered:
            t = self.states.overlapped(stage_index, t, backward=True)
        return t

    def slowest_stage_time(self, shape: UnitShape) -> float:
        """``max`` over stages of ``forward_time + backward_time`` (no checkpointing), evaluating
        the layer fit once instead of per stage (the estimator calls it for every unit of every
        candidate); the same float operations as the two methods, so the same value."""
        f = self.layer_fwd(shape.pairs, shape.tokens)
        b = self.layer_bwd(shape.pairs, shape.tokens)
        emb = self.embedding_token_s * shape.tokens
        last = self.pp_degree - 1
        hf = self.head_fwd(0, shape.tokens)
        hb = self.head_bwd(0, shape.tokens)
        best = float("-inf")
        for stage_index, n in enumerate(self.layers_per_stage):
            fwd = n * f + self.unit_fwd_s
            bwd = n * b + self.unit_bwd_s
            if stage_index == 0:
                fwd += emb
                bwd += emb
            if stage_index == last:
                fwd += hf
                bwd += hb + hf
            if self.states.gathered:
                fwd = self.states.overlapped(stage_index, fwd)
                bwd = self.states.overlapped(stage_index, bwd, backward=True)
            best = max(best, fwd + bwd)
        return best

    def transfer_time(self, num_tokens: int) -> float:
        """One unit's hidden states to the next stage: each GPU sends its own token shard."""
        if self.pp_degree == 1:
            return 0.0
        p = self.profile
        bandwidth = p.p2p_bandwidth_bytes_per_s
        if self.dims.stage_link_crosses_nodes:
            bandwidth = min(bandwidth, p.inter_node_bandwidth_bytes_per_s)
        return p.p2p_latency_s + self.gpu_tokens(num_tokens) * self.hidden_bytes_per_token / bandwidth

    def message_cpu_time(self, num_tokens: int) -> float:
        """CPU seconds one unit's hidden-state message costs its two ends together on a machine
        whose transport computes on the stages' cores (``p2p_cpu_s``; 0 on GPUs)."""
        p = self.profile
        return p.p2p_cpu_s + self.gpu_tokens(num_tokens) * self.hidden_bytes_per_token * p.p2p_cpu_s_per_byte

    def gradient_sync_time(self, stage_index: int, last_backward_s: float) -> float:
        """Exposed seconds of the step's gradient reduction on the stage after its last backward
        of ``last_backward_s`` seconds (0 when the stage has one rank per replica, unsharded)."""
        if not self.states.sharded and self.dims.replica_degree == 1:
            return 0.0
        return self.states.gradient_sync_time(stage_index, last_backward_s)
