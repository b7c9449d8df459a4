"""Checkpoint levels inside a decoder layer: what each keeps, what it saves, what it costs to redo.

A Llama-pattern layer is ``h + attn(norm(h))`` then ``h + mlp(norm(h))`` with the gated MLP
``down_proj(act_fn(gate_proj(x)) * up_proj(x))``.  Autograd keeps, per token, ``x`` (shared by
gate/up), the gate output ``g`` (for the activation's backward), ``act(g)`` and the up output ``u``
(for the product) and the product itself (for ``down_proj``): ``hidden + 4 * intermediate``
elements of the layer's ``10 * hidden + 4 * intermediate + 2 * kv_dim``.  The levels, heaviest
first (the order the runtime gives them to a unit's layers, see :func:`layer_levels`):

``full``
    the whole layer recomputed; keeps only its input (the plan's ``checkpoint_layers``).
``keep_attn``
    the whole layer recomputed except its attention core: keeps its input, the attention output
    and the per-head log-sum-exp (``hidden`` elements and one float per head per token), from
    which the core's backward runs without its forward (runtime/attention_kept.py).  On long
    slices the core is most of a layer's replay; its bytes are a few percent of the layer's.
``mlp``
    the MLP recomputed: keeps ``x``, drops ``g, act(g), u`` and the product (``4 * intermediate``
    elements per token); redoes the gate and up GEMMs and the product (non-reentrant
    checkpointing stops its replay before ``down_proj``, whose input is all backward needs).
``mlp_act``
    only ``act(g) * u`` recomputed: keeps ``x, g, u``, drops ``act(g)`` and the product
    (``2 * intermediate`` elements); the redo is two elementwise kernels, memory bound.

Bytes saved are shares of the profile's measured whole-layer figure, the share being the element
count above over the layer's (:func:`act_elements`; checked against ``saved_tensors_hooks`` in the
tests, 1-2% off).  Recompute seconds are derived, not measured (the shipped profile times whole
layers only): ``mlp_act`` moves ``5 * intermediate`` elements per token at the profile's
``elementwise_bytes_per_s``; ``mlp`` adds the gate/up share of the layer's linear FLOPs of the
fitted token and fixed terms; ``full`` is the layer's forward less ``down_proj``'s share (no
replay reaches that GEMM); ``keep_attn`` is ``full`` less the fit's attention-core (pair) term, and
keeps ``full``'s bytes plus the attention output and log-sum-exp.  Trade-off: a FLOP share is
exact for GEMM-bound layers and optimistic where small GEMMs run below peak; the attention term
never enters a level below ``full``, which is what makes them cheap for long slices.  Every level costs at most the next heavier one (clamped), so
upgrading a layer never lowers cost.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

if TYPE_CHECKING:  # the cost model imports this module: type names only, no import cycle
    from infinipipe_hf.planner.cost.model import CostModel, UnitShape
    from infinipipe_hf.ir.units import Segment

FULL, KEEP_ATTN, MLP, MLP_ACT = "full", "keep_attn", "mlp", "mlp_act"
LEVELS = (FULL, KEEP_ATTN, MLP, MLP_ACT)
"""Every level, heaviest (most bytes saved, most recompute) first."""
FINER_LEVELS = (KEEP_ATTN, MLP, MLP_ACT)
"""The levels beside whole layers: the plan's ``checkpoint_levels`` key holds these."""
MLP_LEVELS = (MLP, MLP_ACT)
"""The levels inside the MLP (runtime/mlp_levels.py)."""


def check_levels(levels: Iterable[str]) -> tuple[str, ...]:
    """``levels`` as a tuple in :data:`FINER_LEVELS` order; ``ValueError`` naming an unknown one."""
    got = tuple(levels)
    for lv in got:
        if lv not in FINER_LEVELS:
            raise ValueError(f"unknown checkpoint level {lv!r}; use any of {', '.join(FINER_LEVELS)} "
                             f"(whole layers are always allowed), or none to turn finer levels off")
    return tuple(lv for lv in FINER_LEVELS if lv in got)


