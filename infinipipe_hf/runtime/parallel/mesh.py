"""``ParallelLayout``: where this rank sits in the dp x pp x sp grid, on a torch ``DeviceMesh``.

Design: ranks are numbered as the job's ``ParallelDims`` numbers them (``infinipipe_hf.layout``): the SP
ranks of one stage are neighbours (one node: Ulysses all-to-alls stay on NVLink), the stages of one replica
come next (pipeline point-to-point crosses nodes once per link), DP replicas are outermost (the
once-per-step gradient all-reduce).  The process groups of the three dimensions come from one
``DeviceMesh`` with dims ``("dp", "pp", "sp")``, which FSDP2 takes as well (its shard and
replicate groups are sub-meshes of the same mesh), so there is no hand-made group bookkeeping for
them.  The layout object owns its mesh and groups: there is no module-level singleton, so two
engines (or a test building several layouts) never share hidden state.

Elastic SP (``ir.rounds``): a unit may run on an aligned *sub-group* of its stage's SP ranks.
The process group of every aligned sub-group size ``2 <= g < sp_degree`` comes from the same
mesh with its ``sp`` dim unflattened into ``(sp / g, g)`` (``DeviceMesh._unflatten``): the inner
dim's groups are the aligned sub-groups, created on every rank in one order at build time.

What the mesh does not give is built here with ``new_group``, which is collective over the whole
world, so *every* rank creates *every* such group in the same fixed order: the gradient group of
each stage (its DP x SP ranks, for the once-per-step all-reduce of unsharded gradients), the
tied-embedding pairs (first and last stage of one replica, same SP rank) and one two-rank group
per direction of every pipeline link (SP rank i of stage s talks to SP rank i of stage s + 1),
so gloo matches posted-ahead receives of the two directions independently.  With the model's K/V heads
(``kv_heads``), the SP ranks that share a K/V head get a group of their own (``kv_group``), over
which they shard the carried K/V store (``kv_group.py``).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from infinipipe_hf.ir.model_spec import kv_head_sharers
from infinipipe_hf.layout import MESH_DIMS, ParallelDims


def set_group_timeout(group, timeout: timedelta) -> None:
    """Give ``group``'s collectives ``timeout`` (torch's ``_set_pg_timeout``; a warning where this
    torch lacks it, and the group keeps its own).  The default group is left alone: a mesh dim
    spanning the world may reuse it, and its timeout is the launcher's (the caller's) setting."""
    import torch.distributed.distributed_c10d as c10d

    if group is c10d._get_default_group():
        return
    setter = getattr(c10d, "_set_pg_timeout", None)
    if setter is None:
        warnings.warn("this torch has no distributed_c10d._set_pg_timeout: the DeviceMesh groups "
                      "(FSDP2's collectives) keep the default process group's timeout", stacklevel=2)
        return
    setter(timeout, group)


@dataclass
class ParallelLayout:
    """This rank's coordinates and process groups in the job's :class:`ParallelDims` (which it
    wraps: the degrees are read there, never redeclared).  ``groups_enabled=False`` skips every
    group (world of one, or pure coordinate arithmetic in unit tests)."""

    dims: ParallelDims
    """The job's layout (degrees, shard mode): built once, checked against the world already."""
    rank: int
    tied_embeddings: bool = False
    timeout_s: float | None = None
    timeout_setting: str = "InfiniPipeConfig.p2p_timeout_s"
    """The user-facing setting ``timeout_s`` comes from, named by every timeout message (the
    trainer passes ``ddp_timeout``)."""
    groups_enabled: bool = True
    device_type: str = "cpu"
    """Device type of the ``DeviceMesh`` (``"cuda"`` on GPUs)."""
    kv_heads: int | None = None
    """The model's K/V heads: when ``sp_degree`` is a larger multiple of them, the SP ranks sharing
    a K/V head get a process group (``kv_group``) to shard the carried K/V store over."""
    mesh: Any = field(default=None, init=False, repr=False)
    """``DeviceMesh`` with dims ``("dp", "pp", "sp")`` (``None`` without groups)."""
    dp_group: Any = field(default=None, init=False, repr=False)
    """Same stage and SP rank, every DP replica."""
    pp_group: Any = field(default=None, init=False, repr=False)
    """Same replica and SP rank, every stage."""
    sp_group: Any = field(default=None, init=False, repr=False)
    """This stage's SP ranks (same replica)."""
    grad_group: Any = field(default=None, init=False, repr=False)
    """This stage's ranks over every replica and SP rank: where unsharded gradients are summed."""
    tied_group: Any = field(default=None, init=False, repr=False)
    link_groups: dict[tuple[int, int], Any] = field(default_factory=dict, init=False, repr=False)
    """``(src, dst)`` global ranks -> the group carrying that direction of one pipeline link."""
    sub_group_pgs: dict[int, Any] = field(default_factory=dict, init=False, repr=False)
    """size ``g`` -> the process group of this rank's aligned SP sub-group of ``g`` ranks
    (``2 <= g < sp_degree``; the whole group is ``sp_group``)."""
    kv_group: Any = field(default=None, init=False, repr=False)
    """The SP ranks of this stage that share this rank's K/V head (``kv_group_size`` of them;
    ``None`` when the store is not sharded)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if self.groups_enabled and self.world_size > 1:
            self._build_groups()

    # --- degrees (the dims') ---------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def pp_degree(self) -> int:
        return self.dims.pp_degree

    @property
    def dp_degree(self) -> int:
        return self.dims.dp_degree

    @property
    def sp_degree(self) -> int:
        return self.dims.sp_degree

    # --- coordinates ---------------------------------------------------------------------
    @property
    def sp_rank(self) -> int:
        return self.dims.coords(self.rank)[2]

    @property
    def stage_index(self) -> int:
        return self.dims.coords(self.rank)[1]

    @property
    def dp_rank(self) -> int:
        return self.dims.coords(self.rank)[0]

    @property
    def is_first_stage(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_index == self.pp_degree - 1

    def global_rank(self, dp_rank: int, stage_index: int, sp_rank: int | None = None) -> int:
        """Rank of ``(dp_rank, stage_index, sp_rank)``; ``sp_rank`` defaults to this rank's."""
        sp = self.sp_rank if sp_rank is None else sp_rank
        return self.dims.rank(dp_rank, stage_index, sp)

    @property
    def prev_rank(self) -> int | None:
        """The previous stage's rank with this SP rank in this replica (``None`` on the first stage)."""
        return None if self.is_first_stage else self.global_rank(self.dp_rank, self.stage_index - 1)

    @property
    def next_rank(self) -> int | None:
        return None if self.is_last_stage else self.global_rank(self.dp_rank, self.stage_index + 1)

    def dp_ranks_of_stage(self, stage_index: int) -> list[int]:
        """Ranks of ``stage_index`` with this rank's SP rank, one per replica."""
        return self.dims.dp_group(stage_index, self.sp_rank)

    def pp_ranks_of_replica(self, dp_rank: int) -> list[int]:
        """Ranks of every stage of replica ``dp_rank`` with this rank's SP rank."""
        return self.dims.pipeline_group(dp_rank, self.sp_rank)

    def sp_ranks_of_stage(self, dp_rank: int, stage_index: int) -> list[int]:
        return self.dims.sp_group(dp_rank, stage_index)

    def sub_group_of(self, offset: int, size: int) -> tuple[Any, list[int]]:
        """The process group (``None`` for one rank) and the global ranks of SP ranks
        ``offset .. offset + size - 1`` of this rank's stage; this rank must be one of them."""
        ranks = self.dims.sub_group(self.dp_rank, self.stage_index, offset, size)
        assert self.rank in ranks, (self.rank, offset, size)
        if size == 1:
            return None, ranks
        return (self.sp_group if size == self.sp_degree else self.sub_group_pgs[size]), ranks

    @property
    def kv_group_size(self) -> int | None:
        """SP ranks sharing one K/V head (``sp_degree // kv_heads`` when ``sp_degree`` is a larger
        multiple of ``kv_heads``), else ``None``."""
        r = kv_head_sharers(self.sp_degree, self.kv_heads) if self.kv_heads else 1
        return r if r > 1 else None

    def kv_group_ranks(self, sp_rank: int | None = None) -> list[int]:
        """Global ranks of the K/V group of ``sp_rank`` (default: this rank's) in this stage."""
        r = self.kv_group_size
        assert r is not None, (self.sp_degree, self.kv_heads)
        sp = self.sp_rank if sp_rank is None else sp_rank
        return self.dims.sub_group(self.dp_rank, self.stage_index, sp // r * r, r)

    def grad_ranks_of_stage(self, stage_index: int) -> list[int]:
        """Every rank holding ``stage_index``: all replicas, all SP ranks (ascending)."""
        return self.dims.stage_group(stage_index)

    def group_of(self, dim: str) -> tuple[Any, list[int]]:
        """This rank's process group along mesh dim ``"dp"`` or ``"sp"``, and its ranks."""
        if dim == "sp":
            return self.sp_group, self.sp_ranks_of_stage(self.dp_rank, self.stage_index)
        if dim == "dp":
            return self.dp_group, self.dp_ranks_of_stage(self.stage_index)
        raise ValueError(f"no group along mesh dim {dim!r}; use 'dp' or 'sp'")

    def degree(self, dim: str) -> int:
        """Ranks along mesh dim ``dim`` (``"dp"``, ``"pp"`` or ``"sp"``)."""
        return self.dims.degree(dim)

    @property
    def has_tied_pair(self) -> bool:
        """True when embeddings are tied across two different stages (they must be summed)."""
        return self.tied_embeddings and self.pp_degree > 1

    def describe(self, rank: int | None = None) -> str:
        r = self.rank if rank is None else rank
        dp, stage, sp_rank = self.dims.coords(r)
        sp = f", sp {sp_rank}" if self.sp_degree > 1 else ""
        return f"rank {r} (stage {stage}, dp {dp}{sp})"

    # --- groups --------------------------------------------------------------------------
    def link_group(self, src: int, dst: int):
        """Group for point-to-point traffic from ``src`` to ``dst`` (``None``: default group)."""
        return self.link_groups.get((src, dst))

    def _build_groups(self) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise ValueError(f"world size {self.world_size} > 1 needs torch.distributed initialised; "
                             f"call torch.distributed.init_process_group() first (e.g. under torchrun)")
        self.mesh = init_device_mesh(self.device_type, (self.dp_degree, self.pp_degree, self.sp_degree),
                                     mesh_dim_names=MESH_DIMS)
        self.dp_group = self.mesh.get_group("dp")
        self.pp_group = self.mesh.get_group("pp")
        self.sp_group = self.mesh.get_group("sp")
        kw = {} if self.timeout_s is None else {"timeout": timedelta(seconds=self.timeout_s)}
        if kw:
            # init_device_mesh gives its groups the default group's timeout (30 min unless the
            # launcher set one); FSDP2's gathers and reduce-scatters run on them, so a dead rank
            # would hang the others that long instead of ending them within the timeout.
            for name in MESH_DIMS:
                set_group_timeout(self.mesh.get_group(name), kw["timeout"])
        self._build_sub_groups(kw.get("timeout"))
        self._build_kv_groups(kw)
        # Same creation order on every rank: new_group is a collective over the world.
        for s in range(self.pp_degree):
            ranks = self.grad_ranks_of_stage(s)
            g = self.dp_group if self.sp_degree == 1 else (
                self.sp_group if self.dp_degree == 1 else dist.new_group(ranks, **kw))
            if s == self.stage_index:
                self.grad_group = g
        if self.has_tied_pair:
            for d in range(self.dp_degree):
                for r in range(self.sp_degree):
                    pair = [self.global_rank(d, 0, r), self.global_rank(d, self.pp_degree - 1, r)]
                    g = dist.new_group(pair, **kw)
                    if self.rank in pair:
                        self.tied_group = g
        for d in range(self.dp_degree):
            for r in range(self.sp_degree):
                for s in range(self.pp_degree - 1):
                    a, b = self.global_rank(d, s, r), self.global_rank(d, s + 1, r)
                    forward, backward = dist.new_group([a, b], **kw), dist.new_group([a, b], **kw)
                    if self.rank in (a, b):
                        self.link_groups[(a, b)] = forward
                        self.link_groups[(b, a)] = backward

    def _build_kv_groups(self, kw: dict) -> None:
        """``kv_group``: one group per K/V group of every stage and replica, created on every
        rank in one order (``new_group`` is collective over the world); the whole SP group when
        all its ranks share one K/V head."""
        import torch.distributed as dist

        r = self.kv_group_size
        if r is None:
            return
        if r == self.sp_degree:
            self.kv_group = self.sp_group
            return
        for ranks in self.dims.sub_groups(r):
            g = dist.new_group(ranks, **kw)
            if self.rank in ranks:
                self.kv_group = g

    def _build_sub_groups(self, timeout: timedelta | None, *, unflatten: bool = True) -> None:
        """``sub_group_pgs``: for each size ``g`` of ``layout.sub_group_sizes``, the mesh with its
        ``sp`` dim unflattened into ``(sp / g, g)``; its inner dim's group is this rank's aligned
        sub-group.  Where this torch's ``DeviceMesh`` has no ``_unflatten`` (or ``unflatten=False``),
        a ``DeviceMesh`` over the same ranks with that 4-D shape gives the same groups."""
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        for g in self.dims.sub_group_sizes:
            names = (f"sp_over{g}", f"sp{g}")
            if unflatten and hasattr(self.mesh, "_unflatten"):
                sub = self.mesh._unflatten("sp", (self.sp_degree // g, g), names)
            else:
                shape = (self.dp_degree, self.pp_degree, self.sp_degree // g, g)
                sub = DeviceMesh(self.device_type, torch.arange(self.world_size).view(shape),
                                 mesh_dim_names=("dp", "pp") + names)
            group = sub.get_group(names[1])
            if timeout is not None:
                set_group_timeout(group, timeout)
            self.sub_group_pgs[g] = group
