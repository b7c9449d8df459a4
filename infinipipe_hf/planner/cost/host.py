"""Host memory as a tier of one stage: what offloaded layer inputs and an offloaded KV store hold
there, and the copy seconds they add.

Bytes.  An ``offload`` layer (:mod:`infinipipe_hf.ir.levels`) keeps its input in pinned host
memory between its forward and its backward: ``hidden_bytes_per_token`` per GPU token, per layer;
an ``offload_attn`` layer also its attention output and log-sum-exp (what ``keep_attn`` keeps); an
``offload_pair`` layer those and half an input (a pair keeps its first layer's input only; an odd
last layer keeps its own: :meth:`HostTierCost.unit_offload_bytes` counts exactly).
A stage in the plan's ``offload_kv`` keeps its KV store (context K/V of continuing sequences and
their pending gradients) in host memory: the whole store there, on the device only the K/V of the
layer running and of the next one (prefetched): ``min(2, L) / (2 L)`` of it.  The host peak of a
stage adds the model states the stage keeps on the host (``cost.state_host.host_bytes``, when that
part exists).

Seconds.  Copies run on a side stream at ``profile.host_bandwidth_bytes_per_s`` (per direction,
per GPU) beside the layer's compute; only the part of a copy longer than the compute it overlaps
is exposed.  An offloaded layer copies what it keeps out during its own forward and back during the
backward of the layer after it (in backward order, the same shape), so its exposed seconds are
``max(0, copy - forward) + max(0, copy - backward with replay)`` per layer, linear in the layer
count (the checkpoint solver needs that).  An ``offload_pair`` layer's backward also reads half of
a pair's rebuild (the first layer's input and attention output, again) and replays half of the
first layer's forward.  With ``offload_kv`` a slice with context copies its
context K/V in per layer (forward: to attend; backward: to replay, plus the pending K/V gradients
in and out) and its own new K/V out, each overlapping that layer's compute.  Trade-off: the
copies share no bandwidth with other copies (state offload's, the other direction's) in this
model, and the forward's exposed part is charged to the backward (one place, same step time).
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

from infinipipe_hf.ir.levels import HOST_LEVELS, OFFLOAD, OFFLOAD_ATTN, OFFLOAD_PAIR
from infinipipe_hf.ir.units import Segment
from infinipipe_hf.planner.cost.activations import StageActivations
from infinipipe_hf.planner.cost.compute import StageCompute, UnitShape


class HostTierCost:
    """Host bytes and copy seconds of one stage's offloaded activations and KV store (per GPU)."""

    @staticmethod
    def from_stage(ctx, cost) -> "HostTierCost":
        """The stage's part (:mod:`.model`)."""
        return HostTierCost(ctx.host_budget_bytes, cost.compute, cost.acts, getattr(cost, "state_host", None))

    def __init__(self, budget_bytes: float, compute: StageCompute, acts: StageActivations, state_host=None):
        if not budget_bytes >= 0:
            raise ValueError(f"host_budget_bytes={budget_bytes!r} must be >= 0 (0: no host tier)")
        self.budget_bytes = float(budget_bytes)
        """Host memory per GPU a plan may hold (0: nothing is offloaded)."""
        self.compute = compute
        self.acts = acts
        self.state_host = state_host
        self.bandwidth = acts.profile.host_bandwidth_bytes_per_s
        """Bytes per second one direction of a GPU's host link copies."""

    @property
    def enabled(self) -> bool:
        """Whether the stage has a host tier at all."""
        return self.budget_bytes > 0

    def copy_s(self, nbytes: float) -> float:
        """Seconds one direction of the host link takes for ``nbytes``."""
        return nbytes / self.bandwidth

    def state_host_bytes(self, stage_index: int) -> float:
        """Model-state bytes the stage keeps on the host (the state-offload part's; 0 without it)."""
        return float(self.state_host.host_bytes(stage_index)) if self.state_host is not None else 0.0

    # --- offloaded layer inputs ----------------------------------------------------------------
    def layer_host_bytes_per_token(self, level: str = OFFLOAD) -> float:
        """Host bytes per GPU token one layer at a host level keeps: ``offload`` its input,
        ``offload_attn`` also the attention output and log-sum-exp ``keep_attn`` keeps,
        ``offload_pair`` those and half an input (the pair's average)."""
        if level not in HOST_LEVELS:
            raise ValueError(f"level {level!r} keeps nothing in host memory; host levels are {', '.join(HOST_LEVELS)}")
        h, kept = self.acts.hidden_bytes_per_token, self.acts.kept_attention_bytes_per_token
        return {OFFLOAD: h, OFFLOAD_ATTN: h + kept, OFFLOAD_PAIR: kept + h / 2}[level]

    def layer_offload_bytes(self, stage_index: int, segments: Sequence[Segment], level: str = OFFLOAD) -> float:
        """Host bytes one layer at ``level`` of a unit with these segments holds."""
        tokens = self.acts.gpu_tokens(sum(s.end - s.start for s in segments))
        return tokens * self.layer_host_bytes_per_token(level)

    def unit_offload_bytes(self, stage_index: int, segments: Sequence[Segment], counts: Mapping[str, int]) -> float:
        """Host bytes a unit's host-level layers on the stage hold (``counts``: layers per level),
        exactly: an odd ``offload_pair`` run's last layer keeps its own input."""
        tokens = self.acts.gpu_tokens(sum(s.end - s.start for s in segments))
        per = sum(n * self.layer_host_bytes_per_token(lv) for lv in (OFFLOAD_ATTN, OFFLOAD) if (n := counts.get(lv, 0)))
        pairs = counts.get(OFFLOAD_PAIR, 0)
        h = self.acts.hidden_bytes_per_token
        return tokens * (per + pairs * self.acts.kept_attention_bytes_per_token + math.ceil(pairs / 2) * h)

    def layer_copy_bytes(self, shape: UnitShape, level: str = OFFLOAD, backward: bool = False) -> float:
        """Bytes one layer at ``level`` of a unit of ``shape`` copies out in the forward (or back in
        the ``backward``) on the busiest GPU; an ``offload_pair`` layer's backward also reads half
        of its pair's rebuild (the first layer's input and attention output; priced with its
        log-sum-exp, which the rebuild does not read: a bound a few bytes per token high)."""
        per = self.layer_host_bytes_per_token(level)
        if backward and level == OFFLOAD_PAIR:
            per += self.layer_host_bytes_per_token(OFFLOAD_ATTN) / 2
        return self.compute.gpu_tokens(shape.tokens) * per

    def layer_exposed_s(self, shape: UnitShape, level: str = OFFLOAD) -> float:
        """Exposed copy seconds per layer at ``level`` of a unit of ``shape`` (module docstring)."""
        out = self.copy_s(self.layer_copy_bytes(shape, level))
        back = self.copy_s(self.layer_copy_bytes(shape, level, backward=True))
        fwd = self.compute.layer_fwd(shape.pairs, shape.tokens)
        replay = fwd
        if level in (OFFLOAD_ATTN, OFFLOAD_PAIR):  # no attention core; a pair layer half a rebuild more
            replay = self.compute.layer_fwd(0, shape.tokens) * (1.5 if level == OFFLOAD_PAIR else 1.0)
        bwd = self.compute.layer_bwd(shape.pairs, shape.tokens) + replay
        return max(0.0, out - fwd) + max(0.0, back - bwd)

    # --- the KV store in host memory -----------------------------------------------------------
    def kv_device_share(self, stage_index: int) -> float:
        """Share of an offloaded KV store (K/V and pending gradients) the device still holds: the
        K/V of the running layer and of the next (prefetched), no gradients (they add up on the
        host, one layer's part at a time on the device, while the next layer's K/V is not there yet)."""
        layers = self.acts.layers_per_stage[stage_index]
        return min(2, layers) / (2 * layers)

    def kv_copy_bytes(self, segments: Sequence[Segment], continuing: Sequence[bool], backward: bool) -> float:
        """Bytes one layer copies for an offloaded KV store while a unit with these segments runs
        (``continuing``: per segment, whether later slices need its K/V): this rank's chunks when
        the ranks sharing a K/V head share its store (they exchange them on the device)."""
        per = self.acts.kv_store_bytes_per_token_per_layer
        context = sum(s.start for s in segments)
        if backward:  # context K/V in to replay; pending K/V gradients in and back out
            return 3 * context * per
        own = sum(s.end - s.start for s, c in zip(segments, continuing) if c)
        return (context + own) * per

    def kv_action_bytes(self, stage_index: int, segments: Sequence[Segment], continuing: Sequence[bool],
                        backward: bool) -> float:
        """Bytes one action of a unit copies for an offloaded KV store, over all the stage's layers."""
        return self.acts.layers_per_stage[stage_index] * self.kv_copy_bytes(segments, continuing, backward)

    def kv_exposed_s(self, stage_index: int, segments: Sequence[Segment], continuing: Sequence[bool],
                     backward: bool) -> float:
        """Exposed copy seconds of one action of a unit on a stage whose KV store is offloaded."""
        shape = UnitShape.of(segments, self.acts.profile.context_pairs)
        per_layer = self.copy_s(self.kv_copy_bytes(segments, continuing, backward))
        if not per_layer:
            return 0.0
        fwd = self.compute.layer_fwd(shape.pairs, shape.tokens)
        overlap = fwd + self.compute.layer_bwd(shape.pairs, shape.tokens) if backward else fwd
        return self.acts.layers_per_stage[stage_index] * max(0.0, per_layer - overlap)
