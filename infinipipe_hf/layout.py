"""The parallel layout of a job: degrees, the shard modes, the rank groups, and every world check.

The world is ``dp_degree x pp_degree x sp_degree`` ranks, SP ranks adjacent, then the stages of
one replica, DP replicas outermost::

    rank = (dp_rank * pp_degree + stage_index) * sp_degree + sp_rank

A stage of one replica is a group of ``sp_degree`` ranks that share every unit (Ulysses SP), or,
in a plan with rounds (``ir.rounds``), that run units on aligned sub-groups of it: ``size`` ranks
from SP rank ``offset``, a power of two dividing ``sp_degree`` (:func:`sub_group_sizes`).
Model states of a stage may be sharded (FSDP2) over a *shard group* and its gradients reduced
over the ranks that hold the same shard (the *replica group*); :data:`SHARD_TABLE` says which
mesh dims do which for each mode:

======== ============================ ====================================================
shard    shard group (degree)         gradients after the step's backward
======== ============================ ====================================================
none     -- (1)                       all-reduce over the stage's SP x DP ranks
sp       the stage's SP group (sp)    reduce-scatter over SP, all-reduce over DP replicas
hybrid   the stage's SP group (sp)    the same: shard over SP, replicate over DP (HSDP)
dp       the stage's DP ranks (dp)    reduce-scatter over DP, all-reduce over SP ranks
sp+dp    both (sp x dp)               reduce-scatter over all of the stage's ranks
======== ============================ ====================================================

A group whose ranks sit on more than one node (``gpus_per_node`` ranks per node, filled in rank
order) is priced at the inter-node bandwidth, otherwise at the intra-node one.  Every group of a
kind is checked and one crossing group decides for all of them: the step waits for the slowest.
The planner, the runtime, the trainer and the CLI all take their degrees, groups and world
checks from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

MESH_DIMS = ("dp", "pp", "sp")
"""The mesh dims in rank order (outermost first)."""


@dataclass(frozen=True)
class ShardMode:
    """How one shard mode splits a stage's model states over the stage's DP x SP ranks."""

    name: str
    shard_dims: tuple[str, ...]
    """Mesh dims the stage's states are split over (the shard group)."""
    replicate_dims: tuple[str, ...]
    """Mesh dims whose ranks hold the same shard: gradients are all-reduced over them."""
    hsdp: bool = False
    """FSDP2 takes the 2-D mesh (replicate dims, shard dims) and all-reduces over the replicas itself."""
    group: str = ""
    """The shard group in words (messages)."""
    summary: str = ""
    """What the mode does in words (messages)."""

    @property
    def sharded(self) -> bool:
        return bool(self.shard_dims)

    @property
    def per_step_gather(self) -> bool:
        """The shard group spans DP replicas, whose unit lists differ: every module is gathered
        once per step instead of per unit."""
        return "dp" in self.shard_dims

    @property
    def fsdp_dims(self) -> tuple[str, ...]:
        """Mesh dims of the mesh FSDP2 is given (flattened to one dim unless ``hsdp``)."""
        return self.replicate_dims + self.shard_dims if self.hsdp else self.shard_dims

    @property
    def extra_dims(self) -> tuple[str, ...]:
        """Replicate dims FSDP2 does not reduce over: the runtime sums their gradients itself."""
        return () if self.hsdp or not self.sharded else self.replicate_dims

    def degree(self, sp_degree: int, dp_degree: int) -> int:
        """Ranks one stage's states are split over (1 when unsharded)."""
        sizes = {"sp": sp_degree, "dp": dp_degree}
        n = 1
        for dim in self.shard_dims:
            n *= sizes[dim]
        return n


SHARD_TABLE: dict[str, ShardMode] = {m.name: m for m in (
    ShardMode("none", (), ("dp", "sp")),
    ShardMode("sp", ("sp",), ("dp",), group="SP group", summary="shards over SP"),
    ShardMode("dp", ("dp",), ("sp",), group="DP replicas", summary="shards over DP"),
    ShardMode("sp+dp", ("dp", "sp"), (), group="SP x DP ranks", summary="shards over SP x DP"),
    ShardMode("hybrid", ("sp",), ("dp",), hsdp=True, group="SP group",
              summary="shards over SP and replicates over DP"),
)}
SHARD_MODES = tuple(SHARD_TABLE)