@dataclass(frozen=True)
class CheckpointMix:
    """How many of a unit's layers on one stage get each level (the rest keep everything)."""

    full: int = 0
    """Layers recomputed whole (the plan's ``checkpoint_layers``)."""
    mlp: int = 0
    """Layers whose MLP is recomputed."""
    mlp_act: int = 0
    """Layers whose ``act(g) * u`` is recomputed."""
    keep_attn: int = 0
    """Layers recomputed whole but for their attention core (last field: positional
    construction of the three older levels is unchanged)."""

    def __post_init__(self) -> None:
        for name in LEVELS:
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"checkpoint level {name}={n!r} must be a non-negative int layer count")

    @property
    def total(self) -> int:
        return self.full + self.keep_attn + self.mlp + self.mlp_act

    @property
    def finer(self) -> dict[str, int]:
        """The non-zero finer levels, as the plan JSON's ``checkpoint_levels`` entry holds them."""
        return {lv: getattr(self, lv) for lv in FINER_LEVELS if getattr(self, lv)}

    @staticmethod
    def of(full: int, finer: Mapping[str, int] | None = None) -> "CheckpointMix":
        finer = dict(finer or {})
        check_levels(finer)
        return CheckpointMix(int(full), **{lv: int(finer.get(lv, 0)) for lv in FINER_LEVELS})

    def layer_levels(self, num_layers: int) -> list[str | None]:
        """Level of each of the stage's layers in forward order (``None``: keeps everything).

        Heaviest first: backward reaches the first layers last, so the layers that rebuild the
        most are rebuilt when the kept activations of the later layers are already freed, and
        the layers backward needs first keep what it needs."""
        if self.total > num_layers:
            raise ValueError(f"checkpoint levels {self} name {self.total} layers but the stage has "
                             f"{num_layers}; full + keep_attn + mlp + mlp_act must be at most the stage's layers")
        return ([FULL] * self.full + [KEEP_ATTN] * self.keep_attn + [MLP] * self.mlp
                + [MLP_ACT] * self.mlp_act + [None] * (num_layers - self.total))


def act_elements(hidden_size: int, intermediate_size: int, kv_dim: int, bytes_per_element: float = 2) -> float:
    """Activation elements per token a Llama layer saves, in the activation dtype.

    Each RMSNorm keeps its input upcast to float32 (``4 / bytes_per_element`` elements; in float32
    the input itself) and its normalised output (1); the q/k/v input, SDPA's query and output
    (``o_proj`` reads the output in place), the MLP input (4 with the two norms' ``2 * 3`` in
    bf16: ``10 * hidden``); K and V (``2 * kv_dim``); the MLP's gate, act, up and product
    (``4 * intermediate``).  Measured with ``saved_tensors_hooks``: 196 KiB per token for
    Llama-3-8B in bf16 on an H100 (shipped calibration), 0.91-1.09 of this in float32 on CPU.
    """
    return (2 * norm_elements(bytes_per_element) + 4) * hidden_size + 4 * intermediate_size + 2 * kv_dim


def norm_elements(bytes_per_element: float = 2) -> float:
    """Elements per hidden element an RMSNorm keeps: its float32 input and its normalised output."""
    return 4 / bytes_per_element + 1 if bytes_per_element < 4 else 2


