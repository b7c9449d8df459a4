"""``epp_layout.json``: the pipeline layout a checkpoint was saved with, checked on resume.

Optimizer state is per stage (per rank when sharded), so a resume needs the same ``pp_degree`` and
layer split, and with sharding the same shard mode, ``dp_degree`` and ``sp_degree``.
"""
from __future__ import annotations

import json
import os

from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.trainer.checkpoints.common import LAYOUT_NAME


def write_layout(engine, output_dir: str) -> None:
    layout = {**engine.layout.dims.degrees(), "layers_per_stage": list(engine.layers_per_stage)}
    with open(os.path.join(output_dir, LAYOUT_NAME), "w") as fh:
        json.dump(layout, fh, indent=2)


def check_layout(engine, checkpoint_dir: str) -> None:
    """Optimizer files are per stage (per rank when sharded): resuming needs the same pp_degree
    and layer split, and with sharding the same shard mode, dp_degree and sp_degree."""
    path = os.path.join(checkpoint_dir, LAYOUT_NAME)
    if not os.path.isfile(path):
        raise ValueError(f"{checkpoint_dir} has no {LAYOUT_NAME}: it was not written by EPPTrainer; "
                         f"load its weights with from_pretrained and start a new run instead of resuming")
    with open(path) as fh:
        saved = json.load(fh)
    now = [engine.layout.pp_degree, list(engine.layers_per_stage)]
    if [saved["pp_degree"], saved["layers_per_stage"]] != now:
        raise ValueError(f"checkpoint {checkpoint_dir} was saved with pp_degree={saved['pp_degree']}, "
                         f"layers per stage {saved['layers_per_stage']}, but this run has "
                         f"pp_degree={now[0]}, layers per stage {now[1]}; resume with the same pp_degree "
                         f"and layer_split={saved['layers_per_stage']}")
    dims = engine.layout.dims
    # The saved layout, read back as one (a file without "shard" or the degrees: unsharded, this run's DP).
    was = ParallelDims(saved["pp_degree"], saved.get("sp_degree", 1), saved.get("dp_degree", dims.dp_degree),
                       saved.get("shard", "none"))
    same_groups = (was.dp_degree, was.sp_degree) == (dims.dp_degree, dims.sp_degree)
    if was.shard != dims.shard or (was.shard.sharded and not same_groups):
        raise ValueError(f"checkpoint {checkpoint_dir} holds optimizer state saved with shard={was.shard.name!r}, "
                         f"dp_degree={was.dp_degree}, sp_degree={was.sp_degree}, but this run has "
                         f"shard={dims.shard.name!r}, dp_degree={dims.dp_degree}, sp_degree="
                         f"{dims.sp_degree}; resume with the same shard mode and degrees (its weights "
                         f"alone load into any layout with from_pretrained)")
