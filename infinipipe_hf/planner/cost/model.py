"""Cost and memory model of one pipeline stage (docs/algorithms.md).

Time of one decoder layer on a unit with segments (context C_i, length s_i)::

    t = a1 * sum(s_i^2 + 2 C_i s_i) + a2 * sum(s_i) + b

The band term is the causal attention a slice owns ((C+s)^2 - C^2 pairs); the token term the
projections and MLP; ``b`` the launch overhead and small-GEMM under-use that makes tiny slices
slow.  The coefficients come from a :class:`HardwareProfile` measured on a reference layer and
are rescaled to the model by FLOP ratios (attention by q-dimension, linear layers by parameter
count).  Every time and byte is *per GPU*: with ``sp_degree > 1`` a stage is a group of GPUs
sharing each unit (Ulysses SP; per-GPU coefficients, all-to-alls and bytes in
:mod:`ulysses_cost`), and with ``shard != "none"`` its model states are sharded (FSDP2; bytes and
the all-gathers / reduce-scatters in :mod:`model_states`, the groups in :mod:`layout`).
Everything here is closed-form arithmetic on ``(pairs, tokens)`` so the planner can call
it millions of times per batch; units are summarised once by :func:`unit_shape`.

Memory of a stage = model states + for every unit alive in its window the activations it keeps
(non-checkpointed layers keep ``act_bytes`` per token, checkpointed ones only their input), the
KV store (K/V of slices whose sequence continues, and their pending gradients) and the transient
working set of the action running now (one layer's peak, a recompute, a chunk of logits).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Iterable, Sequence

from infinipipe_hf.ir.levels import FULL, LevelCosts, act_elements, norm_elements
from infinipipe_hf.planner.cost.profile import (HardwareProfile, TimeCoefficients, default_profile,
    reference_spec)
from infinipipe_hf.layout import LayoutSpec
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.planner.cost.states import ShardedStates, StatePrecision
from infinipipe_hf.planner.cost.ulysses import UlyssesCost, tokens_per_gpu
from infinipipe_hf.ir.partition import balanced_layer_split
from infinipipe_hf.ir.units import Segment

if TYPE_CHECKING:
    from infinipipe_hf.planner.cost.working import WorkingMemory

GIB = 1024**3


@dataclass(frozen=True)
class UnitShape:
    """What the cost model needs of a unit: attention band pairs and token count."""

    pairs: float
    tokens: int

    @staticmethod
    def of(segments: Iterable[Segment]) -> "UnitShape":
        pairs = 0
        tokens = 0
        for s in segments:
            n = s.end - s.start
            pairs += n * n + 2 * s.start * n
            tokens += n
        return UnitShape(float(pairs), tokens)


def unit_shape(segments: Iterable[Segment]) -> UnitShape:
    return UnitShape.of(segments)


class CostModel:
    """Times (seconds) and bytes of the actions of one stage, per GPU, for one model on one profile.

    ``sp_degree``, ``shard``, ``dp_degree`` and ``gpus_per_node`` (default: the profile's) describe
    the parallel layout (:class:`LayoutSpec`); ``state_precision`` the bytes of model states
    (default: from the profile, :meth:`StatePrecision.from_profile`); ``grad_reduce`` when sharded
    gradients are reduced (``"step"``, as the runtime does; ``"unit"`` is a what-if, see
    model_states).
    """

    def __init__(self, spec: ModelSpec, profile: HardwareProfile | None = None, *, pp_degree: int = 1,
                 layers_per_stage: Sequence[int] | None = None, memory_budget_bytes: float | None = None,
                 loss_chunk_tokens: int = 4096, reference_tokens: int = 4096, sp_degree: int = 1,
                 shard: str = "none", dp_degree: int = 1, gpus_per_node: int | None = None,
                 state_precision: StatePrecision | None = None, grad_reduce: str = "step"):
        self.spec = spec
        self.profile = profile or default_profile()
        self.pp_degree = pp_degree
        self.loss_chunk_tokens = loss_chunk_tokens
        p = self.profile
        self.layout = LayoutSpec(pp_degree, sp_degree, dp_degree, shard,
                                 p.gpus_per_node if gpus_per_node is None else gpus_per_node)
        self.sp_degree = sp_degree
        self.shard = shard
        self.dp_degree = dp_degree
        ref = reference_spec(p)
        self._attn_ratio = spec.q_dim / ref.q_dim
        self._linear_ratio = spec.layer_linear_flops_per_token() / ref.layer_linear_flops_per_token()
        self._head_ratio = (spec.hidden_size * spec.vocab_size) / (ref.hidden_size * ref.vocab_size)
        self._act_ratio = _act_elements(spec, p.bytes_per_element) / _act_elements(ref, p.bytes_per_element)
        self.layer_fwd = p.layer_forward.scaled(self._attn_ratio, self._linear_ratio)
        self.layer_bwd = p.layer_backward.scaled(self._attn_ratio, self._linear_ratio)
        self.head_fwd = p.head_forward.scaled(0.0, self._head_ratio)
        self.head_bwd = p.head_backward.scaled(0.0, self._head_ratio)
        self.embedding_token_s = p.embedding_token_s
        self.act_bytes_per_token = p.activation_bytes_per_token_per_layer * self._act_ratio
        self.layer_working_bytes_per_token = p.layer_working_bytes_per_token * self._act_ratio
        self.hidden_bytes_per_token = spec.hidden_size * p.bytes_per_element
        self.kv_bytes_per_token_per_layer = 2 * spec.kv_dim * p.bytes_per_element
        self.ulysses: UlyssesCost | None = None
        if sp_degree > 1:
            self._apply_sequence_parallel()
        if layers_per_stage is None:
            layers_per_stage = balanced_layer_split(spec.num_layers, pp_degree, *self.stage_extras(reference_tokens))
        layers_per_stage = list(layers_per_stage)
        if len(layers_per_stage) != pp_degree or sum(layers_per_stage) != spec.num_layers or min(layers_per_stage) < 1:
            raise ValueError(f"layers_per_stage={layers_per_stage} must be {pp_degree} positive counts "
                             f"summing to the model's {spec.num_layers} layers")
        self.layers_per_stage = layers_per_stage
        self.states = ShardedStates(spec, p, self.layout, layers_per_stage, state_precision, grad_reduce)
        if memory_budget_bytes is None:
            memory_budget_bytes = p.memory_gib * GIB
        self.memory_budget_bytes = float(memory_budget_bytes)

    def _apply_sequence_parallel(self) -> None:
        """Per-GPU coefficients and bytes of a stage of ``sp_degree`` GPUs (see ulysses_cost)."""
        u = self.ulysses = UlyssesCost.of(self.spec, self.profile, self.layout)
        sp = self.sp_degree
        self.layer_fwd = u.layer_coefficients(self.layer_fwd)
        self.layer_bwd = u.layer_coefficients(self.layer_bwd)
        self.head_fwd = TimeCoefficients(0.0, self.head_fwd.token_s / sp, self.head_fwd.fixed_s)
        self.head_bwd = TimeCoefficients(0.0, self.head_bwd.token_s / sp, self.head_bwd.fixed_s)
        self.embedding_token_s = self.embedding_token_s / sp
        self.act_bytes_per_token *= u.activation_scale(_act_elements(self.spec, self.profile.bytes_per_element))
        self.kv_bytes_per_token_per_layer = u.kv_bytes_per_token_per_layer()
        # While an all-to-all runs, q, k, v exist in both layouts: the received copy is extra.
        self.layer_working_bytes_per_token += sum(u.all_to_all_bytes_per_token()[:3])

    def gpu_tokens(self, tokens: int) -> int:
        """Tokens of a unit of ``tokens`` on the busiest GPU of a stage (``ceil(tokens / sp)``)."""
        return tokens if self.sp_degree == 1 else tokens_per_gpu(tokens, self.sp_degree)

    # --- stage layout ----------------------------------------------------------------------
    def stage_extras(self, tokens: int = 4096) -> tuple[float, float]:
        """Embedding and LM-head+loss costs in decoder-layer equivalents (for partitioning)."""
        layer = self.layer_fwd(tokens * tokens, tokens) + self.layer_bwd(tokens * tokens, tokens)
        first = 2 * self.profile.embedding_token_s * tokens / layer
        last = (self.head_fwd(0, tokens) * 2 + self.head_bwd(0, tokens)) / layer
        return first, last

    def num_layers(self, stage_index: int) -> int:
        return self.layers_per_stage[stage_index]

    # --- time ------------------------------------------------------------------------------
    def forward_time(self, stage_index: int, shape: UnitShape) -> float:
        t = self.layers_per_stage[stage_index] * self.layer_fwd(shape.pairs, shape.tokens)
        if stage_index == 0:
            t += self.embedding_token_s * shape.tokens
        if stage_index == self.pp_degree - 1:
            t += self.head_fwd(0, shape.tokens)
        if self.states.sharded:
            t = self.states.overlapped(stage_index, t)
        return t

    def recompute_time(self, stage_index: int, shape: UnitShape, checkpointed_layers: int) -> float:
        """Replay of whole checkpointed layers (their forward less ``down_proj``: checkpoint_levels.py)."""
        return checkpointed_layers * self.levels.layer_recompute_s(FULL, shape)

    def backward_time(self, stage_index: int, shape: UnitShape, checkpointed_layers: int = 0) -> float:
        """Backward of the stage on the unit, including the recompute of checkpointed layers."""
        t = self.layers_per_stage[stage_index] * self.layer_bwd(shape.pairs, shape.tokens)
        t += self.recompute_time(stage_index, shape, checkpointed_layers)
        if stage_index == 0:
            t += self.embedding_token_s * shape.tokens
        if stage_index == self.pp_degree - 1:
            # The chunked loss recomputes its logits in backward.
            t += self.head_bwd(0, shape.tokens) + self.head_fwd(0, shape.tokens)
        if self.states.sharded:
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
            fwd = n * f
            bwd = n * b
            if stage_index == 0:
                fwd += emb
                bwd += emb
            if stage_index == last:
                fwd += hf
                bwd += hb + hf
            if self.states.sharded:
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
        if self.layout.stage_link_crosses_nodes:
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
        if not self.states.sharded and self.layout.replica_degree == 1:
            return 0.0
        return self.states.gradient_sync_time(stage_index, last_backward_s)

    # --- memory ----------------------------------------------------------------------------
    def stage_params(self, stage_index: int) -> int:
        spec = self.spec
        n = self.layers_per_stage[stage_index] * spec.layer_params
        if stage_index == 0:
            n += spec.embedding_params
        if stage_index == self.pp_degree - 1:
            n += spec.hidden_size
            # A tied head on a single stage shares the embedding; on a separate stage it is a copy.
            if not (spec.tie_word_embeddings and self.pp_degree == 1):
                n += spec.embedding_params
        return n

    def static_bytes(self, stage_index: int) -> float:
        """Model states: weights, gradients and optimizer states of the stage (per GPU: sharded
        ones with FSDP2's unsharded gradients and working copies, see model_states)."""
        if self.states.sharded:
            return self.states.peak_static_bytes(stage_index)
        return self.stage_params(stage_index) * self.profile.state_bytes_per_param

    def activation_bytes(self, stage_index: int, tokens: int, checkpointed_layers: int) -> float:
        """Bytes a unit keeps alive on the stage from its forward to its backward."""
        layers = self.layers_per_stage[stage_index]
        assert 0 <= checkpointed_layers <= layers, (checkpointed_layers, layers)
        tokens = self.gpu_tokens(tokens)
        per_token = ((layers - checkpointed_layers) * self.act_bytes_per_token
                     + checkpointed_layers * self.hidden_bytes_per_token)
        if stage_index == self.pp_degree - 1:
            # The final norm's saved tensors and its output, the chunked (checkpointed) head's input.
            per_token += self.hidden_bytes_per_token * (norm_elements(self.profile.bytes_per_element) + 1)
        return tokens * per_token

    def activation_bytes_per_checkpointed_layer(self, stage_index: int, tokens: int) -> float:
        """Bytes saved by checkpointing one more layer of the unit (the solver's slope)."""
        return self.gpu_tokens(tokens) * (self.act_bytes_per_token - self.hidden_bytes_per_token)

    def context_bytes_per_layer(self, segments: Iterable[Segment]) -> float:
        """Extra bytes one non-checkpointed layer saves for segments that attend to context.

        The attention concatenates a slice's context K/V (read from the KV store) with its own and
        autograd keeps that concatenation for backward: ``2 * start * kv_dim`` elements beyond the
        slice's own K/V, which the per-token figure already counts.  Backends that need an explicit
        lower-right mask also keep it (``attention_mask_bytes_per_element`` per query-key pair).
        A checkpointed layer keeps neither (its forward reruns in backward).
        """
        total = 0.0
        mask_bpe = self.profile.attention_mask_bytes_per_element
        for seg in segments:
            if seg.start > 0:
                total += seg.start * self.kv_bytes_per_token_per_layer
                if mask_bpe:
                    total += mask_bpe * (seg.end - seg.start) * seg.end
        return total

    def unit_activation_bytes(self, stage_index: int, segments: Sequence[Segment],
                              checkpointed_layers: int) -> float:
        """:meth:`activation_bytes` of a unit with these segments, context copies included."""
        tokens = sum(seg.end - seg.start for seg in segments)
        act = self.activation_bytes(stage_index, tokens, checkpointed_layers)
        extra = self.context_bytes_per_layer(segments)
        if extra:
            act += (self.layers_per_stage[stage_index] - checkpointed_layers) * extra
        return act

    def unit_checkpoint_saving(self, stage_index: int, segments: Sequence[Segment]) -> float:
        """Bytes saved by checkpointing one more layer of a unit with these segments."""
        tokens = sum(seg.end - seg.start for seg in segments)
        return (self.activation_bytes_per_checkpointed_layer(stage_index, tokens)
                + self.context_bytes_per_layer(segments))

    @cached_property
    def working(self) -> "WorkingMemory | None":
        """Phase model of a running action's working memory, when the profile measured it
        (``working_memory.py``); None: :meth:`working_bytes` is the model."""
        from infinipipe_hf.planner.cost.working import WorkingMemory

        return WorkingMemory(self) if self.profile.working_bytes_per_token else None

    @cached_property
    def levels(self) -> LevelCosts:
        """Bytes and recompute seconds of the checkpoint levels inside a layer (checkpoint_levels.py)."""
        return LevelCosts(self)

    def kv_bytes(self, stage_index: int, continuing_tokens: int) -> float:
        """KV-store bytes for tokens whose K/V later slices need: K/V plus pending gradients."""
        return 2 * continuing_tokens * self.layers_per_stage[stage_index] * self.kv_bytes_per_token_per_layer

    def working_bytes(self, stage_index: int, tokens: int, checkpointed_layers: int, backward: bool) -> float:
        """Transient bytes while the unit's forward or backward runs on the stage."""
        tokens = self.gpu_tokens(tokens)
        per_token = self.layer_working_bytes_per_token + 2 * self.hidden_bytes_per_token
        if backward:
            # Gradients of one layer's activations exist while it runs backward; a checkpointed
            # layer first rebuilds its activations.
            per_token += self.act_bytes_per_token * (2 if checkpointed_layers else 1)
        w = tokens * per_token
        if stage_index == self.pp_degree - 1:
            chunk = min(tokens, self.loss_chunk_tokens)
            w += chunk * self.spec.vocab_size * 4 * 2  # fp32 logits and their gradient
        return w


def _act_elements(spec: ModelSpec, bytes_per_element: float = 2) -> float:
    """Activation elements per token a Llama layer saves (norms, q/k/v/o inputs, MLP: 4x inter);
    :func:`checkpoint_levels.act_elements` for ``spec``, bf16 unless told."""
    return act_elements(spec.hidden_size, spec.intermediate_size, spec.kv_dim, bytes_per_element)
