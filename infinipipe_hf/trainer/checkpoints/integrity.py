"""Checking a checkpoint's files with every rank's help, decided identically on every rank.

Design: hashing a checkpoint is reading all of it (weights plus twice their size of Adam states),
so one rank alone would take minutes on a large model while the others wait in a collective.
``Exchange`` shares the files out over the ranks (largest first, to the least loaded rank), each
rank checks its share, and the per-file answers are all-gathered: every rank then holds the same
answers and reaches the same verdict.  What only one view of the filesystem may decide (which
folders exist, what a manifest says) comes from rank 0 by ``broadcast``; an error on rank 0 is
re-raised on every rank rather than leaving the others waiting.  All ranks must see the
checkpoint folder (as loading already requires).  Without a process group (or with one rank)
everything runs locally.
"""
from __future__ import annotations

from typing import Any, Callable


def shares(sizes: dict[str, int], n: int) -> list[list[str]]:
    """``sizes`` (file -> bytes) dealt to ``n`` ranks with balanced bytes; deterministic."""
    if n < 1:
        raise ValueError(f"need at least one rank, got {n}")
    load = [0] * n
    out: list[list[str]] = [[] for _ in range(n)]
    for name in sorted(sizes, key=lambda k: (-sizes[k], k)):
        r = min(range(n), key=lambda i: (load[i], i))
        out[r].append(name)
        load[r] += max(sizes[name], 1)
    return out


class Exchange:
    """Rank 0's answers and shared-out work for the ranks of the default process group."""

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.rank = rank
        self.world_size = world_size

    @classmethod
    def current(cls) -> "Exchange":
        """The default process group's ranks, or a local exchange without one."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    def broadcast(self, produce: Callable[[], Any]) -> Any:
        """``produce()`` run on rank 0, its value on every rank; its error raised on every rank."""
        if self.world_size == 1:
            return produce()
        import torch.distributed as dist

        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = ("ok", produce())
            except Exception as exc:  # every rank must leave the collective, then raise
                box[0] = ("error", f"{type(exc).__name__}: {exc}")
        dist.broadcast_object_list(box, src=0)
        kind, value = box[0]
        if kind == "error":
            raise RuntimeError(f"rank 0 failed while checking a checkpoint: {value}")
        return value

    def map_files(self, sizes: dict[str, int], check: Callable[[str], Any]
                  ) -> tuple[dict[str, Any], dict[str, str]]:
        """``check(name)`` for every file of ``sizes``, spread over the ranks: ``(answers, errors)``,
        the same on every rank; a file whose ``check`` raised is in ``errors`` with the error."""
        mine: tuple[dict[str, Any], dict[str, str]] = ({}, {})
        for name in shares(sizes, self.world_size)[self.rank]:
            try:
                mine[0][name] = check(name)
            except Exception as exc:  # answered, never left pending on the other ranks
                mine[1][name] = f"{type(exc).__name__}: {exc}"
        if self.world_size == 1:
            return mine
        import torch.distributed as dist

        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, mine)
        answers: dict[str, Any] = {}
        errors: dict[str, str] = {}
        for got, failed in parts:
            answers.update(got)
            errors.update(failed)
        return answers, errors
