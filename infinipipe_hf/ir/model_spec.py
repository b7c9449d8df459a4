"""The shape of a decoder-only model, read from an HF ``config.json`` without importing torch.

The planner only needs sizes (layers, hidden, heads, vocabulary...).  Reading them from the plain
JSON keeps planning torch-free and lets the CLI plan for models that are not on disk.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

# Decoder layers that follow the Llama forward contract (pre-norm, q/k/v/o projections with RoPE,
# gated MLP) and that the runtime's stage builder and attention function support.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModelError(ValueError):
    pass


def kv_head_sharers(group_size: int, num_kv_heads: int) -> int:
    """Consecutive ranks of a Ulysses group of ``group_size`` that hold the same K/V head and share
    its store of earlier slices: ``group_size // num_kv_heads`` when that is a whole number above 1
    (every rank then holds one K/V head), else 1 (each rank's K/V heads are its own, or replicated
    unevenly).  The planner's memory model and the runtime's K/V groups both follow it."""
    if group_size > num_kv_heads and group_size % num_kv_heads == 0:
        return group_size // num_kv_heads
    return 1


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of a Llama-pattern causal LM."""

    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int = 0

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_hidden_layers must be >= 1, got {self.num_layers}")

    @staticmethod
    def from_config_dict(cfg: Mapping[str, Any]) -> "ModelSpec":
        model_type = str(cfg.get("model_type", "")).lower()
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type or '(missing)'!r} is not supported; infinipipe_hf supports "
                f"Llama-pattern decoders: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return ModelSpec(
            model_type=model_type,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 0),
        )

    @staticmethod
    def from_json_file(path: str | Path) -> "ModelSpec":
        with open(path) as f:
            return ModelSpec.from_config_dict(json.load(f))

    @staticmethod
    def from_hf_config(config: Any) -> "ModelSpec":
        """From a ``transformers.PretrainedConfig`` (duck-typed, no import)."""
        return ModelSpec.from_config_dict(config.to_dict())

    # --- derived sizes --------------------------------------------------------------------
    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        attn = self.hidden_size * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return attn + mlp + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def total_params(self) -> int:
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.embedding_params + head + self.num_layers * self.layer_params + self.hidden_size

    def layer_linear_flops_per_token(self) -> float:
        """Forward matmul FLOPs per token of one decoder layer (2 * params of its projections)."""
        return 2.0 * (self.layer_params - 2 * self.hidden_size)

    def attention_flops_per_pair(self) -> float:
        """Forward FLOPs per (query, key) pair of one layer: QK^T and PV over all heads."""
        return 4.0 * self.q_dim
