"""Per-GPU time and memory when every GPU runs every layer: ZeRO-3 states, SP or CP groups.

The systems HF users run for long context instead of a pipeline (DeepSpeed-Ulysses with ZeRO-3,
FSDP2 with ring-attention context parallelism, FlexSP) share one shape: ``world_size`` GPUs, each
running all decoder layers, model states sharded ZeRO-3 style over *all* GPUs, and the GPUs split
into groups that each run one micro-batch at a time.  This module prices that shape with the same
numbers the pipeline planner uses, so the schedules compare on equal terms:

- compute of a micro-batch on one group (:class:`UlyssesGroup`, :class:`RingGroup`): the profile's
  per-layer fit through :class:`~infinipipe_hf.planner.cost.model.CostModel` (one stage holding
  every layer, embeddings and head), per GPU of the group;
- activations: the cost model's per-token bytes on the busiest GPU, with uniform checkpointing of
  ``c`` of the ``L`` layers, plus the transient working set of the backward;
- model states (:class:`Zero3States`): every tensor sharded over all GPUs (the ZeRO-3 / FSDP
  ``FULL_SHARD`` layout), gathered per layer for every forward and again for every backward, the
  gradients reduce-scattered after every micro-batch's backward (what ZeRO-3 does, and FSDP2 with
  gradient sync on): no unsharded gradient outlives a micro-batch;
- collectives: :mod:`~infinipipe_hf.planner.cost.collectives` at the profile's intra-node (NVLink) and
  inter-node (InfiniBand) bandwidths; a group of ``g`` GPUs placed at a multiple of ``g`` stays in
  one node when ``g <= gpus_per_node`` (powers of two), and the all-GPU shard group crosses nodes
  whenever the world does.

A *round* is one micro-batch on every group at once.  ZeRO-3 gathers each layer over all GPUs, so
groups advance layer by layer together: a round lasts as long as its slowest group, and the
gathers overlap compute as FSDP's prefetch does (``first gather + max(compute, all gathers)``,
the reduce-scatters likewise in backward, the last one exposed).

Trade-off: uniform checkpointing (one count for a whole step, what these systems expose) and no
optimizer-step time (the pipeline planner does not price it either).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import NO_SHARDING, ParallelDims, sharding_over
from infinipipe_hf.planner.cost.activations import largest_fitting
from infinipipe_hf.planner.cost.calibration import for_system, overlapped, ring_extra_s
from infinipipe_hf.planner.cost.collectives import all_gather_time, reduce_scatter_time
from infinipipe_hf.planner.cost.compute import UnitShape
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.cost.profile import HardwareProfile, default_profile
from infinipipe_hf.planner.cost.states import StatePrecision, sharded_numel, stage_param_shapes
from infinipipe_hf.planner.cost.ulysses import check_sp_degree


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


class Zero3States:
    """Model states sharded over all ``world_size`` GPUs and the collectives that costs per round."""

    def __init__(self, spec: ModelSpec, profile: HardwareProfile, world_size: int, gpus_per_node: int,
                 precision: StatePrecision | None = None):
        self.world_size = _positive_int("world_size", world_size)
        self.calibration = profile.calibration
        p = self.precision = precision or StatePrecision.from_profile(profile)
        # FSDP units: embedding, every decoder layer, final norm + head (the head is the embedding
        # itself when tied: every GPU holds both ends of the model).
        self.units = stage_param_shapes(spec, spec.num_layers, embedding=True, head=True,
                                        head_is_embedding=spec.tie_word_embeddings)
        self.unit_numel = [sharded_numel(u, 1) for u in self.units]
        w = self.world_size
        self.shard_numel = sum(sharded_numel(u, w) for u in self.units)
        crosses = w > gpus_per_node
        bw = profile.inter_node_bandwidth_bytes_per_s if crosses else profile.intra_node_bandwidth_bytes_per_s
        lat = profile.collective_latency_s
        self.gather_s = [all_gather_time(n * p.compute_bytes_per_param, w, bw, lat) for n in self.unit_numel]
        self.reduce_s = [reduce_scatter_time(n * p.reduce_bytes_per_param, w, bw, lat) for n in self.unit_numel]

    @property
    def static_bytes(self) -> float:
        """States alive on one GPU during a step: its shard of weights, gradients and optimizer
        states, plus the running and the prefetched unit gathered in the compute dtype, the running
        unit's gradient in that dtype and its fp32 copy for the reduce-scatter."""
        p = self.precision
        largest = max(self.unit_numel)
        return (self.shard_numel * p.state_bytes_per_param + 3 * largest * p.compute_bytes_per_param
                + largest * p.reduce_bytes_per_param)

    def round_time(self, forward_s: float, backward_s: float) -> float:
        """A round whose slowest group computes ``forward_s`` then ``backward_s``, with the gathers
        (and, in backward, the reduce-scatters) overlapped as FSDP's prefetch overlaps them."""
        if self.world_size == 1:
            return forward_s + backward_s
        g, r, c = self.gather_s, self.reduce_s, self.calibration
        return overlapped(forward_s, g, (), c) + overlapped(backward_s, g, r, c)

    def communication_floor_s(self) -> float:
        """Seconds a round takes at the least (all collectives, no compute)."""
        return self.round_time(0.0, 0.0)


