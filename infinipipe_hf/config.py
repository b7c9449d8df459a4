"""``InfiniPipeConfig``: every knob of the planner and the runtime, typed and checked.

One dataclass, one docstring per field, checks in ``__post_init__`` (``ValueError`` for users).
Checks that need the world size or the model (``pp_degree`` dividing the world, enough layers)
happen where those are known: :meth:`InfiniPipeConfig.layout` builds the job's one layout object
(``ParallelDims``, checked against the world) and the model checks it (``ParallelDims.check_model``).

:func:`planning_budget` is the one rule that turns a device's memory into the budget a plan stays
under; the engine and the planner CLI both call it, so they plan to the same bytes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from infinipipe_hf.ir.grad_reduce import check_grad_reduce, unit_reduce_problem
from infinipipe_hf.ir.levels import CHECKPOINTING, check_solver_time_limit
from infinipipe_hf.layout import ParallelDims, ShardMode, shard_mode, state_offload

CHECKPOINT_LEVELS = ("keep_attn", "mlp", "mlp_act")
ATTENTION_BACKENDS = ("auto", "sdpa", "varlen", "flash", "flex")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
GIB = 2**30
PLAN_SETTINGS = ("schedule", "max_tokens_per_unit", "num_slices", "checkpointing", "checkpoint_levels",
                 "loss_chunk_tokens", "sp_rounds", "grad_reduce", "solver_time_limit_s", "adopt_rounds_of")
"""Config fields ``plan_step`` takes as the ``PlanOptions`` fields of the same name: every place that
plans for a job (the engine, the trainer's layout search and fit check) reads them here."""


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

    grad_reduce: str = "auto"
    """When a sharded stage reduce-scatters its gradients: ``step`` (once, after its last backward:
    fewest collectives, but every unsharded fp32 gradient lives through the step), ``unit`` (after
    every unit's backward, as ZeRO-3 does; shard groups over SP only) or ``auto`` (the planner
    prices both where ``unit`` can run and keeps the faster plan; the plan records the pick)."""

    schedule: str = "epp"
    """``epp`` (elastic units, adaptive checkpointing) or a baseline: ``packed-1f1b``,
    ``seq1f1b``, ``gpipe``."""

    sp_rounds: bool | None = None
    """Elastic SP rounds: with ``sp_degree > 1`` EPP may run short sequences side by side, each on
    an aligned sub-group of the stage's SP ranks (one GPU pays no all-to-all), while long ones keep
    the whole group.  ``None``: on whenever the schedule has them and ``sp_degree`` is a power of
    two above 1; ``False``: every unit on the whole SP group; ``True``: on, an error where they
    cannot be (``sp_degree=1``, a baseline schedule)."""

    adopt_rounds_of: tuple[str, ...] = ()
    """Non-pipeline alternatives (``flexsp``, ``ulysses-zero3``, ``ring-cp-packed``) whose own plan of
    each batch EPP also plans as a candidate, at pp 1 and dp 1 with SP rounds; the layout search
    sets it where such an alternative plans faster than EPP's own search (its recipe says so)."""

    memory_budget_gib: float | None = None
    """Memory per device the plan must stay under.  ``None``: the CUDA device's total memory less
    ``memory_margin`` of it and ``memory_reserve_gib``, or unlimited on CPU."""

    memory_reserve_gib: float = 2.0
    """Memory kept free for the allocator, CUDA context and communication buffers."""

    memory_margin: float = 0.08
    """Share of the CUDA device's memory also held back (with the default budget) for the memory
    model's error (docs/gpu.md compares predicted and measured peaks)."""

    host_memory_gib: float | None = None
    """Host memory per rank the plan may fill (offloaded layer inputs and K/V, host optimizer
    states).  ``None``: the machine's memory divided among its local ranks (``LOCAL_WORLD_SIZE``),
    less ``memory_margin`` of it, on a GPU; none on a CPU device (its memory is host memory) unless
    ``state_offload`` asks for one; ``0`` turns the host tier off (nothing offloaded)."""

    state_offload: str = "none"
    """Model states in host memory: ``none``, ``optimizer`` (AdamW moments and master weights on
    the host, the step on the CPU) or ``states`` (weights and gradients too, FSDP2 CPU offload;
    unsharded only at ``sp_degree = dp_degree = 1``).  Needs a host budget above 0."""

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

    solver_time_limit_s: float = 0.0
    """Seconds ``adaptive`` checkpointing may spend in HiGHS' branch and bound per plan (shared by
    its stages and replicas).  ``0``: none, the rounded LP relaxation and a greedy decide, so every
    rank plans the same however fast or loaded it is.  A limit may save a little recompute; where it
    binds, ranks can plan differently and every rank then runs rank 0's plan."""

    max_tokens_per_unit: int | None = None
    """Upper bound on tokens in one unit; ``None`` lets the planner choose per batch."""

    num_slices: list[int] | None = None
    """Candidate slice counts for the longest sequence; ``None`` searches a small default set."""

    attention_backend: str = "auto"
    """``auto`` routes each unit kind by the profile's measured table when it has one, else picks
    flash-attn varlen, then torch varlen (CUDA), then SDPA with masks; ``flex``: FlexAttention (CUDA)."""

    loss_chunk_tokens: int = 4096
    """Tokens per LM-head + loss chunk on the last stage; logits never exist for more at once."""

    label_smoothing: float = 0.0
    """Label smoothing of the token loss, as HF's ``label_smoothing_factor``: each target keeps
    ``1 - label_smoothing`` of its weight and the rest is spread evenly over the vocabulary."""

    p2p_timeout_s: float = 300.0
    """Seconds a rank waits for a peer before failing the step with an error naming both."""

    seed_plan_on_rank0: bool = False
    """Plan on rank 0 and broadcast, instead of planning identically on every rank."""

    compile_layers: bool = False
    """Compile each decoder layer of a stage once with ``torch.compile`` (dynamic token dimension,
    so units of every size reuse the graph; the ``epp`` attention runs eagerly between the
    compiled parts).  ``torch_compile=True`` on the trainer's arguments sets it."""

    compile_backend: str = "inductor"
    """``torch.compile`` backend of ``compile_layers`` (the trainer's ``torch_compile_backend``)."""

    compile_mode: str | None = None
    """``torch.compile`` mode of ``compile_layers``: ``None`` (the backend's default) or one of
    ``default``, ``reduce-overhead``, ``max-autotune``, ``max-autotune-no-cudagraphs`` (the
    trainer's ``torch_compile_mode``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.pp_degree, int) or self.pp_degree < 1:
            raise ValueError(f"pp_degree must be a positive integer, got {self.pp_degree!r}")
        if not isinstance(self.sp_degree, int) or self.sp_degree < 1:
            raise ValueError(f"sp_degree must be a positive integer, got {self.sp_degree!r}")
        self.shard_row()  # ValueError naming SHARD_MODES when unknown
        check_grad_reduce(self.grad_reduce)
        if self.dp_degree is not None and (not isinstance(self.dp_degree, int) or self.dp_degree < 1):
            raise ValueError(f"dp_degree must be a positive integer or None, got {self.dp_degree!r}")
        from infinipipe_hf.planner.registry import get_schedule  # here: importing the config stays light

        get_schedule(self.schedule, "pipeline")
        from infinipipe_hf.planner.search.api import resolve_sp_rounds

        resolve_sp_rounds(self.sp_rounds, self.sp_degree, self.schedule)  # ValueError when asked and impossible
        from infinipipe_hf.planner.search.adopted import check_adopt_rounds_of

        self.adopt_rounds_of = check_adopt_rounds_of(self.adopt_rounds_of)
        if self.checkpointing not in CHECKPOINTING:
            raise ValueError(
                f"checkpointing={self.checkpointing!r} is not known; use one of {', '.join(CHECKPOINTING)}")
        levels = (self.checkpoint_levels,) if isinstance(self.checkpoint_levels, str) else self.checkpoint_levels
        bad = [lv for lv in levels if lv not in CHECKPOINT_LEVELS]
        if bad:
            raise ValueError(f"checkpoint_levels={self.checkpoint_levels!r} names unknown level(s) {bad}; "
                             f"use any of {', '.join(CHECKPOINT_LEVELS)}, or () for whole layers only")
        self.checkpoint_levels = tuple(levels)
        self.solver_time_limit_s = check_solver_time_limit(self.solver_time_limit_s)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} is not known; "
                             f"use one of {', '.join(ATTENTION_BACKENDS)}")
        if not 0.0 <= self.memory_margin < 0.5:
            raise ValueError(f"memory_margin must be in [0, 0.5) (a share of the device's memory), "
                             f"got {self.memory_margin}")
        if self.memory_budget_gib is not None and self.memory_budget_gib <= 0:
            raise ValueError(f"memory_budget_gib must be > 0, got {self.memory_budget_gib}")
        self._check_host_tier()
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
        self._check_compile()

    def _check_compile(self) -> None:
        if self.compile_mode is not None and self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode={self.compile_mode!r} is not a torch.compile mode; use None or "
                             f"one of {', '.join(COMPILE_MODES)}")
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            raise ValueError(f"compile_backend must name a torch.compile backend such as 'inductor', "
                             f"got {self.compile_backend!r}")
        if not self.compile_layers and (self.compile_mode is not None or self.compile_backend != "inductor"):
            import warnings

            warnings.warn(f"compile_backend={self.compile_backend!r} / compile_mode={self.compile_mode!r} "
                          f"are ignored: compile_layers=False; set compile_layers=True to compile the "
                          f"stage's decoder layers", stacklevel=3)

    def _check_host_tier(self) -> None:
        if self.host_memory_gib is not None and not self.host_memory_gib >= 0:
            raise ValueError(f"host_memory_gib must be >= 0 (GiB of host memory per rank; 0 turns the host "
                             f"tier off, None takes the machine's share), got {self.host_memory_gib}")
        mode = state_offload(self.state_offload)
        if mode.offloaded and self.host_memory_gib == 0:
            raise ValueError(f"state_offload={mode.name!r} keeps model states in host memory, but "
                             f"host_memory_gib=0 turns the host tier off; raise host_memory_gib or use "
                             f"state_offload='none'")

    def host_budget_bytes(self) -> float:
        """Host bytes per rank the plan may fill: ``host_memory_gib``, or the machine's memory
        over its local ranks less ``memory_margin`` of it (:func:`host_memory_bytes`)."""
        if self.host_memory_gib is not None:
            return float(self.host_memory_gib) * GIB
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
        return host_memory_bytes() / ranks * (1.0 - self.memory_margin)

    def plan_settings(self) -> dict:
        """The :data:`PLAN_SETTINGS` of this config (:func:`plan_settings_of`)."""
        return plan_settings_of(vars(self))

    def memory_budget(self, device_memory_bytes: float | None) -> MemoryBudget:
        """The budget plans stay under on a device of ``device_memory_bytes`` (:func:`planning_budget`)."""
        return planning_budget(device_memory_bytes, self.memory_margin, self.memory_reserve_gib,
                               self.memory_budget_gib)

    def shard_row(self) -> ShardMode:
        """The row of ``shard`` in the shard table (``ValueError`` naming the modes when unknown):
        what the engine asks of the mode before the layout of a world exists."""
        return shard_mode(self.shard)

    def layout(self, world_size: int, gpus_per_node: int | None = None, model=None) -> ParallelDims:
        """The job's layout on ``world_size`` processes (``ParallelDims.for_world``): ``dp_degree``
        derived (or checked) from the world, checked against ``model`` (a ``ModelSpec``) when given.
        ``gpus_per_node``: ranks per node (default: the launcher's ``LOCAL_WORLD_SIZE``, else 8),
        which decides which groups the planner prices as crossing nodes."""
        if gpus_per_node is None:
            gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or 8)
        dims = ParallelDims.for_world(world_size, self.pp_degree, self.sp_degree, self.dp_degree, self.shard_row(),
                                      gpus_per_node, model, state_offload=self.state_offload)
        problem = unit_reduce_problem(dims) if self.grad_reduce == "unit" else None
        if problem is not None:
            raise ValueError(f"{problem} (layout {dims.label})")
        return dims


@dataclass(frozen=True)
class MemoryBudget:
    """The memory a plan stays under per device, and how it was derived."""

    budget_bytes: float | None
    """Bytes per device the plan must stay under; ``None``: unlimited (no device memory known)."""
    device_memory_bytes: float | None
    """The device's total memory; ``None`` when not known (CPU)."""
    margin: float | None
    """Share of the device's memory held back; ``None`` when an explicit budget was given."""
    reserve_bytes: float | None
    """Bytes held back besides the margin; ``None`` when an explicit budget was given."""

    @property
    def explicit(self) -> bool:
        """The budget was given (``memory_budget_gib``), not derived from the device."""
        return self.margin is None and self.budget_bytes is not None

    def to_dict(self) -> dict:
        """The planner CLI's JSON keys of the budget (docs/contracts.md)."""
        return {"memory_budget_bytes": self.budget_bytes, "device_memory_bytes": self.device_memory_bytes,
                "memory_margin": self.margin, "memory_reserve_bytes": self.reserve_bytes}

    def describe(self) -> str:
        """One line: the budget and where it came from, e.g. ``71.6 GiB per GPU (80 GiB device
        - 8% margin - 2 GiB reserve; the trainer's default)``."""
        if self.budget_bytes is None:
            return "unlimited (no device memory known)"
        head = f"{self.budget_bytes / GIB:.4g} GiB per GPU"
        if self.explicit:
            return f"{head} (given: --memory-budget-gib / memory_budget_gib)"
        default = (self.margin == InfiniPipeConfig.memory_margin
                   and self.reserve_bytes == InfiniPipeConfig.memory_reserve_gib * GIB)
        return (f"{head} ({self.device_memory_bytes / GIB:.4g} GiB device - {100 * self.margin:.4g}% margin - "
                f"{self.reserve_bytes / GIB:.4g} GiB reserve" + ("; the trainer's default)" if default else ")"))


def plan_settings_of(values: dict) -> dict:
    """``PlanOptions`` keyword arguments from config ``values`` (field name -> value, such as
    ``vars(config)`` or the trainer arguments' config keywords): the :data:`PLAN_SETTINGS`, levels
    as a tuple.  Budgets, profile and layer split come from the device and engine, not from here."""
    out = {name: values[name] for name in PLAN_SETTINGS}
    out["checkpoint_levels"] = tuple(out["checkpoint_levels"])
    out["adopt_rounds_of"] = tuple(out["adopt_rounds_of"])
    return out


def planning_budget(device_memory_bytes: float | None, memory_margin: float, memory_reserve_gib: float,
                    memory_budget_gib: float | None = None) -> MemoryBudget:
    """The budget a plan stays under on a device of ``device_memory_bytes`` (``None``: unknown).

    ``memory_budget_gib`` wins when given; else the device's memory less ``memory_margin`` of it
    and ``memory_reserve_gib`` (the fields of :class:`InfiniPipeConfig`); unlimited when the
    device's memory is unknown.  ``ValueError`` when the derived budget is not positive."""
    if memory_budget_gib is not None:
        if not memory_budget_gib > 0:
            raise ValueError(f"memory_budget_gib (--memory-budget-gib) must be > 0, got {memory_budget_gib}")
        return MemoryBudget(memory_budget_gib * GIB, device_memory_bytes, None, None)
    if not 0.0 <= memory_margin < 0.5 or memory_reserve_gib < 0:
        raise ValueError(f"memory_margin (--memory-margin) must be in [0, 0.5) and memory_reserve_gib "
                         f"(--memory-reserve-gib) >= 0, got {memory_margin} and {memory_reserve_gib}")
    if device_memory_bytes is None:
        return MemoryBudget(None, None, memory_margin, memory_reserve_gib * GIB)
    # Rounded to a millionth of a GiB (a KiB), so the budget prints as a user would type it
    # (71.6, not 71.60000000000001) and ``memory_budget_gib`` set to that number plans the same bytes.
    budget = round((device_memory_bytes * (1.0 - memory_margin) - memory_reserve_gib * GIB) / GIB, 6) * GIB
    if budget <= 0:
        raise ValueError(f"a device of {device_memory_bytes / GIB:.4g} GiB less a {memory_margin:g} margin and "
                         f"{memory_reserve_gib:g} GiB reserve leaves {budget / GIB:.4g} GiB to plan to; give the "
                         f"budget itself (memory_budget_gib, --memory-budget-gib) or lower the reserve "
                         f"(memory_reserve_gib, --memory-reserve-gib)")
    return MemoryBudget(budget, device_memory_bytes, memory_margin, memory_reserve_gib * GIB)


def host_memory_bytes() -> float:
    """The machine's physical memory in bytes (``/proc/meminfo``'s MemTotal, else ``sysconf``)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
