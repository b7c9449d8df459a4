"""Hugging Face ``Trainer`` integration: ``EPPTrainer``, ``EPPTrainingArguments``, the data path,
and TRL-style SFT (``EPPSFTTrainer``, ``EPPSFTConfig``; needs the optional ``trl``).

Import the classes from here or from the package root (``from infinipipe_hf import EPPTrainer``).
"""
from __future__ import annotations

_LAZY = {
    "EPPTrainer": ("infinipipe_hf.trainer.trainer", "EPPTrainer"),
    "EPPTrainingArguments": ("infinipipe_hf.trainer.arguments", "EPPTrainingArguments"),
    # TRL-style SFT (needs the optional `trl`: pip install 'infinipipe_hf[sft]')
    "EPPSFTTrainer": ("infinipipe_hf.trainer.sft.trainer", "EPPSFTTrainer"),
    "EPPSFTConfig": ("infinipipe_hf.trainer.sft.config", "EPPSFTConfig"),
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'infinipipe_hf.trainer' has no attribute {name!r}")
