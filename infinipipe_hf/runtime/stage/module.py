"""A pipeline stage cut out of a Hugging Face causal LM, keeping the original parameter names.

Design: the stage *is* the original HF model object, pruned in place: ``model.model.layers``
becomes an ``nn.ModuleDict`` keyed by the original layer indices (key ``"7"`` yields the same
parameter names as ``ModuleList`` index 7), and embeddings / final norm / LM head are dropped
where the stage does not own them.  Names therefore map 1:1 to the unsplit model, so state dicts,
PEFT adapters and checkpoints need no renaming.  The trade-off: the pruned HF model can no longer
run its own ``forward``; the stage drives the decoder layers itself (``embed`` ->
``run_layers`` -> ``final_hidden``), which is also what lets the runtime pass the unit's segment
table to the attention function and checkpoint layers per unit.

Tied embeddings: the first stage keeps ``embed_tokens``, the last keeps ``lm_head`` with its own
``Parameter`` (untied when they are different stages) so the engine can sum the two gradients;
with a single stage both stay one tensor.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from infinipipe_hf.ir.model_spec import SUPPORTED_MODEL_TYPES
from infinipipe_hf.runtime.attention.hf import EPP_ATTENTION, register_epp_attention
from infinipipe_hf.runtime.recompute.layers import run_decoder_layers
from infinipipe_hf.runtime.recompute.mlp_levels import install_mlp_levels

_REQUIRED = ("model.layers", "model.embed_tokens", "model.norm", "lm_head", "model.rotary_emb")


def _unsupported(model: nn.Module, why: str) -> ValueError:
    cfg = getattr(model, "config", None)
    mt = getattr(cfg, "model_type", None)
    return ValueError(
        f"{type(model).__name__} (model_type={mt!r}) is not supported: {why}. infinipipe_hf supports "
        f"AutoModelForCausalLM models of the Llama pattern with model_type in "
        f"{', '.join(SUPPORTED_MODEL_TYPES)} (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
        f"Qwen3ForCausalLM)")


def _check_supported(model: nn.Module) -> None:
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        raise _unsupported(model, "its model_type is not in the supported list")
    for path in _REQUIRED:
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                raise _unsupported(model, f"it has no `{path}`")
    if not isinstance(model.model.layers, nn.ModuleList):
        raise _unsupported(model, "`model.layers` is not an nn.ModuleList (was it already split into a stage?)")


class StageModule(nn.Module):
    """One pipeline stage: a pruned HF causal LM plus the stage's place in the pipeline."""

    def __init__(self, hf_model: nn.Module, stage_index: int, layer_indices: tuple[int, ...],
                 is_first: bool, is_last: bool, tied: bool):
        super().__init__()
        self.hf_model = hf_model
        self.stage_index = stage_index
        self.layer_indices = layer_indices
        self.is_first = is_first
        self.is_last = is_last
        self.tie_word_embeddings = tied

    # --- names: delegate so parameters keep their HF names (no "hf_model." prefix) ---------------
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.hf_model.named_parameters(prefix=prefix, recurse=recurse,
                                              remove_duplicate=remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.hf_model.named_buffers(prefix=prefix, recurse=recurse,
                                           remove_duplicate=remove_duplicate)

    def state_dict(self, *args, **kwargs):
        return self.hf_model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.hf_model.load_state_dict(state_dict, strict=strict, assign=assign)

    @property
    def config(self):
        return self.hf_model.config

    @property
    def tied_parameter_names(self) -> list[str]:
        """Tied weights held here whose gradient the engine sums with the other end's copy.

        Empty when this stage is both first and last: the tied weight is then one tensor and its
        gradient is already complete.
        """
        if not self.tie_word_embeddings or (self.is_first and self.is_last):
            return []
        names = []
        if self.is_first:
            names.append("model.embed_tokens.weight")
        if self.is_last:
            names.append("lm_head.weight")
        return names

    @property
    def device(self) -> torch.device:
        # Set when the parameters live in host memory between uses (state_offload='states').
        return getattr(self, "compute_device", None) or next(self.hf_model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf_model.parameters()).dtype

    @property
    def hidden_size(self) -> int:
        return int(self.hf_model.config.hidden_size)

    def decoder_layers(self) -> list[tuple[int, nn.Module]]:
        return [(i, self.hf_model.model.layers[str(i)]) for i in self.layer_indices]

    # --- compute ---------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.is_first, "only the first stage holds the embeddings"
        return self.hf_model.model.embed_tokens(input_ids)

    def run_layers(self, hidden: torch.Tensor, position_ids: torch.Tensor, unit_ctx,
                   num_checkpointed: int = 0, finer_levels: dict[str, int] | None = None,
                   mlp_tile_tokens: int | None = None, attention_tile_tokens: int | None = None) -> torch.Tensor:
        cos_sin = self.hf_model.model.rotary_emb(hidden, position_ids=position_ids)
        return run_decoder_layers(self.decoder_layers(), hidden, num_checkpointed=num_checkpointed,
                                  position_ids=position_ids, position_embeddings=cos_sin,
                                  unit_ctx=unit_ctx, finer_levels=finer_levels, mlp_tile_tokens=mlp_tile_tokens,
                                  attention_tile_tokens=attention_tile_tokens)

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.is_last, "only the last stage holds the final norm"
        return self.hf_model.model.norm(hidden)

    @property
    def lm_head(self) -> nn.Module:
        assert self.is_last, "only the last stage holds the LM head"
        return self.hf_model.lm_head

    def forward(self, *args, **kwargs):
        raise TypeError("StageModule is driven by StageRunner (embed / run_layers / loss), not called")


def build_stage(model: nn.Module, stage_index: int, layer_range: range) -> StageModule:
    """Prune ``model`` (in place, on its current device) to the stage owning ``layer_range``.

    Pass a copy when building several stages from one model in one process.  A PEFT model is
    unwrapped: the stage holds its base model, with the adapters, under base-model names.
    """
    if hasattr(model, "get_base_model") and model.get_base_model() is not model:
        # PEFT wrapper: prune the HF model inside it (LoRA layers live in its decoder layers), so
        # names are the base model's (``model.layers.0.self_attn.q_proj.lora_A.default.weight``).
        model = model.get_base_model()
    _check_supported(model)
    num_layers = len(model.model.layers)
    if not isinstance(layer_range, range) or layer_range.step != 1 or len(layer_range) < 1 \
            or layer_range.start < 0 or layer_range.stop > num_layers:
        raise ValueError(f"layer_range={layer_range!r} must be a non-empty contiguous range within the "
                         f"model's {num_layers} decoder layers, e.g. one from partition_layers()")
    if stage_index < 0:
        raise ValueError(f"stage_index must be >= 0, got {stage_index}")
    is_first = layer_range.start == 0
    is_last = layer_range.stop == num_layers
    if is_first != (stage_index == 0):
        raise ValueError(f"stage_index={stage_index} with layer_range={layer_range}: the first stage "
                         f"(index 0) must start at layer 0 and only it may")
    # The config decides (not tensor identity), so every rank of an engine agrees on it without
    # looking at weights; a config-tied model whose tensors were untied by hand is not supported.
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if tied and model.lm_head.weight is not model.model.embed_tokens.weight:
        warnings.warn("config.tie_word_embeddings is True but lm_head.weight and embed_tokens.weight "
                      "are different tensors; infinipipe_hf treats them as tied (their gradients are "
                      "summed across the first and last stage)", stacklevel=2)

    if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        warnings.warn("HF gradient_checkpointing is on; disabling it on the stage: infinipipe_hf "
                      "checkpoints decoder layers per (stage, unit) from the plan instead", stacklevel=2)
        for m in model.modules():
            if getattr(m, "gradient_checkpointing", False) is True:
                m.gradient_checkpointing = False
    inner = model.model
    layers = inner.layers
    kept = nn.ModuleDict({str(i): layers[i] for i in layer_range})
    for _, layer in kept.items():
        layer.gradient_checkpointing = False
        install_mlp_levels(layer)  # checkpoint levels inside the layer (recompute/mlp_levels.py)
    inner.layers = kept
    del layers

    if is_last and tied and not is_first:
        # Own Parameter so dropping embed_tokens below does not drop the head's weight.
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone(),
                                            requires_grad=model.lm_head.weight.requires_grad)
    if not is_first:
        inner.embed_tokens = None
    if not is_last:
        inner.norm = None
        model.lm_head = None
    register_epp_attention()
    model.config._attn_implementation = EPP_ATTENTION
    return StageModule(model, stage_index, tuple(layer_range), is_first, is_last, tied)
