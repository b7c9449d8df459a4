"""What each checkpoint level inside a decoder layer saves, and what it costs to redo.

The levels are the plan's vocabulary (:mod:`infinipipe_hf.ir.levels`).  Per token, autograd keeps
in a Llama MLP ``x`` (shared by gate/up), the gate output ``g``, ``act(g)``, the up output ``u``
and their product: ``hidden + 4 * intermediate`` elements of the layer's
``10 * hidden + 4 * intermediate + 2 * kv_dim`` (:func:`~.activations.act_elements`).  ``mlp``
drops ``4 * intermediate`` of them, ``mlp_act`` ``2 * intermediate``; ``keep_attn`` keeps a whole
layer checkpoint's input plus the attention output and log-sum-exp (``hidden`` elements and one
float per head per token).

Bytes saved are shares of the profile's measured whole-layer figure, the share being the element
count above over the layer's (checked against ``saved_tensors_hooks`` in the tests).  Recompute
seconds are derived, not measured (the shipped profile times whole layers only): ``mlp_act``
moves ``5 * intermediate`` elements per token at the profile's ``elementwise_bytes_per_s``;
``mlp`` adds the gate/up share of the layer's linear FLOPs of the fitted token and fixed terms;
``full`` is the layer's forward less ``down_proj``'s share (no replay reaches that GEMM);
``keep_attn`` is ``full`` less the fit's attention-core (pair) term.  Trade-off: a FLOP share is
exact for GEMM-bound layers and optimistic where small GEMMs run below peak; the attention term
never enters a level below ``full``, which is what makes them cheap for long slices.  From
``full`` down every level costs at most the next heavier one (clamped).  The host levels save
every device byte: ``offload`` is ``full`` whose input waits in host memory, ``offload_attn``
``keep_attn`` whose kept tensors do; each adds the exposed seconds of its copies (:mod:`.host`),
so ``offload_attn`` costs less than ``full`` for twice ``offload``'s host bytes: the host budget
decides between them (the solver's host rows).
"""
from __future__ import annotations

from typing import Iterable, Sequence

from infinipipe_hf.ir.levels import (
    FULL,
    HOST_LEVELS,
    KEEP_ATTN,
    LEVELS,
    MLP,
    MLP_ACT,
    OFFLOAD,
    OFFLOAD_ATTN,
    OFFLOAD_PAIR,
    PLAN_LEVELS,
    CheckpointMix,
)
from infinipipe_hf.ir.units import Segment
from infinipipe_hf.planner.cost.activations import StageActivations, act_elements
from infinipipe_hf.planner.cost.compute import StageCompute, UnitShape


