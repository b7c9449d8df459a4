"""Optimizer and scheduler state, saved per stage (per rank when the stage is sharded).

DP replicas hold identical unsharded states, so ``optimizer.stage{s}.pt`` from one writer rank is
enough and a resume may change ``dp_degree``.  Sharded states stay sharded: every rank writes its
local shards (``optimizer.stage{s}.dp{d}.sp{r}.pt``) and reads them back on resume.
"""
from __future__ import annotations

import os

import torch

from infinipipe_hf.runtime.parallel.fsdp_api import is_dtensor
from infinipipe_hf.trainer.checkpoints.common import barrier, is_sharded, is_writer


def optimizer_file(stage: int, engine=None) -> str:
    """Per stage; per rank (its coordinates) when the stage is sharded."""
    if engine is not None and is_sharded(engine):
        lay = engine.layout
        return f"optimizer.stage{stage}.dp{lay.dp_rank}.sp{lay.sp_rank}.pt"
    return f"optimizer.stage{stage}.pt"


def save_optimizer_state(engine, optimizer, scheduler, output_dir: str) -> None:
    """Collective: optimizer state (one rank per stage, or every rank's shards) and the scheduler."""
    lay = engine.layout
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, optimizer_file(lay.stage_index, engine))
    if is_sharded(engine):
        torch.save(_local_optimizer_state(optimizer.state_dict()), path)
    elif is_writer(engine):
        torch.save(optimizer.state_dict(), path)
    if lay.rank == 0 and scheduler is not None:
        torch.save(scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))
    barrier()


def _local_optimizer_state(state_dict: dict) -> dict:
    """The optimizer state with every DTensor replaced by this rank's shard; ``dtensors`` lists
    which entries to turn back into DTensors on load."""
    state, dtensors = {}, []
    for idx, entry in state_dict["state"].items():
        state[idx] = {}
        for key, v in entry.items():
            if is_dtensor(v):
                v = v.to_local()
                dtensors.append([idx, key])
            state[idx][key] = v
    return {"state": state, "param_groups": state_dict["param_groups"], "dtensors": dtensors}


def _sharded_optimizer_state(saved: dict, optimizer, path: str) -> dict:
    """Inverse of ``_local_optimizer_state`` against the optimizer's current (DTensor) params."""
    from torch.distributed.tensor import DTensor

    by_index = {}
    for ids, group in zip((g["params"] for g in optimizer.state_dict()["param_groups"]),
                          optimizer.param_groups):
        by_index.update(zip(ids, group["params"]))
    state = saved["state"]
    for idx, key in saved["dtensors"]:
        p, local = by_index.get(idx), state[idx][key]
        if p is None or not is_dtensor(p) or tuple(local.shape) != tuple(p.to_local().shape):
            raise ValueError(f"{path}: optimizer state {key!r} of parameter {idx} has shard shape "
                             f"{tuple(local.shape)}, which does not fit this run's shards; resume with "
                             f"the shard layout the checkpoint was saved with")
        state[idx][key] = DTensor.from_local(local.to(p.device), p.device_mesh, p.placements,
                                             shape=p.shape, stride=p.stride(), run_check=False)
    return {"state": state, "param_groups": saved["param_groups"]}


def load_optimizer_state(engine, optimizer, scheduler, checkpoint_dir: str, device) -> None:
    path = os.path.join(checkpoint_dir, optimizer_file(engine.layout.stage_index, engine))
    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing; the checkpoint is incomplete or was written with another "
                         f"pp_degree or shard layout")
    saved = _load(path, device)
    if is_sharded(engine):
        saved = _sharded_optimizer_state(saved, optimizer, path)
    optimizer.load_state_dict(saved)
    sched = os.path.join(checkpoint_dir, "scheduler.pt")
    if scheduler is not None and os.path.isfile(sched):
        scheduler.load_state_dict(_load(sched, "cpu"))


def _load(path: str, device) -> dict:
    """``torch.load(weights_only=True)`` (tensors and plain containers only, no arbitrary pickle);
    a truncated, corrupt or unsafe file is a ValueError naming it."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:
        raise ValueError(f"{path} ({os.path.getsize(path)} bytes) cannot be loaded with weights_only=True "
                         f"({type(exc).__name__}: {' '.join(str(exc).split())[:300]}); the checkpoint is "
                         f"truncated or damaged") from exc
