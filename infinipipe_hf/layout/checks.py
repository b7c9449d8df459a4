"""The layout's checks against the world, the model and the shard modes, with their messages.

Each runs before any process group exists, so every rank fails alike; :class:`~.dims.ParallelDims`
calls them (``for_world``, ``check_model``, its own construction) and nothing else does.
"""
from __future__ import annotations

from infinipipe_hf.layout.shard_modes import ShardMode


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def dp_for_world(world_size: int, pp_degree: int, sp_degree: int, dp_degree: int | None = None) -> int:
    """``dp_degree`` of ``world_size`` processes at ``pp x sp``; ``ValueError`` naming what fits."""
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
    dp = world_size // stage_ranks
    if dp_degree is not None and dp_degree != dp:
        raise ValueError(f"dp_degree={dp_degree} x pp_degree={pp_degree} x sp_degree={sp_degree} != world size "
                         f"{world_size}; set dp_degree={dp} or leave it None")
    return dp


def check_heads(sp_degree: int, num_heads: int, pp_degree: int, world: int) -> None:
    """Ulysses gives each SP rank whole attention heads (unevenly when they do not divide)."""
    if sp_degree <= num_heads:
        return
    ok = [d for d in divisors(world // pp_degree) if d <= num_heads] if world % pp_degree == 0 else []
    raise ValueError(f"sp_degree={sp_degree} is larger than the model's {num_heads} attention heads: each "
                     f"sequence-parallel rank computes at least one head; use sp_degree <= {num_heads}"
                     + (f" (with pp_degree={pp_degree} on {world} processes: {', '.join(map(str, ok))})"
                        if ok else ""))


def check_layers(pp_degree: int, num_layers: int) -> None:
    if pp_degree > num_layers:
        raise ValueError(f"pp_degree={pp_degree} is larger than the model's {num_layers} decoder layers (each "
                         f"stage needs at least one); use pp_degree <= {num_layers}")


_NO_GROUP = {"dp": ("data-parallel replicas", "DP", "launch more processes (world = dp x pp x sp with dp >= 2)"),
             "sp": ("sequence-parallel ranks", "SP", "set sp_degree >= 2")}


def check_shard_group(mode: ShardMode, dp_degree: int, sp_degree: int) -> None:
    """``ValueError`` unless every mesh dim FSDP2 spans for ``mode`` has two ranks or more."""
    sizes = {"dp": dp_degree, "sp": sp_degree}
    if not mode.sharded or all(sizes[d] >= 2 for d in mode.fsdp_dims):
        return
    world = f"dp_degree={dp_degree}, sp_degree={sp_degree}"
    alt = [m for m, ok in (("sp", sp_degree > 1), ("dp", dp_degree > 1)) if ok]
    instead = f"use shard={alt[0]!r} or 'none'" if alt else "use shard='none'"
    if len(mode.fsdp_dims) == 1:
        ranks, name, fix = _NO_GROUP[mode.fsdp_dims[0]]
        raise ValueError(f"shard={mode.name!r} shards each stage over its {ranks}, but this run has {world}: "
                         f"there is no {name} group; {fix} or {instead}")
    raise ValueError(f"shard={mode.name!r} {mode.summary}, which needs dp_degree >= 2 and sp_degree >= 2, "
                     f"but this run has {world}; {instead}")


def sub_group_sizes(sp_degree: int) -> list[int]:
    """Sizes of the aligned SP sub-groups that need a process group of their own: the powers of
    two ``2 <= g < sp_degree`` dividing ``sp_degree`` (a group of one needs none, and the whole
    SP group has its own)."""
    return [g for g in (1 << k for k in range(1, sp_degree.bit_length())) if g < sp_degree and sp_degree % g == 0]
