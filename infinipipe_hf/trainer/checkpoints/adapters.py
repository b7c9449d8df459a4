"""PEFT adapters: every stage's adapter tensors merged into one ``adapter_model.safetensors``.

Each stage writes its tensors (PEFT's names) to a temporary file; rank 0 merges them and writes
``adapter_config.json``, so ``PeftModel.from_pretrained`` loads the result in one process.
"""
from __future__ import annotations

import os

import torch

from infinipipe_hf.runtime.parallel.fsdp_api import copy_full_
from infinipipe_hf.trainer.checkpoints.common import ADAPTER_NAME, barrier, gathered, is_sharded, is_writer
from infinipipe_hf.trainer.checkpoints.layout_file import write_layout


def save_adapter(engine, peft_model, output_dir: str) -> None:
    """Collective: merge every stage's adapter tensors into one ``adapter_model.safetensors``."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file, save_file

    lay = engine.layout
    os.makedirs(output_dir, exist_ok=True)
    part = os.path.join(output_dir, f"adapter_model.stage{lay.stage_index}.tmp.safetensors")
    if is_writer(engine) or is_sharded(engine):
        state = gathered(get_peft_model_state_dict(peft_model).items(), keep=is_writer(engine))
        if is_writer(engine):
            save_file(state, part, metadata={"format": "pt"})
    barrier()
    if lay.rank == 0:
        merged = {}
        for s in range(lay.pp_degree):
            path = os.path.join(output_dir, f"adapter_model.stage{s}.tmp.safetensors")
            for k, v in load_file(path).items():
                merged.setdefault(k, v)  # a tensor on two stages (tied) is written once
            os.remove(path)
        save_file(merged, os.path.join(output_dir, ADAPTER_NAME), metadata={"format": "pt"})
        _save_adapter_config(peft_model, output_dir)
        write_layout(engine, output_dir)
    barrier()


def _save_adapter_config(peft_model, output_dir: str) -> None:
    adapter = peft_model.active_adapter
    cfg = peft_model.peft_config[adapter]
    inference_mode = cfg.inference_mode
    cfg.inference_mode = True  # what PeftModel.save_pretrained writes
    try:
        cfg.save_pretrained(output_dir)
    finally:
        cfg.inference_mode = inference_mode


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
    if not is_sharded(engine):
        set_peft_model_state_dict(peft_model, {k: v for k, v in saved.items() if k in mine})
        return
    # Sharded: the state dict's values are views of the parameters; each takes its own rows.
    for k in sorted(mine):
        copy_full_(views[k], saved[k].to(views[k].dtype))
