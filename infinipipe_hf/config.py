"""``InfiniPipeConfig``: every knob of the planner and the runtime, typed and checked.

One dataclass, one docstring per field, checks in ``__post_init__`` (``ValueError`` for users).
Checks that need the world size or the model (``pp_degree`` dividing the world, enough layers)
happen where those are known: ``resolve_dp_degree`` (``layout.py``) and the stage partition.
"""
from __future__ import annotations

from dataclasses import dataclass

from infinipipe_hf.ir.levels import CHECKPOINTING
from infinipipe_hf.layout import resolve_dp_degree, shard_mode

CHECKPOINT_LEVELS = ("keep_attn", "mlp", "mlp_act")
ATTENTION_BACKENDS = ("auto", "sdpa", "varlen", "flash")


@dataclass
class InfiniPipeConfig:
    pp_degree: int = 1
    """Number of pipeline stages; each pp rank owns a contiguous block of decoder layers."""

    dp_degree: int | None = None
    """Data-parallel replicas; ``None`` means ``world_size // (pp_degree * sp_degree)``."""

    sp_degree: int = 1
    """Ranks per pipeline stage running Ulysses sequence parallelism: each unit's tokens are split
    over them and attention runs head-sharded.  Rank layout: SP ranks adjacent, then stages, DP
    outermost (``rank = (dp_rank * pp_degree + stage_index) * sp_degree + sp_rank``)."""

    shard: str = "none"
    """Model-state sharding of a stage with FSDP2: ``none``, ``sp`` (over the stage's SP group),
    ``dp`` (over its DP replicas), ``sp+dp`` (over both), ``hybrid`` (shard over SP, replicate
    over DP)."""

    schedule: str = "epp"
    """``epp`` (elastic units, adaptive checkpointing) or a baseline: ``packed-1f1b``,
    ``seq1f1b``, ``gpipe``."""

    sp_rounds: bool | None = None
    """Elastic SP rounds: with ``sp_degree > 1`` EPP may run short sequences side by side, each on
    an aligned sub-group of the stage's SP ranks (one GPU pays no all-to-all), while long ones keep
    the whole group.  ``None``: on whenever the schedule has them and ``sp_degree`` is a power of
    two above 1; ``False``: every unit on the whole SP group; ``True``: on, an error where they
    cannot be (``sp_degree=1``, a baseline schedule)."""

    memory_budget_gib: float | None = None
    """Memory per device the plan must stay under.  ``None``: the CUDA device's total memory less
    ``memory_margin`` of it and ``memory_reserve_gib``, or unlimited on CPU."""

    memory_reserve_gib: float = 2.0
    """Memory kept free for the allocator, CUDA context and communication buffers."""

    memory_margin: float = 0.08
    """Share of the CUDA device's memory also held back (with the default budget) for the memory
    model's error: on an H100 measured peaks were 0.92-1.09x the predicted ones, and a plan
    predicted at the full budget ran out of memory (docs/gpu.md)."""

    profile: str | None = None
    """Path of a cost profile JSON (from ``python -m infinipipe_hf.profile``); ``None`` uses the
    shipped H100/bf16 profile."""

    layer_split: list[int] | None = None
    """Explicit decoder layers per stage (sums to the model's layer count); ``None`` balances cost."""

    checkpointing: str = "adaptive"
    """``adaptive`` (solver picks per stage and unit), ``none`` or ``full`` (every layer)."""

    checkpoint_levels: tuple[str, ...] = ("keep_attn", "mlp", "mlp_act")
    """Levels ``adaptive`` checkpointing may use beside whole layers: ``keep_attn`` (recompute
    the layer but not its attention core, whose output is kept), ``mlp`` (recompute the MLP),
    ``mlp_act`` (recompute only ``act(gate) * up``); ``()`` for whole layers only.  Levels the
    device or model cannot run are dropped with a warning.  See docs/checkpoint_levels.md."""

    max_tokens_per_unit: int | None = None
    """Upper bound on tokens in one unit; ``None`` lets the planner choose per batch."""

    num_slices: list[int] | None = None
    """Candidate slice counts for the longest sequence; ``None`` searches a small default set."""

    attention_backend: str = "auto"
    """``auto`` picks flash-attn varlen, then torch varlen (CUDA), then SDPA with masks."""

    loss_chunk_tokens: int = 4096
    """Tokens per LM-head + loss chunk on the last stage; logits never exist for more at once."""

    label_smoothing: float = 0.0
    """Label smoothing of the token loss, as HF's ``label_smoothing_factor``: each target keeps
    ``1 - label_smoothing`` of its weight and the rest is spread evenly over the vocabulary."""

    p2p_timeout_s: float = 300.0
    """Seconds a rank waits for a peer before failing the step with an error naming both."""

    seed_plan_on_rank0: bool = False
    """Plan on rank 0 and broadcast, instead of planning identically on every rank."""

    def __post_init__(self) -> None:
        if not isinstance(self.pp_degree, int) or self.pp_degree < 1:
            raise ValueError(f"pp_degree must be a positive integer, got {self.pp_degree!r}")
        if not isinstance(self.sp_degree, int) or self.sp_degree < 1:
            raise ValueError(f"sp_degree must be a positive integer, got {self.sp_degree!r}")
        shard_mode(self.shard)  # ValueError naming SHARD_MODES when unknown
        if self.dp_degree is not None and (not isinstance(self.dp_degree, int) or self.dp_degree < 1):
            raise ValueError(f"dp_degree must be a positive integer or None, got {self.dp_degree!r}")
        from infinipipe_hf.planner.registry import get_schedule  # here: importing the config stays light

        get_schedule(self.schedule, "pipeline")
        from infinipipe_hf.planner.search.api import resolve_sp_rounds

        resolve_sp_rounds(self.sp_rounds, self.sp_degree, self.schedule)  # ValueError when asked and impossible
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(
                f"checkpointing={self.checkpointing!r} is not known; use one of {', '.join(CHECKPOINTING)}")
        levels = (self.checkpoint_levels,) if isinstance(self.checkpoint_levels, str) else self.checkpoint_levels
        bad = [lv for lv in levels if lv not in CHECKPOINT_LEVELS]
        if bad:
            raise ValueError(f"checkpoint_levels={self.checkpoint_levels!r} names unknown level(s) {bad}; "
                             f"use any of {', '.join(CHECKPOINT_LEVELS)}, or () for whole layers only")
        self.checkpoint_levels = tuple(levels)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} is not known; "
                             f"use one of {', '.join(ATTENTION_BACKENDS)}")
        if not 0.0 <= self.memory_margin < 0.5:
            raise ValueError(f"memory_margin must be in [0, 0.5) (a share of the device's memory), "
                             f"got {self.memory_margin}")
        if self.memory_budget_gib is not None and self.memory_budget_gib <= 0:
            raise ValueError(f"memory_budget_gib must be > 0, got {self.memory_budget_gib}")
        if self.layer_split is not None:
            if len(self.layer_split) != self.pp_degree or any(n < 1 for n in self.layer_split):
                raise ValueError(f"layer_split={self.layer_split} must list {self.pp_degree} positive "
                                 f"layer counts, one per stage")
        if self.max_tokens_per_unit is not None and self.max_tokens_per_unit < 1:
            raise ValueError(f"max_tokens_per_unit must be >= 1, got {self.max_tokens_per_unit}")
        if self.num_slices is not None and (not self.num_slices or min(self.num_slices) < 1):
            raise ValueError(f"num_slices must be a non-empty list of positive ints, got {self.num_slices}")
        if self.loss_chunk_tokens < 1:
            raise ValueError(f"loss_chunk_tokens must be >= 1, got {self.loss_chunk_tokens}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.p2p_timeout_s <= 0:
            raise ValueError(f"p2p_timeout_s must be > 0, got {self.p2p_timeout_s}")

    def resolve_dp_degree(self, world_size: int) -> int:
        """Check ``pp_degree``, ``sp_degree`` (and ``dp_degree``) against the world; return ``dp_degree``."""
        return resolve_dp_degree(world_size, self.pp_degree, self.sp_degree, self.dp_degree)