def shard_mode(shard: str) -> ShardMode:
    """The row of ``shard``; ``ValueError`` when it is not known."""
    if shard not in SHARD_TABLE:
        raise ValueError(f"shard={shard!r} is not known; use one of {', '.join(SHARD_MODES)}")
    return SHARD_TABLE[shard]


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class LayoutSpec:
    """Degrees and sharding of a training job, and the rank groups they imply (module docstring)."""

    pp_degree: int = 1
    """Pipeline stages per replica."""
    sp_degree: int = 1
    """Ranks per stage sharing each unit's tokens (Ulysses sequence parallelism)."""
    dp_degree: int = 1
    """Data-parallel replicas of the whole pipeline."""
    shard: str = "none"
    """Model-state sharding: one of :data:`SHARD_MODES` (see the module docstring)."""
    gpus_per_node: int = 8
    """Ranks per node, filled in rank order: decides which groups cross nodes."""

    def __post_init__(self) -> None:
        for name in ("pp_degree", "sp_degree", "dp_degree", "gpus_per_node"):
            _positive_int(name, getattr(self, name))
        mode = shard_mode(self.shard)
        if mode.sharded and self.shard_degree == 1:
            raise ValueError(self._no_group_message())

    def _no_group_message(self) -> str:
        options = [m.name for m in SHARD_TABLE.values()
                   if m.sharded and m.degree(self.sp_degree, self.dp_degree) > 1]
        hint = (f"use shard in ({', '.join(repr(m) for m in options)}) or 'none'" if options
                else "use shard='none', or raise sp_degree or dp_degree to have ranks to shard over")
        return (f"shard={self.shard!r} shards over the stage's {self.mode.group}, which has one rank here "
                f"(sp_degree={self.sp_degree}, dp_degree={self.dp_degree}); {hint}")

    # --- degrees ---------------------------------------------------------------------------
    @property
    def mode(self) -> ShardMode:
        return SHARD_TABLE[self.shard]

    @property
    def world_size(self) -> int:
        return self.dp_degree * self.pp_degree * self.sp_degree

    @property
    def shard_degree(self) -> int:
        """Ranks one stage's model states are split over (1 when unsharded)."""
        return self.mode.degree(self.sp_degree, self.dp_degree)

    @property
    def replica_degree(self) -> int:
        """Ranks holding the same shard (or the whole stage when unsharded): gradients are
        all-reduced over them."""
        return self.sp_degree * self.dp_degree // self.shard_degree

    # --- ranks -----------------------------------------------------------------------------
    def rank(self, dp_rank: int, stage_index: int, sp_rank: int) -> int:
        return (dp_rank * self.pp_degree + stage_index) * self.sp_degree + sp_rank

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(dp_rank, stage_index, sp_rank)`` of ``rank``: the inverse of :meth:`rank`."""
        return (rank // (self.sp_degree * self.pp_degree), (rank // self.sp_degree) % self.pp_degree,
                rank % self.sp_degree)

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    # --- groups ----------------------------------------------------------------------------
    def sp_group(self, dp_rank: int, stage_index: int) -> list[int]:
        """The SP ranks of one stage of one replica."""
        return [self.rank(dp_rank, stage_index, r) for r in range(self.sp_degree)]

    def dp_group(self, stage_index: int, sp_rank: int) -> list[int]:
        """One stage's ranks with one SP rank, one per replica."""
        return [self.rank(d, stage_index, sp_rank) for d in range(self.dp_degree)]

    def pipeline_group(self, dp_rank: int, sp_rank: int) -> list[int]:
        """Every stage of one replica, with one SP rank."""
        return [self.rank(dp_rank, s, sp_rank) for s in range(self.pp_degree)]

    def stage_group(self, stage_index: int) -> list[int]:
        """All SP x DP ranks of one stage (ascending)."""
        return [self.rank(d, stage_index, r) for d in range(self.dp_degree) for r in range(self.sp_degree)]

    def sp_groups(self) -> list[list[int]]:
        return [self.sp_group(d, s) for d in range(self.dp_degree) for s in range(self.pp_degree)]

    def sub_group(self, dp_rank: int, stage_index: int, offset: int, size: int) -> list[int]:
        """SP ranks ``offset .. offset + size - 1`` of one stage of one replica (an SP sub-group)."""
        return [self.rank(dp_rank, stage_index, r) for r in range(offset, offset + size)]

    def sub_groups(self, size: int) -> list[list[int]]:
        """Every aligned SP sub-group of ``size`` ranks, over all stages and replicas."""
        return [self.sub_group(d, s, o, size) for d in range(self.dp_degree) for s in range(self.pp_degree)
                for o in range(0, self.sp_degree, size)]

    def dp_groups(self) -> list[list[int]]:
        return [self.dp_group(s, r) for s in range(self.pp_degree) for r in range(self.sp_degree)]

    def stage_groups(self) -> list[list[int]]:
        """All SP x DP ranks of each stage."""
        return [self.stage_group(s) for s in range(self.pp_degree)]

    def _groups_over(self, dims: tuple[str, ...]) -> list[list[int]]:
        """The groups spanning the mesh dims ``dims`` (subsets of ``("dp", "sp")``)."""
        if set(dims) == {"dp", "sp"}:
            return self.stage_groups()
        if dims == ("sp",):
            return self.sp_groups()
        if dims == ("dp",):
            return self.dp_groups()
        return [[r] for r in range(self.world_size)]

    def shard_groups(self) -> list[list[int]]:
        return self._groups_over(self.mode.shard_dims)

    def replica_groups(self) -> list[list[int]]:
        """Groups over which gradients are all-reduced after any reduce-scatter."""
        return self._groups_over(self.mode.replicate_dims)

    def crosses_nodes(self, groups: list[list[int]]) -> bool:
        """True when some group has ranks on two or more nodes."""
        return any(len({self.node(r) for r in g}) > 1 for g in groups)

    def ranks_per_node(self, groups: list[list[int]]) -> int:
        """Fewest ranks any group has on one of its nodes (the worst all-to-all split)."""
        worst = None
        for g in groups:
            counts: dict[int, int] = {}
            for r in g:
                counts[self.node(r)] = counts.get(self.node(r), 0) + 1
            low = min(counts.values())
            worst = low if worst is None else min(worst, low)
        return worst or 1

    @cached_property
    def sp_crosses_nodes(self) -> bool:
        return self.crosses_nodes(self.sp_groups())

    @cached_property
    def shard_crosses_nodes(self) -> bool:
        return self.crosses_nodes(self.shard_groups())

    @cached_property
    def replica_crosses_nodes(self) -> bool:
        return self.crosses_nodes(self.replica_groups())

    @cached_property
    def stage_link_crosses_nodes(self) -> bool:
        """True when some rank sends its activations to the next stage on another node."""
        return any(self.node(self.rank(d, s, r)) != self.node(self.rank(d, s + 1, r))
                   for d in range(self.dp_degree) for s in range(self.pp_degree - 1)
                   for r in range(self.sp_degree))


