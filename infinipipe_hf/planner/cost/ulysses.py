"""Per-GPU time and memory of a unit under Ulysses sequence parallelism inside a stage.

A stage of ``sp`` GPUs runs each unit of ``T`` tokens as follows (DeepSpeed-Ulysses): every GPU
holds a contiguous shard of ``ceil(T / sp)`` tokens (shards differ by at most one token) for the
norms, projections and MLP; before attention an all-to-all turns the token-sharded q, k, v into
head-sharded ones over all ``T`` tokens, attention runs on ``ceil(H / sp)`` heads on the busiest
GPU, and an all-to-all turns the output back.  Backward mirrors it.  Hence, per decoder layer and
direction, from the profile's single-GPU fit ``t = a1 * pairs + a2 * tokens + b``:

- linear layers: ``a2 * T / sp``.  The fit's ``a2`` is the per-token cost of a large GEMM and
  ``b`` the per-call overhead, so the same ``b`` on fewer tokens per GPU *is* the GPU-efficiency
  curve evaluated at the per-GPU token count (a 4K-token unit at sp 8 runs like a 512-token one).
- attention: every query still meets every key of its sequence, but only for this GPU's heads:
  ``a1 * pairs * ceil(H / sp) / H``.  With ``H % sp != 0`` the busiest GPU has ``ceil(H / sp)``
  heads and the others wait for it (LLaMA-30B: 52 heads at sp 8 -> 7 heads, not 6.5).
- fixed: ``b`` unchanged (each GPU launches the same kernels).
- all-to-all: 4 per direction (q, k, v, out forward; their gradients backward), not overlapped
  with compute (attention needs its inputs).  Each GPU's buffer is its head-sharded tensor,
  ``T * ceil(heads / sp) * head_dim`` elements (K/V heads: GQA with fewer K/V heads than ``sp``
  replicates one K/V head per GPU), priced by :mod:`collectives` at the SP group's bandwidth.

All four terms are linear in ``(pairs, tokens)``, so the result is again a
:class:`TimeCoefficients` and every part of the planner (equal-time slicing, packing, the
estimator, the simulator) sees per-GPU costs without knowing about SP.  The ``ceil(T / sp)``
rounding of the linear term is dropped from times (under one token's cost, microseconds) but kept
in memory, where it is exact: activations are per-GPU tokens times per-token bytes, the KV store
holds ``ceil(H_kv / sp)`` K/V heads of every token on each GPU, or, when ``sp`` is a multiple of
``H_kv`` above it, ``1 / (sp / H_kv)`` of the tokens of its one K/V head (the ranks sharing a head
share its store, :attr:`UlyssesCost.kv_store_share`; a context read exchanges the chunks,
:meth:`UlyssesCost.kv_exchange_s`).

Trade-off: a linear model cannot see a collective's protocol switch at small sizes or contention
with the pipeline's point-to-point traffic; both are second order next to the layer's compute.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from infinipipe_hf.ir.model_spec import ModelSpec, kv_head_sharers
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.collectives import all_to_all_time_two_level
from infinipipe_hf.planner.cost.profile import HardwareProfile, TimeCoefficients

ALL_TO_ALLS_PER_DIRECTION = 4
"""q, k, v and the attention output forward; their gradients backward."""


def check_sp_degree(spec: ModelSpec, sp_degree: int) -> None:
    """Raise unless every SP rank gets at least one attention head."""
    heads = spec.num_attention_heads
    if sp_degree > heads:
        even = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(f"sp_degree={sp_degree} exceeds the model's {heads} attention heads: Ulysses "
                         f"sequence parallelism gives every SP rank at least one head; use sp_degree "
                         f"in 1..{heads} (an even head split: {', '.join(map(str, even))})")


def tokens_per_gpu(tokens: int, sp_degree: int) -> int:
    """Tokens on the busiest GPU of a stage when ``tokens`` are split over ``sp_degree`` GPUs."""
    return -(-int(tokens) // sp_degree)


def busiest_heads(heads: int, sp_degree: int) -> int:
    """Heads on the busiest SP rank (at least one: fewer heads than ranks are replicated)."""
    return max(1, math.ceil(heads / sp_degree))


@dataclass(frozen=True)
class UlyssesCost:
    """The per-GPU arithmetic of one model at one SP degree (module docstring)."""

    spec: ModelSpec
    sp_degree: int
    bytes_per_element: int
    """Activation dtype size (q, k, v and the output travel in it)."""
    bandwidth_bytes_per_s: float
    """Intra-node bandwidth; the share of an all-to-all leaving the node uses ``inter_bytes_per_s``."""
    inter_bytes_per_s: float
    latency_s: float
    ranks_per_node: int
    """Fewest ranks of an SP group on one node (``sp_degree`` when the group is inside one node)."""

    def __post_init__(self) -> None:
        if int(self.sp_degree) != self.sp_degree or self.sp_degree < 1:
            raise ValueError(f"sp_degree must be a positive integer, got {self.sp_degree!r}")
        check_sp_degree(self.spec, self.sp_degree)

    @staticmethod
    def from_stage(ctx, cost) -> "UlyssesCost | None":
        """The stage's part (:mod:`.model`): ``None`` when a unit runs on one rank."""
        return UlyssesCost.of(ctx.spec, ctx.profile, ctx.dims, ctx.group_size) if ctx.group_size > 1 else None

    @staticmethod
    def of(spec: ModelSpec, profile: HardwareProfile, layout: ParallelDims, group_size: int | None = None) -> "UlyssesCost":
        """Ulysses over a stage's whole SP group, or over its aligned sub-groups of ``group_size``
        ranks (:mod:`infinipipe_hf.ir.sp_rounds`; a sub-group of ``g`` ranks starts at a multiple of ``g``)."""
        g = layout.sp_degree if group_size is None else int(group_size)
        if g == layout.sp_degree:
            groups = layout.sp_groups()
            crosses = layout.sp_crosses_nodes
        else:
            groups = [[layout.rank(d, s, o + i) for i in range(g)] for d in range(layout.dp_degree)
                      for s in range(layout.pp_degree) for o in range(0, layout.sp_degree, g)]
            crosses = layout.crosses_nodes(groups)
        return UlyssesCost(spec, g, profile.bytes_per_element,
                           profile.intra_node_bandwidth_bytes_per_s, profile.inter_node_bandwidth_bytes_per_s,
                           profile.collective_latency_s, layout.ranks_per_node(groups) if crosses else g)

    # --- heads and bytes -------------------------------------------------------------------
    @property
    def q_heads(self) -> int:
        return busiest_heads(self.spec.num_attention_heads, self.sp_degree)

    @property
    def kv_heads(self) -> int:
        return busiest_heads(self.spec.num_key_value_heads, self.sp_degree)

    @property
    def kv_store_share(self) -> int:
        """Ranks that share one K/V head's store of earlier slices, each keeping ``1 / share`` of
        its tokens: ``sp / H_kv`` when that is a whole number above 1 (every rank then holds one K/V
        head, used by that many consecutive ranks), else 1 (each rank stores its own K/V heads)."""
        return kv_head_sharers(self.sp_degree, self.spec.num_key_value_heads)

    def kv_exchange_s(self, context_tokens: int) -> float:
        """Seconds one layer's read of ``context_tokens`` of a sharded K/V store takes to exchange
        the chunks among the ranks sharing the head (an all-gather of the chunks; the backward
        reduce-scatters their gradients): each rank moves ``(r - 1) / r`` of the context, as in an
        all-to-all of a context-sized buffer; 0 without sharing."""
        share = self.kv_store_share
        if share == 1 or context_tokens <= 0:
            return 0.0
        nbytes = context_tokens * 2 * self.spec.head_dim * self.bytes_per_element
        # The sharing ranks are consecutive SP ranks: on one node unless a node holds fewer of them.
        per_node = min(share, self.ranks_per_node)
        return all_to_all_time_two_level(nbytes, share, per_node, self.bandwidth_bytes_per_s,
                                         self.inter_bytes_per_s, self.latency_s)

    @property
    def attention_share(self) -> float:
        """Share of the layer's attention pairs-work on the busiest GPU: ``ceil(H / sp) / H``."""
        return self.q_heads / self.spec.num_attention_heads

    def all_to_all_bytes_per_token(self) -> list[float]:
        """Per-GPU buffer bytes per token of the unit, for each of the 4 all-to-alls of one
        direction: q, k, v, out (head-sharded: the token's ``ceil(heads / sp)`` heads)."""
        hd, bpe = self.spec.head_dim, self.bytes_per_element
        q = self.q_heads * hd * bpe
        kv = self.kv_heads * hd * bpe
        return [q, kv, kv, q]

    def all_to_all_time(self, nbytes: float) -> float:
        return all_to_all_time_two_level(nbytes, self.sp_degree, self.ranks_per_node, self.bandwidth_bytes_per_s,
                                         self.inter_bytes_per_s, self.latency_s)

    def all_to_all_time_per_layer(self, tokens: int) -> float:
        """Seconds of one direction's 4 all-to-alls of one layer for a unit of ``tokens`` tokens."""
        return sum(self.all_to_all_time(b * tokens) for b in self.all_to_all_bytes_per_token())

    def kv_bytes_per_token_per_layer(self) -> float:
        """K and V of one token of one layer held by one GPU (its ``ceil(H_kv / sp)`` heads)."""
        return 2 * self.kv_heads * self.spec.head_dim * self.bytes_per_element

    def activation_scale(self, act_elements: float) -> float:
        """Per-GPU-token activation bytes over the single-GPU per-token bytes.

        ``act_elements`` is the per-token element count the layer saves; its head-shaped part
        (q, attention output: ``q_dim`` each; k, v: ``kv_dim`` each) is held head-sharded over all
        tokens, i.e. ``ceil(heads / sp) * sp / heads`` times its share per GPU token (1 when the
        heads divide evenly).  The attention output is also held token-sharded: unsplit, SDPA's
        output is ``o_proj``'s input (one buffer), but under SP the all-to-all between them makes a
        second copy, which ``o_proj`` keeps: ``q_dim`` more elements per GPU token (measured with
        ``saved_tensors_hooks`` at sp 2, tests/distributed/workers/sp_memory_model.py).
        """
        spec, sp = self.spec, self.sp_degree
        head_part = 2 * spec.q_dim + 2 * spec.kv_dim
        sharded = (2 * self.q_heads + 2 * self.kv_heads) * spec.head_dim * sp
        token_sharded_output = spec.q_dim if sp > 1 else 0
        return (act_elements - head_part + sharded + token_sharded_output) / act_elements

    # --- time ------------------------------------------------------------------------------
    def layer_coefficients(self, single_gpu: TimeCoefficients) -> TimeCoefficients:
        """Per-GPU coefficients of one layer direction, all-to-alls included (module docstring)."""
        fixed_comm = self.all_to_all_time_per_layer(0)
        per_token_comm = self.all_to_all_time_per_layer(1) - fixed_comm
        return TimeCoefficients(single_gpu.attn_pair_s * self.attention_share,
                                single_gpu.token_s / self.sp_degree + per_token_comm,
                                single_gpu.fixed_s + fixed_comm)
