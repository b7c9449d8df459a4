"""Build the pieces the profiler times from an HF ``config.json``: one decoder layer, the rotary
embedding, the final norm and the LM head, with random weights.

Design: the layer is *transformers' own* decoder layer class for the config (found through the
causal-LM class's ``_no_split_modules``, e.g. ``LlamaDecoderLayer``) rather than a re-implementation,
so the profile measures exactly the kernels training will run (projections, RoPE, the attention
implementation, the MLP).  Only the pieces are built, never the whole model: profiling an 8B
shape needs one layer's weights, not 16 GB.  Trade-off: the pieces must follow the Llama forward
contract (``layer(hidden, position_embeddings=(cos, sin), ...)``), which is the set of models the
runtime supports anyway (``ModelSpec.SUPPORTED_MODEL_TYPES``).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import nn

from infinipipe_hf.ir.model_spec import ModelSpec


@dataclass
class ProfiledModules:
    config: object
    spec: ModelSpec
    layer: nn.Module
    rotary: nn.Module
    norm: nn.Module
    lm_head: nn.Module


def hf_config(config_dict: dict, attn_implementation: str = "sdpa"):
    """A ``PretrainedConfig`` for ``config_dict`` (checked against the supported model types)."""
    import transformers

    spec = ModelSpec.from_config_dict(config_dict)  # ValueError naming the supported types
    d = dict(config_dict)
    d.pop("model_type", None)
    d.pop("architectures", None)
    cfg = transformers.AutoConfig.for_model(spec.model_type, **d)
    cfg._attn_implementation = attn_implementation
    return cfg


def _modeling_module(model_type: str):
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


def decoder_classes(model_type: str) -> tuple[type, type, type]:
    """(decoder layer, rotary embedding, RMSNorm) classes of ``model_type``'s HF implementation."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    mod = _modeling_module(model_type)
    lm_cls = getattr(mod, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    layer_name = list(getattr(lm_cls, "_no_split_modules", None) or [])
    layer_name = layer_name[0] if layer_name else None
    prefix = lm_cls.__name__[: -len("ForCausalLM")]
    layer_cls = getattr(mod, layer_name or f"{prefix}DecoderLayer")
    rotary_cls = getattr(mod, f"{prefix}RotaryEmbedding")
    norm_cls = getattr(mod, f"{prefix}RMSNorm")
    return layer_cls, rotary_cls, norm_cls


def build_modules(config_dict: dict, device: torch.device, dtype: torch.dtype, *,
                  attn_implementation: str = "sdpa", seed: int = 0) -> ProfiledModules:
    cfg = hf_config(config_dict, attn_implementation)
    spec = ModelSpec.from_hf_config(cfg)
    layer_cls, rotary_cls, norm_cls = decoder_classes(spec.model_type)
    torch.manual_seed(seed)
    with torch.device(device):
        layer = layer_cls(cfg, layer_idx=0)
        rotary = rotary_cls(config=cfg)
        norm = norm_cls(cfg.hidden_size, eps=getattr(cfg, "rms_norm_eps", 1e-6))
        lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    std = float(getattr(cfg, "initializer_range", 0.02))
    for m in (layer, lm_head):
        for name, p in m.named_parameters():
            if p.dim() >= 2:  # HF's init: normal(0, initializer_range) weights, unit norms
                nn.init.normal_(p, std=std)
    layer.to(dtype=dtype).train()
    norm.to(dtype=dtype)
    lm_head.to(dtype=dtype)
    # The rotary module keeps float32 inv_freq, as in the model; its outputs follow the input dtype.
    return ProfiledModules(cfg, spec, layer, rotary, norm, lm_head)


def reference_shape(spec: ModelSpec) -> dict[str, int | str]:
    """The ``reference`` block of a profile: the layer shape the rows were measured on."""
    return {
        "model_type": spec.model_type, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads, "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
    }
