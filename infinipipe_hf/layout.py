"""The parallel layout the planner prices: degrees, sharding mode, node size, and its groups.

The world is ``dp_degree x pp_degree x sp_degree`` ranks laid out as the runtime lays them out:
SP ranks adjacent, then the stages of one replica, DP replicas outermost::

    rank = (dp_rank * pp_degree + stage_index) * sp_degree + sp_rank

A stage of one replica is a group of ``sp_degree`` ranks that share every unit (Ulysses SP).
Model states of a stage may be sharded (FSDP2) over a *shard group* and its gradients reduced
over the ranks that hold the same shard (the *replica group*):

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
Trade-off: exact node membership of the real rank order, at the cost of enumerating the world's
ranks once per cost model (a few thousand at most).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

SHARD_MODES = ("none", "sp", "dp", "sp+dp", "hybrid")


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
        if self.shard not in SHARD_MODES:
            raise ValueError(f"shard={self.shard!r} is not known; use one of {', '.join(SHARD_MODES)}")
        if self.shard != "none" and self.shard_degree == 1:
            raise ValueError(self._no_group_message())

    def _no_group_message(self) -> str:
        group = {"sp": "SP group", "hybrid": "SP group", "dp": "DP replicas", "sp+dp": "SP x DP ranks"}[self.shard]
        options = [m for m in SHARD_MODES[1:] if _degree(m, self.sp_degree, self.dp_degree) > 1]
        hint = (f"use shard in ({', '.join(repr(m) for m in options)}) or 'none'" if options
                else "use shard='none', or raise sp_degree or dp_degree to have ranks to shard over")
        return (f"shard={self.shard!r} shards over the stage's {group}, which has one rank here "
                f"(sp_degree={self.sp_degree}, dp_degree={self.dp_degree}); {hint}")

    # --- degrees ---------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp_degree * self.pp_degree * self.sp_degree

    @property
    def shard_degree(self) -> int:
        """Ranks one stage's model states are split over (1 when unsharded)."""
        return _degree(self.shard, self.sp_degree, self.dp_degree)

    @property
    def replica_degree(self) -> int:
        """Ranks holding the same shard (or the whole stage when unsharded): gradients are
        all-reduced over them."""
        return self.sp_degree * self.dp_degree // self.shard_degree

    def rank(self, dp_rank: int, stage_index: int, sp_rank: int) -> int:
        return (dp_rank * self.pp_degree + stage_index) * self.sp_degree + sp_rank

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node

    # --- groups ----------------------------------------------------------------------------
    def sp_groups(self) -> list[list[int]]:
        return [[self.rank(d, s, r) for r in range(self.sp_degree)]
                for d in range(self.dp_degree) for s in range(self.pp_degree)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank(d, s, r) for d in range(self.dp_degree)]
                for s in range(self.pp_degree) for r in range(self.sp_degree)]

    def stage_groups(self) -> list[list[int]]:
        """All SP x DP ranks of each stage."""
        return [[self.rank(d, s, r) for d in range(self.dp_degree) for r in range(self.sp_degree)]
                for s in range(self.pp_degree)]

    def shard_groups(self) -> list[list[int]]:
        if self.shard in ("sp", "hybrid"):
            return self.sp_groups()
        if self.shard == "dp":
            return self.dp_groups()
        if self.shard == "sp+dp":
            return self.stage_groups()
        return [[r] for r in range(self.world_size)]

    def replica_groups(self) -> list[list[int]]:
        """Groups over which gradients are all-reduced after any reduce-scatter."""
        if self.shard in ("sp", "hybrid"):
            return self.dp_groups()
        if self.shard == "dp":
            return self.sp_groups()
        if self.shard == "sp+dp":
            return [[r] for r in range(self.world_size)]
        return self.stage_groups()

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


def _degree(shard: str, sp: int, dp: int) -> int:
    return {"none": 1, "sp": sp, "hybrid": sp, "dp": dp, "sp+dp": sp * dp}[shard]
