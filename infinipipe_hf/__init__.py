"""infinipipe_hf: elastic pipeline parallelism for Hugging Face causal LMs.

Heavy imports (torch, transformers) happen lazily so the planner stays importable without them.
"""
from __future__ import annotations

from infinipipe_hf.config import InfiniPipeConfig

__version__ = "0.1.0"

_LAZY = {
    "PipelineEngine": ("infinipipe_hf.runtime.engine.engine", "PipelineEngine"),
    "EPPTrainer": ("infinipipe_hf.trainer.trainer", "EPPTrainer"),
    "EPPTrainingArguments": ("infinipipe_hf.trainer.arguments", "EPPTrainingArguments"),
    # TRL-style SFT (needs the optional `trl`: pip install 'infinipipe_hf[sft]')
    "EPPSFTTrainer": ("infinipipe_hf.trainer.sft.trainer", "EPPSFTTrainer"),
    "EPPSFTConfig": ("infinipipe_hf.trainer.sft.config", "EPPSFTConfig"),
}

__all__ = ["InfiniPipeConfig", "__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'infinipipe_hf' has no attribute {name!r}")
