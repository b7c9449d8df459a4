"""The layout's checks against the world, the model and the shard modes, with their messages.

Each runs before any process group exists, so every rank fails alike; :class:`~.dims.ParallelDims`
calls them (``for_world``, ``check_model``, its own construction) and nothing else does.
"""
from __future__ import annotations

from typing import Protocol

from infinipipe_hf.layout.shard_modes import ShardMode


class Degrees(Protocol):
    """What the checks read of a layout (:class:`~.dims.ParallelDims`, which calls them)."""

    pp_degree: int
    sp_degree: int
    dp_degree: int

    @property
    def world_size(self) -> int: ...

    def degree(self, dim: str) -> int: ...


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def dp_for_world(world_size: int, replica: Degrees) -> int:
    """DP replicas of ``replica`` (one replica's ``pp x sp`` ranks) that ``world_size`` processes
    hold; ``ValueError`` naming what fits."""
    pp_degree, sp_degree = replica.pp_degree, replica.sp_degree
    stage_ranks = pp_degree * sp_degree
    if world_size % stage_ranks != 0:
        if sp_degree == 1:
            ok = ", ".join(str(d) for d in divisors(world_size))
            raise ValueError(f"pp_degree={pp_degree} does not divide world size {world_size} (the processes "
                             f"launched); use {ok}, or launch a multiple of {pp_degree} processes")
        fits = [d for d in divisors(world_size // pp_degree)] if world_size % pp_degree == 0 else []
        pairs = ", ".join(f"{p}x{d}" for p in divisors(world_size) for d in divisors(world_size // p))
        hint = (f"with pp_degree={pp_degree} use sp_degree in {fits}" if fits
                else f"use a pp x sp product that divides it (pp x sp among {pairs})")
        raise ValueError(f"pp_degree={pp_degree} x sp_degree={sp_degree} = {stage_ranks} does not divide world "
                         f"size {world_size} (the processes launched); {hint}, or launch a multiple of "
                         f"{stage_ranks} processes")
    return world_size // stage_ranks


def check_dp_request(world_size: int, dims: Degrees, requested: int | None) -> None:
    """``ValueError`` when a ``dp_degree`` was asked for and the world gives ``dims`` another one."""
    if requested is not None and requested != dims.dp_degree:
        raise ValueError(f"dp_degree={requested} x pp_degree={dims.pp_degree} x sp_degree={dims.sp_degree} != "
                         f"world size {world_size}; set dp_degree={dims.dp_degree} or leave it None")


def check_heads(dims: Degrees, num_heads: int) -> None:
    """Ulysses gives each SP rank whole attention heads (unevenly when they do not divide)."""
    sp_degree, pp_degree, world = dims.sp_degree, dims.pp_degree, dims.world_size
    if sp_degree <= num_heads:
        return
    ok = [d for d in divisors(world // pp_degree) if d <= num_heads] if world % pp_degree == 0 else []
    raise ValueError(f"sp_degree={sp_degree} is larger than the model's {num_heads} attention heads: each "
                     f"sequence-parallel rank computes at least one head; use sp_degree <= {num_heads}"
                     + (f" (with pp_degree={pp_degree} on {world} processes: {', '.join(map(str, ok))})"
                        if ok else ""))


def check_layers(dims: Degrees, num_layers: int) -> None:
    """``ValueError`` when a stage would get no decoder layer."""
    pp_degree = dims.pp_degree
    if pp_degree > num_layers:
        raise ValueError(f"pp_degree={pp_degree} is larger than the model's {num_layers} decoder layers (each "
                         f"stage needs at least one); use pp_degree <= {num_layers}")


_NO_GROUP = {"dp": ("data-parallel replicas", "DP", "launch more processes (world = dp x pp x sp with dp >= 2)"),
             "sp": ("sequence-parallel ranks", "SP", "set sp_degree >= 2")}


def check_shard_group(dims: Degrees, mode: ShardMode) -> None:
    """``ValueError`` unless every mesh dim FSDP2 spans for ``mode`` has two ranks or more in
    ``dims`` (whose own shard mode is not read: ``for_world`` checks a mode before building it in)."""
    if not mode.sharded or all(dims.degree(d) >= 2 for d in mode.fsdp_dims):
        return
    dp_degree, sp_degree = dims.dp_degree, dims.sp_degree
    world = f"dp_degree={dp_degree}, sp_degree={sp_degree}"
    alt = [m for m, ok in (("sp", sp_degree > 1), ("dp", dp_degree > 1)) if ok]
    instead = f"use shard={alt[0]!r} or 'none'" if alt else "use shard='none'"
    if len(mode.fsdp_dims) == 1:
        ranks, name, fix = _NO_GROUP[mode.fsdp_dims[0]]
        raise ValueError(f"shard={mode.name!r} shards each stage over its {ranks}, but this run has {world}: "
                         f"there is no {name} group; {fix} or {instead}")
    raise ValueError(f"shard={mode.name!r} {mode.summary}, which needs dp_degree >= 2 and sp_degree >= 2, "
                     f"but this run has {world}; {instead}")
