"""Checkpoint levels inside a decoder layer, and the step-level checkpointing choices: the plan's vocabulary.

A Llama-pattern layer is ``h + attn(norm(h))`` then ``h + mlp(norm(h))`` with the gated MLP
``down_proj(act_fn(gate_proj(x)) * up_proj(x))``.  The levels, heaviest first (the order the
runtime gives them to a unit's layers, see :meth:`CheckpointMix.layer_levels`):

``offload_attn``
    ``keep_attn`` with everything it keeps (the input, the attention output and the log-sum-exp)
    in host memory: no device bytes between forward and backward, and no attention core rerun,
    for twice ``offload``'s host bytes and copies.
``offload_pair``
    ``offload_attn`` in pairs of consecutive layers whose second layer keeps no input: its
    backward rebuilds it by replaying the first layer's forward from what that one keeps (its
    attention core skipped).  Per layer three quarters of ``offload_attn``'s host bytes, for one
    more replay per pair (an odd last layer keeps its input, as ``offload_attn``).
``offload``
    the whole layer recomputed, and its input kept in host memory (copied out during the forward,
    brought back ahead of the backward): no device bytes between forward and backward.
``full``
    the whole layer recomputed; keeps only its input (the plan's ``checkpoint_layers``).
``keep_attn``
    the whole layer recomputed except its attention core: keeps its input, the attention output
    and the per-head log-sum-exp, from which the core's backward runs without its forward
    (runtime/recompute/keep_attn.py).
``mlp``
    the MLP recomputed: keeps ``x``, drops ``g, act(g), u`` and the product; redoes the gate and
    up GEMMs and the product (non-reentrant checkpointing stops its replay before ``down_proj``).
``mlp_act``
    only ``act(g) * u`` recomputed: keeps ``x, g, u``, drops ``act(g)`` and the product.

What each level saves and costs to redo is the cost model's (planner/cost/levels.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Mapping

CHECKPOINTING = ("adaptive", "none", "full")
"""Step-level checkpointing choices: solved per (stage, unit), none, or every layer."""


def check_solver_time_limit(seconds, name: str = "solver_time_limit_s") -> float:
    """``seconds`` (the adaptive checkpointing's branch-and-bound limit) as a float when finite and
    >= 0, else ``ValueError``: 0 means no branch and bound."""
    try:
        value = float(seconds)
    except (TypeError, ValueError):
        value = float("nan")
    if isinstance(seconds, bool) or not 0.0 <= value < float("inf"):
        raise ValueError(f"{name}={seconds!r} must be a finite number of seconds >= 0 (0: no branch and bound, the "
                         f"default, so plans do not depend on the machine's speed; e.g. 1.0 lets HiGHS search "
                         f"for a second per plan)")
    return value


OFFLOAD_ATTN, OFFLOAD_PAIR, OFFLOAD = "offload_attn", "offload_pair", "offload"
FULL, KEEP_ATTN, MLP, MLP_ACT = "full", "keep_attn", "mlp", "mlp_act"
LEVELS = (OFFLOAD_ATTN, OFFLOAD_PAIR, OFFLOAD, FULL, KEEP_ATTN, MLP, MLP_ACT)
"""Every level, heaviest (most device bytes saved, then most host bytes) first."""
HOST_LEVELS = (OFFLOAD_ATTN, OFFLOAD_PAIR, OFFLOAD)
"""The levels that keep what they save in host memory (planned where the plan has a host tier)."""
FINER_LEVELS = (KEEP_ATTN, MLP, MLP_ACT)
"""The levels inside a layer, beside whole layers (the ``checkpoint_levels`` setting picks among them)."""
PLAN_LEVELS = HOST_LEVELS + FINER_LEVELS
"""Every level but whole layers: the plan's ``checkpoint_levels`` entry holds these counts (whole
layers are its ``checkpoint_layers``); the host levels are allowed where the plan has host memory
(``offload_attn`` and ``offload_pair`` also where ``keep_attn`` runs)."""
MLP_LEVELS = (MLP, MLP_ACT)
"""The levels inside the MLP (runtime/recompute/mlp_levels.py)."""


def host_levels(finer: Iterable[str]) -> tuple[str, ...]:
    """The host levels a plan with a host tier may use beside the finer levels ``finer``:
    ``offload``, and ``offload_attn`` and ``offload_pair`` where ``keep_attn`` may run (they keep
    what that level keeps)."""
    return ((OFFLOAD_ATTN, OFFLOAD_PAIR) if KEEP_ATTN in tuple(finer) else ()) + (OFFLOAD,)


def _in_order(levels: Iterable[str], allowed: tuple[str, ...], hint: str) -> tuple[str, ...]:
    """``levels`` as a tuple in ``allowed``'s order; ``ValueError`` naming an unknown one."""
    got = tuple(levels)
    for lv in got:
        if lv not in allowed:
            raise ValueError(f"unknown checkpoint level {lv!r}{hint.format(', '.join(allowed))}")
    return tuple(lv for lv in allowed if lv in got)


