"""The shard modes: how one stage's model states split over its DP x SP ranks (one table).

======== ============================ ====================================================
shard    shard group (degree)         gradients after the step's backward
======== ============================ ====================================================
none     -- (1)                       all-reduce over the stage's SP x DP ranks
sp       the stage's SP group (sp)    reduce-scatter over SP, all-reduce over DP replicas
hybrid   the stage's SP group (sp)    the same: shard over SP, replicate over DP (HSDP)
dp       the stage's DP ranks (dp)    reduce-scatter over DP, all-reduce over SP ranks
sp+dp    both (sp x dp)               reduce-scatter over all of the stage's ranks
======== ============================ ====================================================

Code asks a :class:`ShardMode` what it does (``sharded``, ``shard_dims``...), never compares
its name: a new mode is one row here.
"""
from __future__ import annotations

from dataclasses import dataclass


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

    def __str__(self) -> str:
        return self.name

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

    @property
    def pricing_key(self) -> tuple:
        """Modes with equal keys are priced alike (the cost model reads the dims only)."""
        return (self.shard_dims, self.replicate_dims)


SHARD_TABLE: dict[str, ShardMode] = {m.name: m for m in (
    ShardMode("none", (), ("dp", "sp")),
    ShardMode("sp", ("sp",), ("dp",), group="SP group", summary="shards over SP"),
    ShardMode("dp", ("dp",), ("sp",), group="DP replicas", summary="shards over DP"),
    ShardMode("sp+dp", ("dp", "sp"), (), group="SP x DP ranks", summary="shards over SP x DP"),
    ShardMode("hybrid", ("sp",), ("dp",), hsdp=True, group="SP group",
              summary="shards over SP and replicates over DP"),
)}
SHARD_MODES = tuple(SHARD_TABLE)
NO_SHARDING = SHARD_TABLE["none"]


def shard_mode(shard: str | ShardMode) -> ShardMode:
    """The row of ``shard`` (a name or a row); ``ValueError`` when it is not known."""
    if isinstance(shard, ShardMode):
        return shard
    if shard not in SHARD_TABLE:
        raise ValueError(f"shard={shard!r} is not known; use one of {', '.join(SHARD_MODES)}")
    return SHARD_TABLE[shard]


def sharding_over(dims) -> ShardMode:
    """The mode that shards over exactly the mesh dims ``dims`` (FSDP's flat mesh, not HSDP)."""
    want = set(dims)
    for mode in SHARD_TABLE.values():
        if set(mode.shard_dims) == want and not mode.hsdp:
            return mode
    raise ValueError(f"no shard mode shards over exactly {sorted(want)}; the modes are {', '.join(SHARD_MODES)}")
