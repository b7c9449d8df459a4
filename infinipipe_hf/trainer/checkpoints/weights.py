"""Full model weights as an ordinary HF safetensors checkpoint, written and read stage by stage.

Every stage (one writer rank) writes one shard under the original parameter names; rank 0 then
writes ``model.safetensors.index.json`` and ``config.json``.  One stage writes a single
``model.safetensors``.  A tied LM head is not written (HF re-ties it).  A sharded stage gathers
each tensor (collective over the shard group) and, on load, copies its own rows of each.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Iterable

import torch

from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.runtime.parallel.fsdp_api import copy_full_
from infinipipe_hf.trainer.checkpoints.common import (
    SAFE_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    TIED_EMBED,
    TIED_HEAD,
    barrier,
    gathered,
    is_sharded,
    is_tied,
    is_writer,
)
from infinipipe_hf.trainer.checkpoints.layout_file import write_layout


def stage_state_dict(engine, keep: bool = True) -> dict[str, torch.Tensor]:
    """This stage's persistent tensors under their HF names, on CPU; the tied head left out.

    Collective over the shard group when the stage is sharded."""
    return gathered(((n, t) for n, t in engine.stage.state_dict().items()
                     if not (is_tied(engine) and n == TIED_HEAD)), keep)


def shard_name(stage: int, dims: ParallelDims) -> str:
    """The safetensors file of ``stage``'s weights (HF's sharded-checkpoint names; one file at pp 1)."""
    pp = dims.pp_degree
    return SAFE_WEIGHTS_NAME if pp == 1 else f"model-{stage + 1:05d}-of-{pp:05d}.safetensors"


def save_full_model(engine, output_dir: str, hf_config, generation_config=None) -> None:
    """Collective: every rank calls it.  Writes an HF checkpoint loadable by ``from_pretrained``."""
    from safetensors.torch import save_file

    lay = engine.layout
    os.makedirs(output_dir, exist_ok=True)
    name = shard_name(lay.stage_index, lay.dims)
    if is_writer(engine):
        save_file(stage_state_dict(engine), os.path.join(output_dir, name), metadata={"format": "pt"})
    elif is_sharded(engine):
        stage_state_dict(engine, keep=False)  # take part in the writer's gathers
    barrier()
    if lay.rank == 0:
        if lay.pp_degree > 1:
            _write_index(output_dir, [shard_name(s, lay.dims) for s in range(lay.pp_degree)])
        hf_config.save_pretrained(output_dir)
        if generation_config is not None:
            generation_config.save_pretrained(output_dir)
        write_layout(engine, output_dir)
    barrier()


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


def _checkpoint_files(checkpoint_dir: str) -> dict[str, str]:
    """Tensor name -> file for a single-file or sharded safetensors checkpoint."""
    index = os.path.join(checkpoint_dir, SAFE_INDEX_NAME)
    if os.path.isfile(index):
        try:
            with open(index) as fh:
                return {k: os.path.join(checkpoint_dir, v) for k, v in json.load(fh)["weight_map"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index} is not a readable safetensors index ({type(exc).__name__}: "
                             f"{exc}); the checkpoint is damaged") from exc
    single = os.path.join(checkpoint_dir, SAFE_WEIGHTS_NAME)
    if os.path.isfile(single):
        with _reading(single) as f:
            return {k: single for k in f.keys()}
    raise ValueError(f"no {SAFE_WEIGHTS_NAME} or {SAFE_INDEX_NAME} in {checkpoint_dir}; pass a "
                     f"directory written by EPPTrainer.save_model or save_pretrained")


@contextlib.contextmanager
def _reading(path: str):
    """``safe_open(path)``; a missing, truncated or corrupt file is a ValueError naming it."""
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing; the checkpoint is incomplete")
    try:
        handle = safe_open(path, framework="pt")
    except Exception as exc:  # safetensors' own error does not name the file
        raise ValueError(f"{path} ({os.path.getsize(path)} bytes) is not a readable safetensors file "
                         f"({type(exc).__name__}: {exc}); the checkpoint is truncated or damaged") from exc
    with handle as f:
        yield f


def _tensor(f, name: str, path: str) -> torch.Tensor:
    try:
        return f.get_tensor(name)
    except Exception as exc:
        raise ValueError(f"{path}: tensor {name} cannot be read ({type(exc).__name__}: {exc}); the "
                         f"checkpoint is truncated or damaged") from exc


@torch.no_grad()
def load_stage_weights(engine, checkpoint_dir: str) -> None:
    """Copy this stage's tensors from an HF checkpoint (reads only the tensors it needs)."""
    files = _checkpoint_files(checkpoint_dir)
    targets = dict(engine.stage.state_dict(keep_vars=True))
    missing = []
    by_file: dict[str, list[tuple[str, str]]] = {}
    for name in targets:
        src = name
        if src not in files and is_tied(engine) and name == TIED_HEAD:
            src = TIED_EMBED  # tied head: HF checkpoints store the embedding only
        if src not in files:
            missing.append(name)
            continue
        by_file.setdefault(files[src], []).append((name, src))
    if missing:
        raise ValueError(f"checkpoint {checkpoint_dir} lacks {len(missing)} tensors of stage "
                         f"{engine.layout.stage_index}, e.g. {missing[:3]}; it is for another model")
    for path, pairs in by_file.items():
        with _reading(path) as f:
            for name, src in pairs:
                value = _tensor(f, src, path)
                dst = targets[name]
                if tuple(value.shape) != tuple(dst.shape):
                    raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model shape "
                                     f"{tuple(dst.shape)}")
                copy_full_(dst, value.to(dst.dtype))  # a sharded parameter takes its own rows
