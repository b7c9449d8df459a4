"""Hugging Face ``Trainer`` integration: ``EPPTrainer``, ``EPPTrainingArguments`` and the data path.

Import the classes from here or from the package root (``from infinipipe_hf import EPPTrainer``).
"""
from __future__ import annotations

_LAZY = {
    "EPPTrainer": ("infinipipe_hf.trainer.trainer", "EPPTrainer"),
    "EPPTrainingArguments": ("infinipipe_hf.trainer.arguments", "EPPTrainingArguments"),
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'infinipipe_hf.trainer' has no attribute {name!r}")
