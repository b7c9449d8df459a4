"""Saving and loading a pipelined model as ordinary Hugging Face checkpoints.

Design: a checkpoint written by N stages is the same thing ``save_pretrained`` writes for the
unsplit model, so ``AutoModelForCausalLM.from_pretrained(dir)`` (or ``PeftModel.from_pretrained``
for adapters) loads it in one process.
- Full models: every stage (dp rank 0 of it) writes one safetensors shard under the original
  parameter names; rank 0 then writes ``model.safetensors.index.json`` and ``config.json``.  One
  stage writes a single ``model.safetensors``.  A tied LM head is not written (HF re-ties it).
- PEFT models: each stage writes its adapter tensors (PEFT's names) to a temporary file; rank 0
  merges them into one ``adapter_model.safetensors`` plus ``adapter_config.json``.
- Optimizer state is saved per *stage* (``optimizer.stage{s}.pt`` from dp rank 0): DP replicas
  hold identical states, so a resume may even change ``dp_degree``; ``epp_layout.json`` records
  ``pp_degree`` and the layer split and a resume with another split is an error.
- Sharded stages (FSDP2, ``engine.sharding``): weights are gathered tensor by tensor
  (``full_tensor``, collective over the shard group, so every rank of the stage takes part) and
  written by one rank per stage; loading copies each rank's rows of the full tensor into its
  shard.  Optimizer state stays sharded: every rank writes its own local shards
  (``optimizer.stage{s}.dp{d}.sp{r}.pt``) and reads them back on resume, so ``epp_layout.json``
  also records ``shard``, ``dp_degree`` and ``sp_degree``, and a resume with other values is an
  error (the shards would not line up).
Trade-off: all ranks must see one shared filesystem (rank 0 reads the other stages' files).
"""
from __future__ import annotations

import json
import os
from typing import Iterable

import torch

from infinipipe_hf.runtime.parallel.fsdp import copy_full_, full_tensor, is_dtensor

LAYOUT_NAME = "epp_layout.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_INDEX_NAME = "model.safetensors.index.json"
ADAPTER_NAME = "adapter_model.safetensors"
TIED_HEAD = "lm_head.weight"
TIED_EMBED = "model.embed_tokens.weight"


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _tied(engine) -> bool:
    return bool(getattr(engine.stage, "tie_word_embeddings", False))


def _sharded(engine) -> bool:
    return getattr(engine, "sharding", None) is not None


def _is_writer(engine) -> bool:
    """One rank per stage writes its files (the others hold the same tensors or shards of them)."""
    return engine.layout.dp_rank == 0 and engine.layout.sp_rank == 0


def _gathered(items, keep: bool) -> dict[str, torch.Tensor]:
    """Whole tensors on CPU, gathered one at a time (collective when sharded: every rank of the
    stage iterates the same names in the same order); ``keep=False`` drops each after gathering."""
    out = {}
    for name, t in items:
        full = full_tensor(t.detach())
        if keep:
            out[name] = full.to("cpu").contiguous()
    return out


def stage_state_dict(engine, keep: bool = True) -> dict[str, torch.Tensor]:
    """This stage's persistent tensors under their HF names, on CPU; the tied head left out.

    Collective over the shard group when the stage is sharded."""
    return _gathered(((n, t) for n, t in engine.stage.state_dict().items()
                      if not (_tied(engine) and n == TIED_HEAD)), keep)


def shard_name(stage: int, pp: int) -> str:
    return SAFE_WEIGHTS_NAME if pp == 1 else f"model-{stage + 1:05d}-of-{pp:05d}.safetensors"


def save_full_model(engine, output_dir: str, hf_config, generation_config=None) -> None:
    """Collective: every rank calls it.  Writes an HF checkpoint loadable by ``from_pretrained``."""
    from safetensors.torch import save_file

    lay = engine.layout
    os.makedirs(output_dir, exist_ok=True)
    name = shard_name(lay.stage_index, lay.pp_degree)
    if _is_writer(engine):
        save_file(stage_state_dict(engine), os.path.join(output_dir, name), metadata={"format": "pt"})
    elif _sharded(engine):
        stage_state_dict(engine, keep=False)  # take part in the writer's gathers
    _barrier()
    if lay.rank == 0:
        if lay.pp_degree > 1:
            _write_index(output_dir, [shard_name(s, lay.pp_degree) for s in range(lay.pp_degree)])
        hf_config.save_pretrained(output_dir)
        if generation_config is not None:
            generation_config.save_pretrained(output_dir)
        write_layout(engine, output_dir)
    _barrier()