class LevelCosts:
    """Per-layer bytes saved and recompute seconds of each level, for one :class:`CostModel`."""

    def __init__(self, cost: "CostModel"):
        spec, p = cost.spec, cost.profile
        self.cost = cost
        inter = spec.intermediate_size
        elements = act_elements(spec.hidden_size, inter, spec.kv_dim, p.bytes_per_element)
        self.saved_share = {MLP: 4 * inter / elements, MLP_ACT: 2 * inter / elements}
        """Share of the whole layer's saved bytes (one GPU, whole heads) each finer level drops."""
        # Per token a GPU holds: the MLP is token-sharded under sequence parallelism, so its
        # bytes are the single-GPU share of the profile's figure (not of the head-sharded mix).
        whole_layer = p.activation_bytes_per_token_per_layer * cost._act_ratio
        self.saved_bytes_per_token = {lv: s * whole_layer for lv, s in self.saved_share.items()}
        # The single-GPU linear coefficients, per GPU token: the MLP runs no all-to-all.
        self._linear = p.layer_forward.scaled(cost._attn_ratio, cost._linear_ratio)
        self.gate_up_share = 4.0 * spec.hidden_size * inter / spec.layer_linear_flops_per_token()
        """Gate and up projections' share of the layer's linear FLOPs."""
        self.down_share = self.gate_up_share / 2
        """``down_proj``'s share, which no replay reruns."""
        self.act_s_per_token = 5.0 * inter * p.bytes_per_element / p.elementwise_bytes_per_s
        # The attention output (activation dtype) and the log-sum-exp (float32 from the GPU
        # kernels, the compute dtype on CPU) per GPU token: under Ulysses a GPU keeps its heads
        # of all the unit's tokens, the same count as all heads of its own tokens.
        self.keep_attn_bytes_per_token = (cost.hidden_bytes_per_token
                                          + spec.num_attention_heads * max(4.0, p.bytes_per_element))
        """Bytes per GPU token a ``keep_attn`` layer keeps beyond a whole-layer checkpoint's input."""

    def layer_recompute_s(self, level: str, shape: "UnitShape") -> float:
        """Seconds to redo ``level`` of one layer on a unit of ``shape`` (monotone in the level).

        A whole layer's replay is its forward less ``down_proj``'s GEMM: non-reentrant
        checkpointing stops once ``down_proj``'s input is rebuilt (the residual add after it saves
        nothing), which the runtime tests check by counting GEMMs.  ``keep_attn`` also skips the
        attention core: the fit's pair term (what remains is linear in tokens)."""
        tokens = self.cost.gpu_tokens(shape.tokens)
        linear = self._linear.token_s * tokens + self._linear.fixed_s
        full = self.cost.layer_fwd(shape.pairs, shape.tokens) - self.down_share * linear
        if level == FULL:
            return full
        act = min(self.act_s_per_token * tokens, full)
        if level == MLP_ACT:
            return act
        mlp = min(self.gate_up_share * linear + act, full)
        if level == MLP:
            return mlp
        if level == KEEP_ATTN:
            no_core = self.cost.layer_fwd(0, shape.tokens) - self.down_share * linear
            return min(max(no_core, mlp), full)
        raise ValueError(f"unknown checkpoint level {level!r}; use one of {', '.join(LEVELS)}")

    def layer_saved_bytes(self, level: str, stage_index: int, segments: "Sequence[Segment]") -> float:
        """Bytes one layer at ``level`` drops from a unit with these segments, against keeping
        everything (monotone in the level).  Whole layers and ``keep_attn`` also drop the
        context K/V copies (their attention reruns or runs from what is kept); the MLP levels
        leave the attention's saved tensors as they are."""
        if level == FULL:
            return self.cost.unit_checkpoint_saving(stage_index, segments)
        tokens = self.cost.gpu_tokens(sum(s.end - s.start for s in segments))
        if level in (MLP, MLP_ACT):
            return tokens * self.saved_bytes_per_token[level]
        if level == KEEP_ATTN:
            full = self.cost.unit_checkpoint_saving(stage_index, segments)
            return min(max(full - tokens * self.keep_attn_bytes_per_token,
                           tokens * self.saved_bytes_per_token[MLP]), full)
        raise ValueError(f"unknown checkpoint level {level!r}; use one of {', '.join(LEVELS)}")

    def finer_recompute_s(self, shape: "UnitShape", mix: CheckpointMix) -> float:
        """Recompute seconds of the mix's finer levels (its whole layers: ``cost.recompute_time``)."""
        return sum(n * self.layer_recompute_s(lv, shape) for lv in FINER_LEVELS if (n := getattr(mix, lv)))

    def finer_saved_bytes(self, stage_index: int, segments: "Sequence[Segment]", mix: CheckpointMix) -> float:
        """Bytes the mix's finer levels drop from a unit with these segments."""
        return sum(n * self.layer_saved_bytes(lv, stage_index, segments)
                   for lv in FINER_LEVELS if (n := getattr(mix, lv)))

    def unit_activation_bytes(self, stage_index: int, segments: "Iterable[Segment]", mix: CheckpointMix) -> float:
        """:meth:`CostModel.unit_activation_bytes` of a unit under ``mix``."""
        segments = tuple(segments)
        act = self.cost.unit_activation_bytes(stage_index, segments, mix.full)
        if mix.total > mix.full:
            act -= self.finer_saved_bytes(stage_index, segments, mix)
        return act

    def recompute_time(self, stage_index: int, shape: "UnitShape", mix: CheckpointMix) -> float:
        """All recompute seconds of a unit's backward on the stage under ``mix``."""
        t = self.cost.recompute_time(stage_index, shape, mix.full)
        if mix.total > mix.full:
            t += self.finer_recompute_s(shape, mix)
        return t
