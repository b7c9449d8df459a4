"""The parallel layout of a job: :class:`ParallelDims` (degrees, shard mode, rank groups, checks)
and the shard-mode table.  Built once (``InfiniPipeConfig.layout(world)``) and passed."""
from infinipipe_hf.layout.checks import divisors, sub_group_sizes
from infinipipe_hf.layout.dims import MESH_DIMS, ParallelDims
from infinipipe_hf.layout.shard_modes import NO_SHARDING, SHARD_MODES, SHARD_TABLE, ShardMode, shard_mode, sharding_over

__all__ = ["MESH_DIMS", "NO_SHARDING", "SHARD_MODES", "SHARD_TABLE", "ParallelDims", "ShardMode", "divisors",
           "shard_mode", "sharding_over", "sub_group_sizes"]