def _write_index(output_dir: str, shards: Iterable[str]) -> None:
    from safetensors import safe_open

    weight_map, total = {}, 0
    for shard in shards:
        with safe_open(os.path.join(output_dir, shard), framework="pt") as f:
            for key in f.keys():
                if key in weight_map:
                    raise ValueError(f"{key} is in both {weight_map[key]} and {shard}; stages overlap")
                weight_map[key] = shard
                sl = f.get_slice(key)
                numel = 1
                for d in sl.get_shape():
                    numel *= d
                total += numel * _dtype_bytes(sl.get_dtype())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(output_dir, SAFE_INDEX_NAME), "w") as fh:
        json.dump(index, fh, indent=2)


def _dtype_bytes(dtype: str) -> int:
    return {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
            "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}.get(dtype, 4)


def _shard_mode(engine) -> str:
    return engine.sharding.shard if _sharded(engine) else "none"


def write_layout(engine, output_dir: str) -> None:
    layout = {"pp_degree": engine.layout.pp_degree, "dp_degree": engine.layout.dp_degree,
              "sp_degree": engine.layout.sp_degree, "shard": _shard_mode(engine),
              "layers_per_stage": list(engine.layers_per_stage)}
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
    lay = engine.layout
    saved_shard = saved.get("shard", "none")  # written before sharding existed: unsharded
    was = (saved_shard, saved.get("dp_degree", lay.dp_degree), saved.get("sp_degree", 1))
    if saved_shard != _shard_mode(engine) or (saved_shard != "none" and was[1:] != (lay.dp_degree,
                                                                                   lay.sp_degree)):
        raise ValueError(f"checkpoint {checkpoint_dir} holds optimizer state saved with shard={was[0]!r}, "
                         f"dp_degree={was[1]}, sp_degree={was[2]}, but this run has "
                         f"shard={_shard_mode(engine)!r}, dp_degree={lay.dp_degree}, sp_degree="
                         f"{lay.sp_degree}; resume with the same shard mode and degrees (its weights "
                         f"alone load into any layout with from_pretrained)")


def _checkpoint_files(checkpoint_dir: str) -> dict[str, str]:
    """Tensor name -> file for a single-file or sharded safetensors checkpoint."""
    index = os.path.join(checkpoint_dir, SAFE_INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as fh:
            return {k: os.path.join(checkpoint_dir, v) for k, v in json.load(fh)["weight_map"].items()}
    single = os.path.join(checkpoint_dir, SAFE_WEIGHTS_NAME)
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return {k: single for k in f.keys()}
    raise ValueError(f"no {SAFE_WEIGHTS_NAME} or {SAFE_INDEX_NAME} in {checkpoint_dir}; pass a "
                     f"directory written by EPPTrainer.save_model or save_pretrained")


@torch.no_grad()
def load_stage_weights(engine, checkpoint_dir: str) -> None:
    """Copy this stage's tensors from an HF checkpoint (reads only the tensors it needs)."""
    from safetensors import safe_open

    files = _checkpoint_files(checkpoint_dir)
    targets = dict(engine.stage.state_dict(keep_vars=True))
    missing = []
    by_file: dict[str, list[tuple[str, str]]] = {}
    for name in targets:
        src = name
        if src not in files and _tied(engine) and name == TIED_HEAD:
            src = TIED_EMBED  # tied head: HF checkpoints store the embedding only
        if src not in files:
            missing.append(name)
            continue
        by_file.setdefault(files[src], []).append((name, src))
    if missing:
        raise ValueError(f"checkpoint {checkpoint_dir} lacks {len(missing)} tensors of stage "
                         f"{engine.layout.stage_index}, e.g. {missing[:3]}; it is for another model")
    for path, pairs in by_file.items():
        with safe_open(path, framework="pt") as f:
            for name, src in pairs:
                value = f.get_tensor(src)
                dst = targets[name]
                if tuple(value.shape) != tuple(dst.shape):
                    raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model shape "
                                     f"{tuple(dst.shape)}")
                copy_full_(dst, value.to(dst.dtype))  # a sharded parameter takes its own rows


def save_adapter(engine, peft_model, output_dir: str) -> None:
    """Collective: merge every stage's adapter tensors into one ``adapter_model.safetensors``."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file, save_file

    lay = engine.layout
    os.makedirs(output_dir, exist_ok=True)
    part = os.path.join(output_dir, f"adapter_model.stage{lay.stage_index}.tmp.safetensors")
    if _is_writer(engine) or _sharded(engine):
        state = _gathered(get_peft_model_state_dict(peft_model).items(), keep=_is_writer(engine))
        if _is_writer(engine):
            save_file(state, part, metadata={"format": "pt"})
    _barrier()
    if lay.rank == 0:
        merged = {}
        for s in range(lay.pp_degree):
            path = os.path.join(output_dir, f"adapter_model.stage{s}.tmp.safetensors")
            for k, v in load_file(path).items():
                merged.setdefault(k, v)  # a tensor on two stages (tied) is written once
            os.remove(path)
        save_file(merged, os.path.join(output_dir, ADAPTER_NAME), metadata={"format": "pt"})
        adapter = peft_model.active_adapter
        cfg = peft_model.peft_config[adapter]
        inference_mode = cfg.inference_mode
        cfg.inference_mode = True  # what PeftModel.save_pretrained writes
        try:
            cfg.save_pretrained(output_dir)
        finally:
            cfg.inference_mode = inference_mode
        write_layout(engine, output_dir)
    _barrier()


@torch.no_grad()
def load_adapter_weights(engine, peft_model, checkpoint_dir: str) -> None:
    """Load this stage's adapter tensors from a merged ``adapter_model.safetensors``."""
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    path = os.path.join(checkpoint_dir, ADAPTER_NAME)
    if not os.path.isfile(path):
        raise ValueError(f"no {ADAPTER_NAME} in {checkpoint_dir}; resume a PEFT run from a checkpoint "
                         f"written by EPPTrainer with the same PEFT model")
    saved = load_file(path)
    views = get_peft_model_state_dict(peft_model)
    mine = set(views)
    absent = sorted(mine - set(saved))
    if absent:
        raise ValueError(f"{path} lacks adapter tensors of this stage, e.g. {absent[:3]}")
    if not _sharded(engine):
        set_peft_model_state_dict(peft_model, {k: v for k, v in saved.items() if k in mine})
        return
    # Sharded: the state dict's values are views of the parameters; each takes its own rows.
    for k in sorted(mine):
        copy_full_(views[k], saved[k].to(views[k].dtype))


def optimizer_file(stage: int, engine=None) -> str:
    """Per stage; per rank (its coordinates) when the stage is sharded."""
    if engine is not None and _sharded(engine):
        lay = engine.layout
        return f"optimizer.stage{stage}.dp{lay.dp_rank}.sp{lay.sp_rank}.pt"
    return f"optimizer.stage{stage}.pt"


def save_optimizer_state(engine, optimizer, scheduler, output_dir: str) -> None:
    """Collective: optimizer state (one rank per stage, or every rank's shards) and the scheduler."""
    lay = engine.layout
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, optimizer_file(lay.stage_index, engine))
    if _sharded(engine):
        torch.save(_local_optimizer_state(optimizer.state_dict()), path)
    elif _is_writer(engine):
        torch.save(optimizer.state_dict(), path)
    if lay.rank == 0 and scheduler is not None:
        torch.save(scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))
    _barrier()


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
    saved = torch.load(path, map_location=device, weights_only=True)
    if _sharded(engine):
        saved = _sharded_optimizer_state(saved, optimizer, path)
    optimizer.load_state_dict(saved)
    sched = os.path.join(checkpoint_dir, "scheduler.pt")
    if scheduler is not None and os.path.isfile(sched):
        scheduler.load_state_dict(torch.load(sched, map_location="cpu", weights_only=True))
