"""``ParallelDims``: the one layout object of a job, built once and passed everywhere.

The world is ``dp_degree x pp_degree x sp_degree`` ranks, SP ranks adjacent, then the stages of
one replica, DP replicas outermost::

    rank = (dp_rank * pp_degree + stage_index) * sp_degree + sp_rank

A stage of one replica is a group of ``sp_degree`` ranks that share every unit (Ulysses SP), or,
in a plan with elastic SP rounds (``ir.rounds``), that run units on aligned sub-groups of it:
``size`` ranks from SP rank ``offset``, a power of two dividing ``sp_degree``.  Model states of a
stage may be sharded (FSDP2) over a *shard group* and its gradients reduced over the ranks that
hold the same shard (the *replica group*); :mod:`.shard_modes` says which mesh dims do which.

A group whose ranks sit on more than one node (``gpus_per_node`` ranks per node, filled in rank
order) is priced at the inter-node bandwidth, otherwise at the intra-node one.  Every group of a
kind is checked and one crossing group decides for all of them: the step waits for the slowest.

``ParallelDims.for_world`` (or ``InfiniPipeConfig.layout``) checks the degrees against the world
and that the runtime can run the shard mode (``check_runnable``); construction checks the shard
mode has ranks to shard over (what the planner needs to price it); ``check_model`` checks the
degrees against a model.  The planner's cost model, the plan search, the runtime's mesh and the trainer read this
object; none of them re-derives or re-checks the degrees.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from math import prod

from infinipipe_hf.layout.checks import (
    check_dp_request,
    check_heads,
    check_layers,
    check_shard_group,
    dp_for_world,
    positive_int,
)
from infinipipe_hf.layout.shard_modes import NO_SHARDING, SHARD_TABLE, ShardMode, shard_mode
from infinipipe_hf.layout.state_offload import NO_OFFLOAD, StateOffload, state_offload

MESH_DIMS = ("dp", "pp", "sp")
"""The mesh dims in rank order (outermost first)."""


@dataclass(frozen=True)
class ParallelDims:
    """Degrees, shard mode and node size of a job, and the rank groups they imply (module docstring)."""

    pp_degree: int = 1
    """Pipeline stages per replica."""
    sp_degree: int = 1
    """Ranks per stage sharing each unit's tokens (Ulysses sequence parallelism)."""
    dp_degree: int = 1
    """Data-parallel replicas of the whole pipeline."""
    shard: ShardMode = NO_SHARDING
    """Model-state sharding: a row of :data:`~.shard_modes.SHARD_TABLE` (a mode's name is accepted)."""
    gpus_per_node: int = 8
    """Ranks per node, filled in rank order: decides which groups cross nodes."""
    state_offload: StateOffload = NO_OFFLOAD
    """Model states in host memory: a row of :data:`~.state_offload.OFFLOAD_TABLE` (a name is accepted)."""

    def __post_init__(self) -> None:
        for name in ("pp_degree", "sp_degree", "dp_degree", "gpus_per_node"):
            positive_int(name, getattr(self, name))
        object.__setattr__(self, "shard", shard_mode(self.shard))
        object.__setattr__(self, "state_offload", state_offload(self.state_offload))
        if self.shard.sharded and self.shard_degree == 1:
            raise ValueError(self._no_group_message())

    @classmethod
    def for_world(cls, world_size: int, pp_degree: int = 1, sp_degree: int = 1, dp_degree: int | None = None,
                  shard: ShardMode = NO_SHARDING, gpus_per_node: int = 8, model=None,
                  state_offload: str | StateOffload = NO_OFFLOAD) -> "ParallelDims":
        """The layout of ``world_size`` processes: ``dp_degree`` derived (or checked) from the world,
        the shard mode runnable, and, given a ``model`` (``num_layers``, ``num_attention_heads``),
        the degrees against it (its layers first: launching more processes cannot fix those).
        ``shard`` is a row (``InfiniPipeConfig.shard_row()``): it is checked runnable on the world
        before it is built in, which a name could not be (``ValueError`` for a name)."""
        if not isinstance(shard, ShardMode):
            raise ValueError(f"ParallelDims.for_world takes a shard mode's row, got {shard!r}; pass "
                             f"InfiniPipeConfig(shard=...).shard_row(), or build ParallelDims(shard=name) directly")
        replica = cls(pp_degree, sp_degree)  # one replica, unsharded: checks the degrees are positive
        if model is not None:
            check_layers(replica, model.num_layers)
        layout = replace(replica, dp_degree=dp_for_world(world_size, replica))
        check_dp_request(world_size, layout, dp_degree)
        check_shard_group(layout, shard)  # before building it in: it names the group a launch lacks
        dims = replace(layout, shard=shard, gpus_per_node=gpus_per_node, state_offload=state_offload)
        if model is not None:
            dims.check_model(model.num_layers, model.num_attention_heads)
        return dims

    def check_runnable(self) -> None:
        """``ValueError`` unless the runtime can run this shard mode: every mesh dim FSDP2 spans has
        two ranks or more (a layout the planner prices may still not run, e.g. ``sp+dp`` at dp 1)."""
        check_shard_group(self, self.shard)

    def check_model(self, num_layers: int, num_attention_heads: int) -> None:
        """``ValueError`` when a stage would get no decoder layer or an SP rank no attention head."""
        check_layers(self, num_layers)
        check_heads(self, num_attention_heads)

    def _no_group_message(self) -> str:
        options = [m.name for m in SHARD_TABLE.values()
                   if m.sharded and self.ranks_over(m.shard_dims) > 1]
        hint = (f"use shard in ({', '.join(repr(m) for m in options)}) or 'none'" if options
                else "use shard='none', or raise sp_degree or dp_degree to have ranks to shard over")
        return (f"shard={self.shard.name!r} shards over the stage's {self.shard.group}, which has one rank here "
                f"(sp_degree={self.sp_degree}, dp_degree={self.dp_degree}); {hint}")

    # --- degrees ---------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp_degree * self.pp_degree * self.sp_degree

    def degree(self, dim: str) -> int:
        """Ranks along mesh dim ``dim`` (``"dp"``, ``"pp"`` or ``"sp"``)."""
        return {"dp": self.dp_degree, "pp": self.pp_degree, "sp": self.sp_degree}[dim]

    def ranks_over(self, dims: tuple[str, ...]) -> int:
        """Ranks of a group spanning the mesh dims ``dims`` (1 for none)."""
        return prod(self.degree(d) for d in dims)

    @property
    def shard_degree(self) -> int:
        """Ranks one stage's model states are split over (1 when unsharded)."""
        return self.ranks_over(self.shard.shard_dims)

    @property
    def sub_group_sizes(self) -> list[int]:
        """Sizes of the aligned SP sub-groups that need a process group of their own: the powers of
        two ``2 <= g < sp_degree`` dividing ``sp_degree`` (a group of one needs none, and the whole
        SP group has its own)."""
        sp = self.sp_degree
        return [g for g in (1 << k for k in range(1, sp.bit_length())) if g < sp and sp % g == 0]

    @property
    def replica_degree(self) -> int:
        """Ranks holding the same shard (or the whole stage when unsharded): gradients are
        all-reduced over them."""
        return self.sp_degree * self.dp_degree // self.shard_degree

    @property
    def label(self) -> str:
        return f"pp {self.pp_degree} x sp {self.sp_degree} x dp {self.dp_degree}"

    def __str__(self) -> str:
        offload = f", {self.state_offload.summary}" if self.state_offload.offloaded else ""
        return f"{self.label}, shard {self.shard.name}{offload} ({self.gpus_per_node} GPUs per node)"

    def degrees(self) -> dict:
        """The degrees, shard mode and (when any) state offload as ``InfiniPipeConfig`` /
        ``EPPTrainingArguments`` name them."""
        d = {"pp_degree": self.pp_degree, "sp_degree": self.sp_degree, "dp_degree": self.dp_degree,
             "shard": self.shard.name}
        if self.state_offload.offloaded:
            d["state_offload"] = self.state_offload.name
        return d

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
        return self._groups_over(self.shard.shard_dims)

    def replica_groups(self) -> list[list[int]]:
        """Groups over which gradients are all-reduced after any reduce-scatter."""
        return self._groups_over(self.shard.replicate_dims)

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
