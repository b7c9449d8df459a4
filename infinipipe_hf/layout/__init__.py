"""The parallel layout of a job: :class:`ParallelDims` (degrees, shard mode, state offload, rank
groups, checks), the shard-mode and state-offload tables.  Built once (``InfiniPipeConfig.layout(world)``)
and passed."""
from infinipipe_hf.layout.checks import divisors
from infinipipe_hf.layout.dims import MESH_DIMS, ParallelDims
from infinipipe_hf.layout.shard_modes import NO_SHARDING, SHARD_MODES, SHARD_TABLE, ShardMode, shard_mode, sharding_over
from infinipipe_hf.layout.state_offload import NO_OFFLOAD, OFFLOAD_TABLE, STATE_OFFLOADS, StateOffload, state_offload

__all__ = ["MESH_DIMS", "NO_OFFLOAD", "NO_SHARDING", "OFFLOAD_TABLE", "SHARD_MODES", "SHARD_TABLE", "STATE_OFFLOADS",
           "ParallelDims", "ShardMode", "StateOffload", "divisors", "shard_mode", "sharding_over", "state_offload"]
