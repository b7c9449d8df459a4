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
Trade-off: all ranks must see one shared filesystem (rank 0 reads the other stages' files).
"""
from __future__ import annotations

import json
import os
from typing import Iterable

import torch

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


def stage_state_dict(engine) -> dict[str, torch.Tensor]:
    """This stage's persistent tensors under their HF names, on CPU; the tied head left out."""
    out = {}
    for name, t in engine.stage.state_dict().items():
        if _tied(engine) and name == TIED_HEAD:
            continue
        out[name] = t.detach().to("cpu").contiguous()
    return out


def shard_name(stage: int, pp: int) -> str:
    return SAFE_WEIGHTS_NAME if pp == 1 else f"model-{stage + 1:05d}-of-{pp:05d}.safetensors"


def save_full_model(engine, output_dir: str, hf_config, generation_config=None) -> None:
    """Collective: every rank calls it.  Writes an HF checkpoint loadable by ``from_pretrained``."""
    from safetensors.torch import save_file

    lay = engine.layout
    os.makedirs(output_dir, exist_ok=True)
    name = shard_name(lay.stage_index, lay.pp_degree)
    if lay.dp_rank == 0:
        save_file(stage_state_dict(engine), os.path.join(output_dir, name), metadata={"format": "pt"})
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


def write_layout(engine, output_dir: str) -> None:
    layout = {"pp_degree": engine.layout.pp_degree, "dp_degree": engine.layout.dp_degree,
              "layers_per_stage": list(engine.layers_per_stage)}
    with open(os.path.join(output_dir, LAYOUT_NAME), "w") as fh:
        json.dump(layout, fh, indent=2)


def check_layout(engine, checkpoint_dir: str) -> None:
    """Optimizer files are per stage: resuming needs the same pp_degree and layer split."""
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
                dst.copy_(value.to(dst.dtype))


def save_adapter(engine, peft_model, output_dir: str) -> None:
    """Collective: merge every stage's adapter tensors into one ``adapter_model.safetensors``."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file, save_file

    lay = engine.layout
    os.makedirs(output_dir, exist_ok=True)
    part = os.path.join(output_dir, f"adapter_model.stage{lay.stage_index}.tmp.safetensors")
    if lay.dp_rank == 0:
        state = {k: v.detach().to("cpu").contiguous()
                 for k, v in get_peft_model_state_dict(peft_model).items()}
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
    mine = set(get_peft_model_state_dict(peft_model))
    absent = sorted(mine - set(saved))
    if absent:
        raise ValueError(f"{path} lacks adapter tensors of this stage, e.g. {absent[:3]}")
    set_peft_model_state_dict(peft_model, {k: v for k, v in saved.items() if k in mine})


def optimizer_file(stage: int) -> str:
    return f"optimizer.stage{stage}.pt"


def save_optimizer_state(engine, optimizer, scheduler, output_dir: str) -> None:
    """Collective: per-stage optimizer state (dp rank 0) and the scheduler (rank 0)."""
    lay = engine.layout
    os.makedirs(output_dir, exist_ok=True)
    if lay.dp_rank == 0:
        torch.save(optimizer.state_dict(), os.path.join(output_dir, optimizer_file(lay.stage_index)))
    if lay.rank == 0 and scheduler is not None:
        torch.save(scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))
    _barrier()


def load_optimizer_state(engine, optimizer, scheduler, checkpoint_dir: str, device) -> None:
    path = os.path.join(checkpoint_dir, optimizer_file(engine.layout.stage_index))
    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing; the checkpoint is incomplete or was written with another "
                         f"pp_degree")
    optimizer.load_state_dict(torch.load(path, map_location=device, weights_only=True))
    sched = os.path.join(checkpoint_dir, "scheduler.pt")
    if scheduler is not None and os.path.isfile(sched):
        scheduler.load_state_dict(torch.load(sched, map_location="cpu", weights_only=True))
