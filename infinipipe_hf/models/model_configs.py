"""Real published HF ``config.json`` files shipped with the package, for planning and benchmarks.

Design: the planner only needs a model's shape, so benchmarks plan for Llama-2-7B/13B,
Llama-3-8B, Llama-3.1-8B, Llama-3.2-1B, Qwen2.5-7B and SmolLM2-135M from their published
``config.json`` (copied verbatim, under ``infinipipe_hf/models/configs/``) without weights or
network.  Llama-3-8B has 8K positions; Llama-3.1-8B (``llama3.1-8b``) is the same shape with its
real 128K positions and ``llama3`` RoPE scaling: plan long sequences with it (the planner CLI warns
on sequences over a config's ``max_position_embeddings``).
LLaMA-30B (``llama-30b``, the InfiniPipe paper's largest model; 52 heads, so Ulysses SP 8 splits
heads unevenly) and Llama-2-70B (``llama2-70b``, 8 K/V heads) are written from their published
hub configs' fields; ``llama-30b`` states ``num_key_value_heads: 52`` explicitly, which LLaMA-1
configs leave implicit (equal to the head count).  Trade-off:
the files are snapshots; a model whose hub config later changes keeps the values it was
published with, which is what reproducible benchmarks want.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def available_configs() -> list[str]:
    """Names accepted by ``config_path`` (file stems), sorted."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def config_path(name: str) -> Path:
    """Path of the shipped ``config.json`` for ``name`` (e.g. ``"llama3-8b"``)."""
    path = CONFIG_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"no shipped model config named {name!r}; available: "
                         f"{', '.join(available_configs())} (or pass a path to your own config.json)")
    return path


def load_config_dict(name: str) -> dict[str, Any]:
    """The shipped ``config.json`` of ``name`` as a plain dict."""
    with open(config_path(name)) as f:
        return json.load(f)
