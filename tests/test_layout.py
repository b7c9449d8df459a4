"""The parallel layout (infinipipe_hf/layout): the shard-mode table, and groups that agree with the runtime's
rank layout."""
import pytest

from infinipipe_hf.layout import SHARD_MODES, SHARD_TABLE, ParallelDims
from infinipipe_hf.layout.shard_modes import shard_mode
from infinipipe_hf.runtime.parallel.mesh import ParallelLayout


def test_shard_mode_table():
    assert SHARD_MODES == ("none", "sp", "dp", "sp+dp", "hybrid") == tuple(SHARD_TABLE)
    rows = {m.name: (m.sharded, m.per_step_gather, m.fsdp_dims, m.extra_dims) for m in SHARD_TABLE.values()}
    assert rows == {"none": (False, False, (), ()),
                    "sp": (True, False, ("sp",), ("dp",)),
                    "dp": (True, True, ("dp",), ("sp",)),
                    "sp+dp": (True, True, ("dp", "sp"), ()),
                    "hybrid": (True, False, ("dp", "sp"), ())}


@pytest.mark.parametrize("dp, pp, sp", [(1, 4, 8), (2, 2, 4), (3, 2, 1), (2, 1, 3)])
def test_groups_agree_with_the_runtime_layout(dp, pp, sp):
    spec = ParallelDims(pp, sp, dp)
    world = dp * pp * sp
    sp_groups = {tuple(g) for g in spec.sp_groups()}
    dp_groups = {tuple(g) for g in spec.dp_groups()}
    for rank in range(world):
        rt = ParallelLayout(spec, rank, groups_enabled=False)
        assert spec.rank(rt.dp_rank, rt.stage_index, rt.sp_rank) == rank
        assert tuple(rt.sp_ranks_of_stage(rt.dp_rank, rt.stage_index)) in sp_groups
        assert tuple(rt.dp_ranks_of_stage(rt.stage_index)) in dp_groups
        if rt.next_rank is not None:
            assert rt.next_rank == spec.rank(rt.dp_rank, rt.stage_index + 1, rt.sp_rank)


def test_paper_layout_nodes():
    # 4 nodes x 8 GPUs, sp 8 inside a node, pp 4 across nodes.
    spec = ParallelDims(pp_degree=4, sp_degree=8, shard="sp")
    assert spec.world_size == 32 and spec.shard_degree == 8 and spec.replica_degree == 1
    assert not spec.sp_crosses_nodes and not spec.shard_crosses_nodes
    assert spec.stage_link_crosses_nodes
    # Four stages of 2 GPUs fit in one node: the links stay inside it.
    assert not ParallelDims(pp_degree=4, sp_degree=2).stage_link_crosses_nodes


def test_shard_groups_and_degrees():
    spec = ParallelDims(pp_degree=2, sp_degree=4, dp_degree=2, shard="dp")
    assert spec.shard_degree == 2 and spec.replica_degree == 4
    assert spec.shard_groups()[0] == [0, 8]  # stage 0, SP rank 0 of both replicas: nodes 0 and 1
    assert spec.shard_crosses_nodes and not spec.replica_crosses_nodes
    hybrid = ParallelDims(pp_degree=2, sp_degree=4, dp_degree=2, shard="hybrid")
    assert hybrid.shard_degree == 4 and hybrid.replica_degree == 2 and hybrid.replica_crosses_nodes
    both = ParallelDims(pp_degree=2, sp_degree=4, dp_degree=2, shard="sp+dp")
    assert both.shard_degree == 8 and both.replica_degree == 1
    assert ParallelDims(pp_degree=2, sp_degree=4, dp_degree=2).replica_degree == 8  # unsharded: all-reduce
    # A group of 3 ranks on 8-GPU nodes straddles a node boundary (ranks 6, 7, 8).
    odd = ParallelDims(pp_degree=4, sp_degree=3)
    assert odd.sp_crosses_nodes and odd.ranks_per_node(odd.sp_groups()) == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(shard="dp"), "shards over the stage's DP replicas, which has one rank here"),
    (dict(shard="sp", dp_degree=2), "use shard in \\('dp', 'sp\\+dp'\\)"),
    (dict(shard="hybrid"), "raise sp_degree or dp_degree"),
    (dict(shard="sp+dp"), "one rank"),
    (dict(shard="zero3"), "shard='zero3' is not known"),
    (dict(sp_degree=0), "sp_degree must be a positive integer"),
    (dict(gpus_per_node=0), "gpus_per_node must be a positive integer"),
])
def test_bad_layouts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims(**kwargs)


def test_for_world_takes_a_shard_mode_row_and_says_so_for_a_name():
    row = ParallelDims.for_world(4, sp_degree=2, shard=shard_mode("sp"))
    assert row.dp_degree == 2 and row.shard.name == "sp"
    with pytest.raises(ValueError, match="shard='sp\\+dp' shards over SP x DP.*use shard='sp' or 'none'"):
        ParallelDims.for_world(2, sp_degree=2, shard=shard_mode("sp+dp"))
    with pytest.raises(ValueError, match="takes a shard mode's row, got 'sp'; pass InfiniPipeConfig"):
        ParallelDims.for_world(4, sp_degree=2, shard="sp")