# --- world checks (before any process group exists, so every rank fails alike) -----------------
def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve_dp_degree(world_size: int, pp_degree: int, sp_degree: int, dp_degree: int | None = None) -> int:
    """Check ``pp_degree``, ``sp_degree`` (and ``dp_degree``) against the world; return ``dp_degree``."""
    stage_ranks = pp_degree * sp_degree
    if world_size % stage_ranks != 0:
        if sp_degree == 1:
            ok = ", ".join(str(d) for d in divisors(world_size))
            raise ValueError(f"pp_degree={pp_degree} does not divide world size {world_size}; "
                             f"use {ok}")
        pairs = ", ".join(f"{p}x{d}" for p in divisors(world_size)
                          for d in divisors(world_size // p))
        raise ValueError(f"pp_degree={pp_degree} x sp_degree={sp_degree} = {stage_ranks} "
                         f"does not divide world size {world_size}; use a pp x sp product that "
                         f"divides it (pp x sp among {pairs})")
    dp = world_size // stage_ranks
    if dp_degree is not None and dp_degree != dp:
        raise ValueError(f"dp_degree={dp_degree} x pp_degree={pp_degree} x sp_degree="
                         f"{sp_degree} != world size {world_size}; set dp_degree={dp} or "
                         f"leave it None")
    return dp


def check_launch(world: int, pp_degree: int, sp_degree: int) -> int:
    """``dp_degree`` of ``world`` launched processes; a clear error when pp_degree x sp_degree
    does not divide them (the trainer's wording: it names the launch)."""
    ok = divisors(world)
    if world % pp_degree != 0:
        raise ValueError(f"pp_degree={pp_degree} does not divide the {world} processes launched; "
                         f"use pp_degree in {ok} or launch a multiple of {pp_degree} processes")
    group = pp_degree * sp_degree
    if world % group != 0:
        fits = [d for d in ok if (world // pp_degree) % d == 0]
        raise ValueError(f"pp_degree={pp_degree} x sp_degree={sp_degree} = {group} does not divide the {world} "
                         f"processes launched; with pp_degree={pp_degree} use sp_degree in {fits}, or "
                         f"launch a multiple of {group} processes")
    return world // group


def sub_group_sizes(sp_degree: int) -> list[int]:
    """Sizes of the aligned SP sub-groups that need a process group of their own: the powers of
    two ``2 <= g < sp_degree`` dividing ``sp_degree`` (a group of one needs none, and the whole
    SP group has its own)."""
    return [g for g in (1 << k for k in range(1, sp_degree.bit_length())) if g < sp_degree and sp_degree % g == 0]


def check_sp_heads(sp_degree: int, num_heads: int, pp_degree: int, world: int) -> None:
    """Ulysses gives each SP rank whole attention heads (unevenly when they do not divide)."""
    if sp_degree <= num_heads:
        return
    ok = [d for d in divisors(world // pp_degree) if d <= num_heads] if world % pp_degree == 0 else []
    raise ValueError(f"sp_degree={sp_degree} is larger than the model's "
                     f"{num_heads} attention heads: each sequence-parallel "
                     f"rank computes at least one head; use sp_degree <= {num_heads}"
                     + (f" (with pp_degree={pp_degree} on {world} processes: "
                        f"{', '.join(map(str, ok))})" if ok else ""))


_NO_GROUP = {"dp": ("data-parallel replicas", "DP", "launch more processes (world = dp x pp x sp with dp >= 2)"),
             "sp": ("sequence-parallel ranks", "SP", "set sp_degree >= 2")}


def check_shard_mode(shard: str, dp_degree: int, sp_degree: int) -> None:
    """``ValueError`` when the runtime has no group for ``shard``: every dim FSDP2's mesh spans
    needs two ranks or more."""
    if shard == "none":
        return
    mode = shard_mode(shard)
    world = f"dp_degree={dp_degree}, sp_degree={sp_degree}"
    sizes = {"dp": dp_degree, "sp": sp_degree}
    if all(sizes[d] >= 2 for d in mode.fsdp_dims):
        return
    alt = [m for m, ok in (("sp", sp_degree > 1), ("dp", dp_degree > 1)) if ok]
    instead = f"use shard={alt[0]!r} or 'none'" if alt else "use shard='none'"
    if len(mode.fsdp_dims) == 1:
        ranks, name, fix = _NO_GROUP[mode.fsdp_dims[0]]
        raise ValueError(f"shard={shard!r} shards each stage over its {ranks}, but this "
                         f"run has {world}: there is no {name} group; {fix} or {instead}")
    raise ValueError(f"shard={shard!r} {mode.summary}, which needs dp_degree >= 2 and sp_degree >= 2, "
                     f"but this run has {world}; {instead}")