def check_plan_levels(levels: Iterable[str]) -> tuple[str, ...]:
    """``levels`` as a tuple in :data:`PLAN_LEVELS` order; ``ValueError`` naming an unknown one."""
    return _in_order(levels, PLAN_LEVELS, " in a plan's checkpoint_levels; the entry holds {} "
                                          "(whole layers go in checkpoint_layers)")


def check_levels(levels: Iterable[str]) -> tuple[str, ...]:
    """``levels`` as a tuple in :data:`FINER_LEVELS` order; ``ValueError`` naming an unknown one."""
    return _in_order(levels, FINER_LEVELS, "; use any of {} (whole layers are always allowed), or none to "
                                           "turn finer levels off")


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
    """Layers recomputed whole but for their attention core (after the first three fields, so
    positional construction reads ``full, mlp, mlp_act``)."""
    offload: int = 0
    """Layers recomputed whole whose input waits in host memory between forward and backward."""
    offload_attn: int = 0
    """Layers at ``keep_attn`` whose kept tensors wait in host memory between forward and backward."""
    offload_pair: int = 0
    """Layers at ``offload_attn`` in pairs whose second layer's input is rebuilt, not kept."""

    def __post_init__(self) -> None:
        for name in LEVELS:
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"checkpoint level {name}={n!r} must be a non-negative int layer count")

    @property
    def total(self) -> int:
        return (self.offload_attn + self.offload_pair + self.offload + self.full + self.keep_attn + self.mlp
                + self.mlp_act)

    @property
    def recomputed_whole(self) -> int:
        """Layers whose whole forward reruns in backward (``full`` and ``offload``)."""
        return self.offload + self.full

    @property
    def replayed_whole(self) -> int:
        """Layers whose forward replays in backward, the attention core at most skipped (every
        level but the MLP ones)."""
        return self.offload_attn + self.offload_pair + self.offload + self.full + self.keep_attn

    @property
    def finer(self) -> dict[str, int]:
        """The non-zero levels but whole layers, as the plan JSON's ``checkpoint_levels`` entry
        holds them (``offload`` included)."""
        return {lv: getattr(self, lv) for lv in PLAN_LEVELS if getattr(self, lv)}

    @staticmethod
    def of(full: int, finer: Mapping[str, int] | None = None) -> "CheckpointMix":
        """The mix of ``full`` whole layers and the ``finer`` level counts (one shared instance per
        distinct mix: the planner builds the same few mixes for every unit it prices)."""
        return _mix_of(int(full), tuple((lv, int(n)) for lv, n in (finer or {}).items()))

    def layer_levels(self, num_layers: int) -> list[str | None]:
        """Level of each of the stage's layers in forward order (``None``: keeps everything).

        Heaviest first: backward reaches the first layers last, so the layers that rebuild the
        most are rebuilt when the kept activations of the later layers are already freed, and
        the layers backward needs first keep what it needs."""
        if self.total > num_layers:
            raise ValueError(f"checkpoint levels {self} name {self.total} layers but the stage has "
                             f"{num_layers}; offload_attn + offload_pair + offload + full + keep_attn + mlp + mlp_act "
                             f"must be at most "
                             f"the stage's layers")
        return ([OFFLOAD_ATTN] * self.offload_attn + [OFFLOAD_PAIR] * self.offload_pair
                + [OFFLOAD] * self.offload + [FULL] * self.full
                + [KEEP_ATTN] * self.keep_attn + [MLP] * self.mlp
                + [MLP_ACT] * self.mlp_act + [None] * (num_layers - self.total))


@lru_cache(maxsize=4096)
def _mix_of(full: int, finer: tuple[tuple[str, int], ...]) -> CheckpointMix:
    counts = dict(finer)
    check_plan_levels(counts)
    return CheckpointMix(full, **{lv: counts.get(lv, 0) for lv in PLAN_LEVELS})
