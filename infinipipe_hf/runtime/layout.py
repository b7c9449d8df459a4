"""``ParallelLayout``: where this rank sits in the dp x pp grid, and the process groups it uses.

Design: rank = dp_rank * pp_degree + stage_index, so the stages of one replica are neighbouring
ranks (on a multi-GPU node, pipeline point-to-point stays on fast local links while the once-per-
step DP all-reduce crosses nodes).  The layout object owns its groups: there is no module-level
singleton, so two engines (or a test building several layouts) never share hidden state.

Trade-off: ``torch.distributed.new_group`` is collective over the whole world, so *every* rank
creates *every* group in the same fixed order (all DP groups, then all PP groups, then all tied-
embedding groups), even the ones it is not a member of.  That costs a little start-up time for
large worlds but is the only deadlock-free way with the c10d API.  Point-to-point traffic uses
global ranks on the default group, so the PP groups are only used for the few collectives over
one replica (gradient-norm reduction).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any


@dataclass
class ParallelLayout:
    """This rank's coordinates and process groups.  ``groups_enabled=False`` skips ``new_group``
    (world of one, or pure coordinate arithmetic in unit tests)."""

    world_size: int
    rank: int
    pp_degree: int
    dp_degree: int
    tied_embeddings: bool = False
    timeout_s: float | None = None
    groups_enabled: bool = True
    dp_group: Any = field(default=None, init=False, repr=False)
    pp_group: Any = field(default=None, init=False, repr=False)
    tied_group: Any = field(default=None, init=False, repr=False)
    link_groups: dict[tuple[int, int], Any] = field(default_factory=dict, init=False, repr=False)
    """``(src, dst)`` global ranks -> the group carrying that direction of one pipeline link."""

    def __post_init__(self) -> None:
        if self.pp_degree < 1 or self.dp_degree < 1:
            raise ValueError(f"pp_degree and dp_degree must be >= 1, got pp={self.pp_degree}, "
                             f"dp={self.dp_degree}")
        if self.pp_degree * self.dp_degree != self.world_size:
            raise ValueError(f"dp_degree={self.dp_degree} x pp_degree={self.pp_degree} != world size "
                             f"{self.world_size}; choose a pp_degree that divides the world size")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if self.groups_enabled and self.world_size > 1:
            self._build_groups()

    # --- coordinates ---------------------------------------------------------------------
    @property
    def stage_index(self) -> int:
        return self.rank % self.pp_degree

    @property
    def dp_rank(self) -> int:
        return self.rank // self.pp_degree

    @property
    def is_first_stage(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_index == self.pp_degree - 1

    def global_rank(self, dp_rank: int, stage_index: int) -> int:
        return dp_rank * self.pp_degree + stage_index

    @property
    def prev_rank(self) -> int | None:
        """Global rank of the previous stage of this replica (``None`` on the first stage)."""
        return None if self.is_first_stage else self.rank - 1

    @property
    def next_rank(self) -> int | None:
        return None if self.is_last_stage else self.rank + 1

    def dp_ranks_of_stage(self, stage_index: int) -> list[int]:
        return [self.global_rank(d, stage_index) for d in range(self.dp_degree)]

    def pp_ranks_of_replica(self, dp_rank: int) -> list[int]:
        return [self.global_rank(dp_rank, s) for s in range(self.pp_degree)]

    @property
    def has_tied_pair(self) -> bool:
        """True when embeddings are tied across two different stages (they must be summed)."""
        return self.tied_embeddings and self.pp_degree > 1

    def describe(self, rank: int | None = None) -> str:
        r = self.rank if rank is None else rank
        return f"rank {r} (stage {r % self.pp_degree}, dp {r // self.pp_degree})"

    # --- groups --------------------------------------------------------------------------
    def link_group(self, src: int, dst: int):
        """Group for point-to-point traffic from ``src`` to ``dst`` (``None``: default group)."""
        return self.link_groups.get((src, dst))

    def _build_groups(self) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError(f"world size {self.world_size} > 1 needs torch.distributed initialised; "
                             f"call torch.distributed.init_process_group() first (e.g. under torchrun)")
        kw = {} if self.timeout_s is None else {"timeout": timedelta(seconds=self.timeout_s)}
        # Same creation order on every rank: new_group is a collective over the world.
        for s in range(self.pp_degree):
            g = dist.new_group(self.dp_ranks_of_stage(s), **kw)
            if s == self.stage_index:
                self.dp_group = g
        for d in range(self.dp_degree):
            g = dist.new_group(self.pp_ranks_of_replica(d), **kw)
            if d == self.dp_rank:
                self.pp_group = g
        if self.has_tied_pair:
            for d in range(self.dp_degree):
                pair = [self.global_rank(d, 0), self.global_rank(d, self.pp_degree - 1)]
                g = dist.new_group(pair, **kw)
                if d == self.dp_rank and (self.is_first_stage or self.is_last_stage):
                    self.tied_group = g
        for d in range(self.dp_degree):
            for s in range(self.pp_degree - 1):
                a, b = self.global_rank(d, s), self.global_rank(d, s + 1)
                forward, backward = dist.new_group([a, b], **kw), dist.new_group([a, b], **kw)
                if self.rank in (a, b):
                    self.link_groups[(a, b)] = forward
                    self.link_groups[(b, a)] = backward