class LevelCosts:
    """Per-layer bytes saved and recompute seconds of each level, for one stage's time and bytes."""

    @staticmethod
    def from_stage(ctx, cost) -> "LevelCosts":
        """The stage's part (:mod:`.model`)."""
        return LevelCosts(cost.compute, cost.acts, cost.host)

    def __init__(self, compute: StageCompute, acts: StageActivations, host=None):
        spec, p = acts.spec, acts.profile
        self.compute = compute
        self.acts = acts
        self.host = host
        """The stage's :class:`~.host.HostTierCost` (prices ``offload``; None: the level is unknown)."""
        self._recompute_s: dict[tuple[str, UnitShape], float] = {}
        inter = spec.intermediate_size
        elements = act_elements(spec.hidden_size, inter, spec.kv_dim, p.bytes_per_element)
        self.saved_share = {MLP: 4 * inter / elements, MLP_ACT: 2 * inter / elements}
        """Share of the whole layer's saved bytes (one GPU, whole heads) each finer level drops."""
        # Per token a GPU holds: the MLP is token-sharded under sequence parallelism, so its
        # bytes are the single-GPU share of the profile's figure (not of the head-sharded mix).
        whole_layer = p.activation_bytes_per_token_per_layer * acts.act_ratio
        self.saved_bytes_per_token = {lv: s * whole_layer for lv, s in self.saved_share.items()}
        # The single-GPU linear coefficients, per GPU token: the MLP runs no all-to-all.
        c = compute.coefficients
        self._linear = p.layer_forward.scaled(c.attn_ratio, c.linear_ratio)
        self.gate_up_share = 4.0 * spec.hidden_size * inter / spec.layer_linear_flops_per_token()
        """Gate and up projections' share of the layer's linear FLOPs."""
        self.down_share = self.gate_up_share / 2
        """``down_proj``'s share, which no replay reruns."""
        self.act_s_per_token = 5.0 * inter * p.bytes_per_element / p.elementwise_bytes_per_s
        self.keep_attn_bytes_per_token = acts.kept_attention_bytes_per_token
        """Bytes per GPU token a ``keep_attn`` layer keeps beyond a whole-layer checkpoint's input."""

    def layer_recompute_s(self, level: str, shape: UnitShape) -> float:
        """Seconds to redo ``level`` of one layer on a unit of ``shape`` (monotone in the level),
        remembered per (level, shape): the solvers and the simulator price each unit many times."""
        key = (level, shape)
        got = self._recompute_s.get(key)
        if got is None:
            got = self._recompute_s[key] = self._layer_recompute_s(level, shape)
        return got

    def _layer_recompute_s(self, level: str, shape: UnitShape) -> float:
        """:meth:`layer_recompute_s`, computed.

        A whole layer's replay is its forward less ``down_proj``'s GEMM: non-reentrant
        checkpointing stops once ``down_proj``'s input is rebuilt (the residual add after it saves
        nothing), which the runtime tests check by counting GEMMs.  ``keep_attn`` also skips the
        attention core: the fit's pair term (what remains is linear in tokens)."""
        tokens = self.compute.gpu_tokens(shape.tokens)
        linear = self._linear.token_s * tokens + self._linear.fixed_s
        full = self.compute.layer_fwd(shape.pairs, shape.tokens) - self.down_share * linear
        if level == FULL:
            return full
        if level == OFFLOAD and self.host is not None:
            return full + self.host.layer_exposed_s(shape, OFFLOAD)
        if level == OFFLOAD_ATTN and self.host is not None:
            return self.layer_recompute_s(KEEP_ATTN, shape) + self.host.layer_exposed_s(shape, OFFLOAD_ATTN)
        if level == OFFLOAD_PAIR and self.host is not None:  # and half a rebuild: the first layer's forward, no core
            rebuild = self.compute.layer_fwd(0, shape.tokens)
            return (self.layer_recompute_s(KEEP_ATTN, shape) + rebuild / 2
                    + self.host.layer_exposed_s(shape, OFFLOAD_PAIR))
        act = min(self.act_s_per_token * tokens, full)
        if level == MLP_ACT:
            return act
        mlp = min(self.gate_up_share * linear + act, full)
        if level == MLP:
            return mlp
        if level == KEEP_ATTN:
            no_core = self.compute.layer_fwd(0, shape.tokens) - self.down_share * linear
            return min(max(no_core, mlp), full)
        raise ValueError(f"unknown checkpoint level {level!r}; use one of {', '.join(LEVELS)}")

    def tiled_mlp_recompute_s(self, stage_index: int, shape: UnitShape, mix: CheckpointMix) -> float:
        """Seconds a tiled MLP adds to the unit's backward on the stage beyond ``mix``'s recompute.

        Every tile reruns its gate and up projections in backward (the ``mlp`` level's recompute),
        so a layer kept whole or at ``mlp_act`` pays the difference to ``mlp``, one at ``mlp``
        nothing more.  A layer replayed whole (``offload``, ``full``, ``keep_attn``) runs the
        tiles' forward in its replay, ``down_proj`` included (the tiles' checkpoints take their
        inputs, so the replay cannot stop before the MLP), then the tiles rerun: ``mlp``'s
        seconds plus ``down_proj``'s share (the runtime tests count the projections' calls)."""
        tokens = self.compute.gpu_tokens(shape.tokens)
        mlp = self.layer_recompute_s(MLP, shape)
        down = self.down_share * (self._linear.token_s * tokens + self._linear.fixed_s)
        kept = self.acts.layers_per_stage[stage_index] - mix.total
        return (kept * mlp + mix.mlp_act * (mlp - self.layer_recompute_s(MLP_ACT, shape))
                + mix.replayed_whole * (mlp + down))

    def tiled_attention_recompute_s(self, stage_index: int, shape: UnitShape) -> float:
        """Seconds tiling a unit's attention side (``attention_tile_tokens``) adds to its backward on
        the stage beyond :meth:`tiled_mlp_recompute_s`: every layer's tiles rerun q/k/v and
        ``o_proj`` (the runtime tests count the projections' calls)."""
        tokens = self.compute.gpu_tokens(shape.tokens)
        attn = (1 - self.gate_up_share - self.down_share) * (self._linear.token_s * tokens + self._linear.fixed_s)
        return self.acts.layers_per_stage[stage_index] * attn

    def layer_saved_bytes(self, level: str, stage_index: int, segments: Sequence[Segment],
                          mlp_tiled: bool = False) -> float:
        """Bytes one layer at ``level`` drops from a unit with these segments, against keeping
        everything (monotone in the level).  Whole layers and ``keep_attn`` also drop the
        context K/V copies (their attention reruns or runs from what is kept); the MLP levels
        leave the attention's saved tensors as they are.  ``mlp_tiled``: against a kept layer
        whose MLP runs in tiles (it keeps no MLP intermediate, so the MLP levels drop nothing)."""
        if mlp_tiled:
            tokens = self.acts.gpu_tokens(sum(s.end - s.start for s in segments))
            return max(self.layer_saved_bytes(level, stage_index, segments) - tokens * self.acts.mlp_bytes_per_token, 0.0)
        if level == FULL:
            return self.acts.unit_checkpoint_saving(stage_index, segments)
        if level in HOST_LEVELS and self.host is not None:  # nothing on the device: all of it is on the host
            return (self.acts.unit_checkpoint_saving(stage_index, segments)
                    + self.host.layer_offload_bytes(stage_index, segments))
        tokens = self.acts.gpu_tokens(sum(s.end - s.start for s in segments))
        if level in (MLP, MLP_ACT):
            return tokens * self.saved_bytes_per_token[level]
        if level == KEEP_ATTN:
            full = self.acts.unit_checkpoint_saving(stage_index, segments)
            return min(max(full - tokens * self.keep_attn_bytes_per_token,
                           tokens * self.saved_bytes_per_token[MLP]), full)
        raise ValueError(f"unknown checkpoint level {level!r}; use one of {', '.join(LEVELS)}")

    def finer_recompute_s(self, shape: UnitShape, mix: CheckpointMix) -> float:
        """Recompute (and exposed copy) seconds of the mix's levels but whole layers (those:
        :meth:`recompute_time`)."""
        return sum(n * self.layer_recompute_s(lv, shape) for lv in PLAN_LEVELS if (n := getattr(mix, lv)))

    def finer_saved_bytes(self, stage_index: int, segments: Sequence[Segment], mix: CheckpointMix,
                          mlp_tiled: bool = False) -> float:
        """Bytes the mix's levels but whole layers drop from a unit with these segments."""
        return sum(n * self.layer_saved_bytes(lv, stage_index, segments, mlp_tiled)
                   for lv in PLAN_LEVELS if (n := getattr(mix, lv)))

    def unit_activation_bytes(self, stage_index: int, segments: Iterable[Segment], mix: CheckpointMix,
                              mlp_tiled: bool = False) -> float:
        """:meth:`StageActivations.unit_activation_bytes` of a unit under ``mix`` (``mlp_tiled``: its
        MLP runs in tiles, the plan's ``mlp_tile_tokens``)."""
        segments = tuple(segments)
        act = self.acts.unit_activation_bytes(stage_index, segments, mix.full, mlp_tiled)
        if mix.total > mix.full:
            act -= self.finer_saved_bytes(stage_index, segments, mix, mlp_tiled)
        return act

    def recompute_time(self, stage_index: int, shape: UnitShape, mix: CheckpointMix) -> float:
        """All recompute seconds of a unit's backward on the stage under ``mix``."""
        t = mix.full * self.layer_recompute_s(FULL, shape)
        if mix.total > mix.full:
            t += self.finer_recompute_s(shape, mix)
        return t
