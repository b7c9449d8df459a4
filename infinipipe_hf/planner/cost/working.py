"""Working (transient) memory of a running forward or backward, phase by phase.

The memory model counts, at every action of a stage, the activations its live units keep plus
the *working set* of the action running now.  Without measurements of that working set it is
bounded linearly (:meth:`StageActivations.working_bytes`: one layer's peak beyond what it keeps,
the unit's input and output, in backward twice a layer's activations, a chunk of logits), which
is what the checkpoint solver needs and what every profile without the figures below keeps using.

A running action's peak is not a sum of those terms but the *largest of its phases* (the phases
are measured with the allocator's events).  With
``HardwareProfile.working_bytes_per_token`` set, the peak of a unit whose stage has layers at
levels ``l_0..l_{L-1}`` (heaviest first, as the runtime runs them) is, per GPU token ``T``:

forward
    ``max_j (kept_0 + ... + kept_j + T * F(l_j))``, and on the last stage the loss phase
    ``all kept + logits chunk`` (the logits and one float32 block); where ``kept_j`` is what layer ``j`` keeps (its activations and
    context copies; its input when checkpointed whole; less the level's share for ``mlp`` /
    ``mlp_act``) and ``F(l)`` the temporaries a layer at level ``l`` holds beyond what it keeps
    (``forward_full`` / ``forward_mlp`` / ``forward_mlp_act``; the profile's
    ``layer_working_bytes_per_token`` for a layer that keeps everything).  A checkpointed layer
    also holds its context copies (and SDPA mask) while it runs.  An ``offload`` layer keeps
    nothing; its input stays through its forward (until its copy to the host is done) and comes
    back beside what its backward rebuilds.
backward
    last layer first: ``max_j (kept_0 + ... + kept_j + rebuilt_j + T * G)``, the layers after
    ``j`` already freed; ``rebuilt_j`` is what the level recomputes (the whole layer's activations
    and context copies, the MLP's share, the ``act(g) * u`` share) and ``G`` one layer's gradient
    temporaries (``backward``); on the last stage first the loss phase (a chunk's logits, turned
    into their gradient in place: :meth:`StageActivations.loss_chunk_bytes`).

plus the unit's input and output (``2 * hidden`` per token) and the stage's rotary cos/sin of
its tokens (``2 * head_dim``) throughout; with context, a checkpointed layer's forward also holds
the context K/V copy (the mask is gone by the forward's peak).  The gradients the KV store
accumulates for the context are the KV store's term (:meth:`StageActivations.kv_bytes`), not
this one.  The excess over what the unit keeps is :meth:`WorkingMemory.excess`;
:meth:`WorkingMemory.bound` is a checkpoint-free upper bound of it (every phase's worst case),
which the memory timeline keeps as its base so the checkpoint solver's constraints stay linear
and safe, while the simulator and the validator evaluate the exact phases of the plan's own
levels (``checkpointing.timeline.StageTimeline.point_values``).  With the phase model the
executor's buffers are counted too (:meth:`WorkingMemory.pipeline_buffers`: receives posted
ahead, outputs held until their unit's backward); they do not depend on checkpointing, so they
are part of every point's base.  Trade-off: the per-token figures are measured on one layer shape
and scaled with the activation bytes; the phases ignore allocator fragmentation (none on CPU; the
CUDA caching allocator's reserved-but-free blocks are outside the model on GPUs too).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from infinipipe_hf.ir.levels import (
    FULL,
    HOST_LEVELS,
    KEEP_ATTN,
    MLP,
    MLP_ACT,
    OFFLOAD_ATTN,
    OFFLOAD_PAIR,
    CheckpointMix,
)
from infinipipe_hf.ir.units import Segment
from infinipipe_hf.planner.cost.activations import StageActivations, norm_elements
from infinipipe_hf.planner.cost.levels import LevelCosts
from infinipipe_hf.planner.cost.profile import check_working_fields

RECEIVE_LOOKAHEAD = 2
"""Receives the executor posts ahead of the running action (``PipelineExecutor(lookahead=2)``)."""


class WorkingMemory:
    """Phase model of one stage's bytes (module docstring); only for profiles that measured it."""

    @staticmethod
    def from_stage(ctx, cost) -> "WorkingMemory | None":
        """The stage's part (:mod:`.model`): ``None`` unless the profile measured the phases (then
        ``acts.working_bytes`` is the model)."""
        if not ctx.profile.working_bytes_per_token:
            return None
        return WorkingMemory(cost.acts, cost.levels, offload=ctx.host_budget_bytes > 0)

    def __init__(self, acts: StageActivations, levels: LevelCosts, offload: bool = False):
        p = acts.profile
        check_working_fields(p.working_bytes_per_token)
        self.acts = acts
        self.levels = levels
        scale = acts.act_ratio  # the measured figures scale with the layer's activation bytes
        w = {k: float(v) * scale for k, v in p.working_bytes_per_token.items()}
        self.gradients = w["backward"]
        self.forward = {None: acts.layer_working_bytes_per_token, FULL: w["forward_full"],
                        MLP: w["forward_mlp"], MLP_ACT: w["forward_mlp_act"]}
        self.level_saved = {None: 0.0, **levels.saved_bytes_per_token}
        self.offload = offload
        """Whether host-level layers may occur (the host tier is on): :meth:`bound` covers them."""

    def _logits(self, stage: int, tokens: int) -> float:
        c = self.acts
        return c.loss_chunk_bytes(tokens) if stage == c.pp_degree - 1 else 0.0

    def _mask_bytes(self, segments: Sequence[Segment]) -> float:
        """The explicit masks of the unit's segments with context (part of the context bytes)."""
        bpe = self.acts.profile.attention_mask_bytes_per_element
        return sum(bpe * (s.end - s.start) * s.end for s in segments if s.start > 0) if bpe else 0.0

    def _per_layer(self, stage: int, tokens: int, ctx: float, mask: float, mix: CheckpointMix,
                   tile: int | None = None):
        """(kept, forward transient, backward rebuild) bytes of each layer, in forward order."""
        c = self.acts
        a, h = c.act_bytes_per_token, c.hidden_bytes_per_token
        out = []
        levels = mix.layer_levels(c.layers_per_stage[stage])
        if tile:  # every MLP reruns in tiles: a layer kept whole or at mlp_act keeps what mlp keeps
            levels = [MLP if lv in (None, MLP_ACT) else lv for lv in levels]
        for level in levels:
            if level in HOST_LEVELS:
                # Keeps nothing; what it keeps on the host lives on through the forward until its
                # copy is out, and comes back beside what the replay rebuilds.
                held = h + (self.levels.keep_attn_bytes_per_token if level in (OFFLOAD_ATTN, OFFLOAD_PAIR) else 0.0)
                out.append((0.0, tokens * (self.forward[FULL] + held) + ctx - mask, tokens * a + ctx))
            elif level in (FULL, KEEP_ATTN):
                # Measured: the context K/V copy is still alive at the forward's peak, the mask not.
                # keep_attn's first forward runs like a whole layer's; what it keeps is counted as kept.
                k = h + (self.levels.keep_attn_bytes_per_token if level == KEEP_ATTN else 0.0)
                out.append((tokens * k, tokens * self.forward[FULL] + ctx - mask, tokens * (a - k) + ctx))
            else:
                saved = self.level_saved[level]
                out.append((tokens * (a - saved) + ctx, tokens * self.forward[level], tokens * saved))
        return out if not tile else [self._tiled(k, f, r, tokens, min(tile, tokens)) for k, f, r in out]

    def _tiled(self, kept: float, fwd: float, rebuilt: float, tokens: int, tile: int) -> tuple:
        """A layer's bytes with its MLP in tiles: what its backward rebuilds holds the MLP's
        intermediates (every level at or above ``mlp`` rebuilds them) for ``tile`` tokens, not the
        unit's; its forward transient keeps the MLP's share of it for a tile only."""
        m = self.level_saved[MLP]
        share = m / self.acts.act_bytes_per_token
        fwd *= 1.0 - share + share * tile / tokens
        return kept, fwd, max(rebuilt - (tokens - tile) * m, 0.0)

    def _unit_extra(self, tokens: int) -> float:
        """Input and output hidden states, and the stage's rotary cos/sin the unit's layers share."""
        c = self.acts
        return tokens * (2 * c.hidden_bytes_per_token + 2 * c.spec.head_dim * c.profile.bytes_per_element)

    def correction(self, stage: int, segments: Sequence[Segment], full: int,
                   finer: dict[str, int] | None) -> tuple[float, float]:
        """(forward, backward): a unit's working bytes at ``full`` whole layers and the ``finer``
        levels less the bound a stage's base counts for it (:meth:`bound`; <= 0)."""
        tokens = sum(s.end - s.start for s in segments)
        ctx = self.acts.context_bytes_per_layer(segments)
        mix = CheckpointMix.of(full, finer)
        return (self.excess(stage, segments, mix, False) - self.bound(stage, tokens, ctx, False),
                self.excess(stage, segments, mix, True) - self.bound(stage, tokens, ctx, True))

    def excess(self, stage: int, segments: Sequence[Segment], mix: CheckpointMix, backward: bool,
               mlp_tile_tokens: int | None = None) -> float:
        """Peak bytes of the unit's action beyond what the unit keeps (its activations); with
        ``mlp_tile_tokens`` the unit's MLP runs in tiles (its layers keep at most what ``mlp`` keeps,
        their MLP intermediates count for a tile, and backward's gradient temporaries for the MLP too)."""
        c = self.acts
        t = c.gpu_tokens(sum(s.end - s.start for s in segments))
        ctx = c.context_bytes_per_layer(segments)
        mask = self._mask_bytes(segments)
        layers = self._per_layer(stage, t, ctx, mask, mix, mlp_tile_tokens)
        grads = self._gradients(t, mlp_tile_tokens)
        kept = sum(k for k, _, _ in layers)
        last = stage == c.pp_degree - 1
        extra = t * c.hidden_bytes_per_token * (norm_elements(c.profile.bytes_per_element) + 1) if last else 0.0
        total = kept + extra
        if not backward:
            peak, prefix = 0.0, 0.0
            for k, fwd, _ in layers:
                peak = max(peak, prefix + k + fwd)
                prefix += k
            if last:
                peak = max(peak, total + self._logits(stage, t))
        else:
            peak = total + self._logits(stage, t) if last else 0.0
            suffix = kept
            for k, _, rebuilt in reversed(layers):
                peak = max(peak, suffix + rebuilt + grads)
                suffix -= k
        return max(peak - total, 0.0) + self._unit_extra(t)

    def _gradients(self, tokens: int, tile: int | None) -> float:
        """One layer's gradient temporaries in backward; tiled, the MLP's share for one tile."""
        if not tile:
            return tokens * self.gradients
        share = self.level_saved[MLP] / self.acts.act_bytes_per_token
        return self.gradients * (tokens * (1 - share) + min(tile, tokens) * share)

    def bound(self, stage: int, tokens: int, ctx: float, backward: bool) -> float:
        """An upper bound of :meth:`excess` over every checkpoint mix (independent of the mix);
        ``ctx`` is :meth:`StageActivations.context_bytes_per_layer` of the unit (masks included)."""
        c = self.acts
        t = c.gpu_tokens(tokens)
        a, h = c.act_bytes_per_token, c.hidden_bytes_per_token
        # What an offloaded layer keeps until its copy is out (offload_attn's at most), beside a whole layer's bytes.
        held = h + self.levels.keep_attn_bytes_per_token if self.offload else 0.0
        if backward:
            rebuilt = max(t * (a - h + held) + ctx, t * max(self.level_saved.values()))
            worst = max(self._logits(stage, t), rebuilt + t * self.gradients)
        else:
            worst = max(self._logits(stage, t), t * max(max(self.forward.values()), self.forward[FULL] + held) + ctx)
        return worst + self._unit_extra(t)

    def pipeline_buffers(self, stage: int, forward: np.ndarray, tokens: np.ndarray,
                         ranks: np.ndarray | None = None) -> np.ndarray:
        """Per action of a stage, the executor's hidden-state buffers beside the running one's input
        and output: the receive buffers posted for the next :data:`RECEIVE_LOOKAHEAD` actions, and
        on a non-last stage the output of every unit forwarded and not yet backward (the runner
        keeps it, with its graph, until the unit's backward; the send of it shares its storage).
        Not counted: input gradients sent back, which the executor holds until the schedule
        proves them received (``runtime/parallel/send_release.py``: the previous stage's next forward
        arriving, usually a few actions).  ``forward`` and ``tokens`` are per action (tokens of
        its unit; ``ranks``: per action, the ranks its unit runs on when they differ from
        ``sp_degree``, SP sub-groups)."""
        c = self.acts
        n = len(forward)
        per = -(-tokens.astype(np.int64) // (c.sp_degree if ranks is None else ranks)) * c.hidden_bytes_per_token
        first, last = stage == 0, stage == c.pp_degree - 1
        recv = np.where(forward, 0.0 if first else 1.0, 0.0 if last else 1.0) * per
        ahead = np.zeros(n)
        for d in range(1, RECEIVE_LOOKAHEAD + 1):
            ahead[:-d] += recv[d:]
        if last:
            return ahead
        # Outputs held from after a unit's forward (its own 2 * hidden covers the forward's point)
        # through its backward: +per after each forward, -per after each backward.
        delta = np.zeros(n + 1)
        delta[1:] = np.where(forward, per, -per)
        held = np.cumsum(delta)[:n]
        return ahead + np.maximum(held, 0.0)