class _Group:
    """Shared arithmetic of a group of ``size`` GPUs running one micro-batch (see subclasses)."""

    size: int
    attention: str
    cost: CostModel
    layers: int

    def __init__(self, size: int, layers: int):
        self.size = size
        self.layers = layers
        self._max_tokens_cache: dict[tuple[int, float], int] = {}

    def padded_tokens(self, tokens: int) -> int:
        raise NotImplementedError

    def gpu_tokens(self, padded_tokens: int) -> int:
        return -(-int(padded_tokens) // self.size)

    def activation_peak_bytes(self, padded_tokens: int, checkpointed_layers: int) -> float:
        """Activations kept for backward plus the backward's working set, on the busiest GPU."""
        raise NotImplementedError

    def least_checkpoint(self, padded_tokens: int, room_bytes: float) -> int | None:
        """Fewest uniformly checkpointed layers whose peak fits ``room_bytes`` (None: none does)."""
        # Not monotone from 0 to 1 (a checkpointed layer is rebuilt in backward), hence a scan.
        for c in range(self.layers + 1):
            if self.activation_peak_bytes(padded_tokens, c) <= room_bytes:
                return c
        return None

    def max_tokens(self, checkpointed_layers: int, room_bytes: float) -> int:
        """Most (padded) tokens a micro-batch of this group may hold at ``checkpointed_layers``."""
        key = (int(checkpointed_layers), float(room_bytes))
        if key not in self._max_tokens_cache:  # FlexSP asks once per round and group size
            self._max_tokens_cache[key] = self._max_tokens(*key)
        return self._max_tokens_cache[key]

    def _max_tokens(self, checkpointed_layers: int, room_bytes: float) -> int:
        return largest_fitting(lambda t: self.activation_peak_bytes(t, checkpointed_layers) <= room_bytes,
                               (1 << 34) - 1)


class UlyssesGroup(_Group):
    """A group of ``size`` GPUs running a packed micro-batch with DeepSpeed-Ulysses SP.

    Every time and byte is the pipeline cost model's for a one-stage pipeline whose stage is this
    SP group (:mod:`~infinipipe_hf.planner.cost.ulysses`: per-GPU linear layers, head-sharded
    attention, four all-to-alls per layer and direction, two-level when the group spans nodes).
    A micro-batch is padded to a multiple of ``size`` tokens; the padding is its own document.
    """

    attention = "ulysses"

    def __init__(self, spec: ModelSpec, profile: HardwareProfile, size: int, world_size: int,
                 gpus_per_node: int, loss_chunk_tokens: int):
        check_sp_degree(spec, size)
        super().__init__(size, spec.num_layers)
        zero3 = sharding_over(("dp", "sp")) if world_size > 1 else NO_SHARDING  # every GPU holds a shard
        dims = ParallelDims(1, size, world_size // size, zero3, gpus_per_node)
        self.cost = CostModel(spec, profile, dims, loss_chunk_tokens=loss_chunk_tokens)

    def padded_tokens(self, tokens: int) -> int:
        return -(-int(tokens) // self.size) * self.size

    def times(self, pairs: float, padded_tokens: int, checkpointed_layers: int) -> tuple[float, float, float]:
        """(forward, backward incl. recompute, recompute) seconds on each GPU of the group."""
        shape = UnitShape(float(pairs), int(padded_tokens))
        # With shard 'sp+dp' the cost model leaves gathers to gradient_sync_time: its action times
        # are pure compute, and Zero3States adds the per-round collectives.
        fwd = self.cost.compute.forward_time(0, shape)
        bwd = self.cost.backward_time(0, shape, checkpointed_layers)
        return fwd, bwd, self.cost.recompute_time(0, shape, checkpointed_layers)

    def micro_batch_pairs(self, lengths: list[int], padded_tokens: int) -> float:
        pad = padded_tokens - sum(lengths)
        return float(sum(n * n for n in lengths) + pad * pad)

    def activation_peak_bytes(self, padded_tokens: int, checkpointed_layers: int) -> float:
        # The cost model splits the micro-batch over the SP group itself (ceil(T / sp) tokens per
        # GPU, head-sharded bytes for uneven heads, the all-to-all buffers in the working set).
        t, c = int(padded_tokens), int(checkpointed_layers)
        return self.cost.acts.unit_peak_bytes(0, t, c)


class RingGroup(_Group):
    """A group of ``size`` GPUs running one sequence with ring-attention context parallelism.

    The sequence is padded to a multiple of ``2 * size`` and cut into ``2 * size`` chunks, GPU ``i``
    holding chunks ``i`` and ``2 size - 1 - i`` (the load-balanced zigzag of torch's
    context_parallel and torchtitan), so each GPU owns ``1 / size`` of the tokens and of the causal
    attention pairs.  Per layer and direction, from the profile's single-GPU fit
    ``a1 * pairs + a2 * tokens + b``: ``a1 * pairs / cp + a2 * T / cp + b``, plus the ring: ``cp - 1``
    steps, each passing a K/V block of ``T / cp`` tokens to the next GPU (K/V and their gradients
    in backward) while attention computes ``1 / cp`` of the GPU's pairs; a step shows
    ``max(0, transfer - compute)``.  Transfers go at the collective bandwidth of the link (the
    ring crosses nodes when ``size > gpus_per_node``).  Memory: the per-token bytes of one GPU
    (all heads, ``T / cp`` tokens) plus the ring's K/V blocks in flight (two forward, four backward).
    """

    attention = "ring"

    def __init__(self, spec: ModelSpec, profile: HardwareProfile, size: int, world_size: int,
                 gpus_per_node: int, loss_chunk_tokens: int):
        super().__init__(size, spec.num_layers)
        zero3 = sharding_over(("dp",)) if world_size > 1 else NO_SHARDING  # one rank per group: shards over DP
        dims = ParallelDims(1, 1, world_size, zero3, gpus_per_node)
        self.cost = CostModel(spec, profile, dims, loss_chunk_tokens=loss_chunk_tokens)
        crosses = size > gpus_per_node
        self.bandwidth = (profile.inter_node_bandwidth_bytes_per_s if crosses
                          else profile.intra_node_bandwidth_bytes_per_s)
        self.latency = profile.collective_latency_s
        self.kv_bytes_per_token = self.cost.acts.kv_bytes_per_token_per_layer
        self.elementwise, self.calibration = profile.elementwise_bytes_per_s, profile.calibration

    def padded_tokens(self, tokens: int) -> int:
        step = 2 * self.size
        return -(-int(tokens) // step) * step

    def _ring_exposed(self, pairs: float, tokens: int, attn_pair_s: float, backward: bool) -> float:
        cp = self.size
        if cp == 1:
            return 0.0
        block = tokens / cp * self.kv_bytes_per_token * (2 if backward else 1)
        transfer = self.latency + block / self.bandwidth
        compute = attn_pair_s * pairs / cp / cp
        return (cp - 1) * max(0.0, transfer - compute)

    def times(self, pairs: float, padded_tokens: int, checkpointed_layers: int) -> tuple[float, float, float]:
        k, cp, n = self.cost.coefficients, self.size, self.layers
        t = padded_tokens / cp
        p = pairs / cp
        f = k.layer_fwd(p, t) + self._ring_exposed(pairs, padded_tokens, k.layer_fwd.attn_pair_s, False)
        b = k.layer_bwd(p, t) + self._ring_exposed(pairs, padded_tokens, k.layer_bwd.attn_pair_s, True)
        f += ring_extra_s(k.layer_fwd.attn_pair_s * p, t, cp, self.elementwise, self.calibration)
        b += ring_extra_s(k.layer_bwd.attn_pair_s * p, t, cp, self.elementwise, self.calibration)
        emb = k.embedding_token_s * t
        head_f = k.head_fwd(0, t)
        fwd = n * f + emb + head_f
        # A checkpointed layer replays its forward as the pipeline cost model prices it (less
        # ``down_proj``, :mod:`~infinipipe_hf.planner.cost.levels`), ring steps included.
        recompute = checkpointed_layers * (self.cost.recompute_time(0, UnitShape(p, int(t)), 1) + f - k.layer_fwd(p, t))
        bwd = n * b + recompute + emb + k.head_bwd(0, t) + head_f  # the chunked loss recomputes logits
        return fwd, bwd, recompute

    def micro_batch_pairs(self, lengths: list[int], padded_tokens: int) -> float:
        # One causal sequence padded at its end: the padding is part of the causal square.
        return float(padded_tokens) ** 2

    def activation_peak_bytes(self, padded_tokens: int, checkpointed_layers: int) -> float:
        n, c = self.gpu_tokens(padded_tokens), int(checkpointed_layers)
        ring = 4 * n * self.kv_bytes_per_token if self.size > 1 else 0.0
        return self.cost.acts.unit_peak_bytes(0, n, c) + ring


class PackedRingGroup(RingGroup):
    """:class:`RingGroup` on a packed micro-batch of documents (THD): each document attends only to
    itself, so the attention pairs are the sum of the documents' causal squares (padding its own)."""

    attention = "ring-packed"
    micro_batch_pairs = UlyssesGroup.micro_batch_pairs


@dataclass(frozen=True)
class FlatLayout:
    """What every non-pipeline schedule is priced for: a model on ``world_size`` GPUs of a kind."""

    spec: ModelSpec
    """The model (sizes from its HF config)."""
    profile: HardwareProfile
    """Per-layer costs, bandwidths and latencies (the pipeline planner's profile)."""
    world_size: int
    """GPUs of the job; all of them run every layer and share the ZeRO-3 states."""
    memory_budget_bytes: float
    """Memory per GPU."""
    gpus_per_node: int = 8
    """GPUs per node: groups larger than this cross nodes (inter-node bandwidth)."""
    loss_chunk_tokens: int = 4096
    """Tokens per chunk of the LM head + loss (logits never exist for more tokens at once)."""

    def __post_init__(self) -> None:
        _positive_int("world_size", self.world_size)
        _positive_int("gpus_per_node", self.gpus_per_node)
        _positive_int("loss_chunk_tokens", self.loss_chunk_tokens)
        if not self.memory_budget_bytes > 0:
            raise ValueError(f"memory_budget_bytes must be > 0, got {self.memory_budget_bytes!r}")


class FlatCost:
    """Groups and states of one :class:`FlatLayout`, built once and cached per group size."""

    def __init__(self, layout: FlatLayout, precision: StatePrecision | None = None):
        self.layout = layout
        self.spec = layout.spec
        self.world_size = layout.world_size
        self.memory_budget_bytes = float(layout.memory_budget_bytes)
        self.states = Zero3States(layout.spec, layout.profile, layout.world_size, layout.gpus_per_node, precision)
        self._groups: dict[tuple[str, int], _Group] = {}
        self._systems: dict[str, FlatCost] = {}

    def for_system(self, system: str) -> "FlatCost":
        """This layout with compute priced at ``system``'s whole-step efficiency (its measured one, else
        EPP's: :func:`~infinipipe_hf.planner.cost.calibration.for_system`); ``self`` when they agree."""
        profile = for_system(self.layout.profile, system)
        if profile is self.layout.profile:
            return self
        if system not in self._systems:
            self._systems[system] = FlatCost(replace(self.layout, profile=profile), self.states.precision)
        return self._systems[system]

    @staticmethod
    def of(spec: ModelSpec, world_size: int, memory_budget_bytes: float, profile: HardwareProfile | None = None,
           gpus_per_node: int | None = None, loss_chunk_tokens: int = 4096) -> "FlatCost":
        profile = profile or default_profile()
        return FlatCost(FlatLayout(spec, profile, world_size, memory_budget_bytes,
                                   profile.gpus_per_node if gpus_per_node is None else gpus_per_node,
                                   loss_chunk_tokens))

    @property
    def room_bytes(self) -> float:
        """Budget left for one micro-batch's activations once the states are in."""
        return self.memory_budget_bytes - self.states.static_bytes

    def group(self, attention: str, size: int) -> _Group:
        key = (attention, int(size))
        if key not in self._groups:
            if self.world_size % size or size & (size - 1):
                raise ValueError(f"a group of {size} GPUs does not tile {self.world_size} GPUs; group sizes "
                                 f"are powers of two dividing the world size")
            cls = {"ulysses": UlyssesGroup, "ring": RingGroup, "ring-packed": PackedRingGroup}[attention]
            lay = self.layout
            self._groups[key] = cls(lay.spec, lay.profile, size, lay.world_size, lay.gpus_per_node,
                                    lay.loss_chunk_tokens)
        return self._groups[key]

    def group_sizes(self, attention: str) -> list[int]:
        """Powers of two dividing the world (Ulysses: at most one attention head per GPU)."""
        top = self.world_size if attention.startswith("ring") else min(self.world_size, self.spec.num_attention_heads)
        return [1 << k for k in range(int(math.log2(top)) + 1) if self.world_size % (1 << k) == 0]

