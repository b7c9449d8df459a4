"""A decoder layer's token-wise attention side over token tiles, chosen per unit by the plan
(``attention_tile_tokens``).

Every op of a Llama-pattern layer but the attention core works per token, so the layer runs as:
per tile, under a non-reentrant ``torch.utils.checkpoint``, ``input_layernorm`` -> q/k/v
projections (and ``q_norm``/``k_norm`` where the model has them) -> the model's own rotary; the
attention over the whole unit (the stage's backend, unchanged) on the concatenated q, k, v; then
per tile, again under a checkpoint, ``o_proj`` -> residual add -> ``post_attention_layernorm`` ->
MLP -> residual add.  Between the forward and the backward a layer then keeps, across the whole
unit, only what the attention kernel saves (q, k, v, its output) and the tiles' inputs (views of
the layer input and of the attention output); the norms' float32 copies, the projections' inputs,
the rotary products, the MLP's intermediates and all their gradients exist one tile at a time.
Exact by construction.

Design, as :mod:`.tiled_mlp`: :func:`attention_tiles` gives the layer an instance ``forward`` for
the block and restores what was there; a checkpointed layer's replay runs outside the caller's
``with``, so layers are called through :func:`tiled_layer_call`, which enters the block on every
call.  The MLP runs inside the post-attention tiles with its class forward (a tile already bounds
its intermediates), or, when the unit's MLP tile is smaller than the attention tile, through the
tiled MLP.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from types import MethodType
from typing import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from infinipipe_hf.runtime.recompute.tiled_mlp import TILE_ATTR as MLP_TILE_ATTR
from infinipipe_hf.runtime.recompute.tiled_mlp import check_tile_tokens, instance_attributes, mlp_tiles

_TILE_ATTR = "_epp_attention_tile_tokens"
_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
_ATTN_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")


def unsupported_reason(layer: nn.Module) -> str | None:
    """Why ``layer`` cannot run its attention side in tiles, or ``None`` when it can: it needs the
    Llama pattern's modules and its attention module's ``apply_rotary_pos_emb``."""
    missing = [n for n in _LAYER_PARTS if getattr(layer, n, None) is None]
    attn = getattr(layer, "self_attn", None)
    if attn is not None:
        missing += [f"self_attn.{n}" for n in _ATTN_PARTS if getattr(attn, n, None) is None]
        if _rotary(attn) is None:
            missing.append(f"apply_rotary_pos_emb in {type(attn).__module__}")
        if (getattr(attn, "q_norm", None) is None) != (getattr(attn, "k_norm", None) is None):
            missing.append("both q_norm and k_norm (it has one)")
    return f"{type(layer).__name__} lacks {', '.join(missing)}" if missing else None


@contextmanager
def attention_tiles(layer: nn.Module, tile_tokens: int | None) -> Iterator[None]:
    """Run ``layer``'s token-wise parts over tiles of ``tile_tokens`` tokens inside the block
    (``None``: as is)."""
    if tile_tokens is None:
        yield
        return
    check_tile_tokens(tile_tokens, "attention_tile_tokens")
    why = unsupported_reason(layer)
    if why is not None:
        raise ValueError(f"the attention side cannot run in tiles: {why}; plan without "
                         f"attention_tile_tokens for this model")
    with instance_attributes(layer, forward=MethodType(_tiled_layer_forward, layer), **{_TILE_ATTR: tile_tokens}):
        yield


def tiled_layer_call(layer: nn.Module, mlp_tile_tokens: int | None,
                     attention_tile_tokens: int | None) -> Callable:
    """``layer`` itself (no tiles), or a callable running it with its tiles on every call (use it
    as the function a checkpoint replays)."""
    if mlp_tile_tokens is None and attention_tile_tokens is None:
        return layer
    if mlp_tile_tokens is not None:
        check_tile_tokens(mlp_tile_tokens)
    if attention_tile_tokens is not None:
        check_tile_tokens(attention_tile_tokens, "attention_tile_tokens")

    def run(*args, **kwargs):
        with mlp_tiles(layer, mlp_tile_tokens), attention_tiles(layer, attention_tile_tokens):
            return layer(*args, **kwargs)

    return run


def _rotary(attn: nn.Module) -> Callable | None:
    return getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)


def _project(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """One tile's rotated q, k and v, ``[batch, heads, tile, head_dim]`` as the model's attention."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    shape = (*x.shape[:-1], -1, attn.head_dim)
    q, k, v = (getattr(attn, p)(h).view(shape) for p in ("q_proj", "k_proj", "v_proj"))
    if getattr(attn, "q_norm", None) is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = _rotary(attn)(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k, v.transpose(1, 2)


def _post(layer: nn.Module, attn_out: torch.Tensor, residual: torch.Tensor, mlp_tile: int | None) -> torch.Tensor:
    """One tile of everything after the attention core: ``o_proj`` (on the tile of the kernel's
    ``[batch, tokens, heads, head_dim]`` output, flattened here so that no row-major copy of the
    whole output is kept beside the kernel's), the residuals, the MLP (in tiles of ``mlp_tile``
    tokens, else whole: an argument, so the tile's rerun in backward, outside any block, runs the
    MLP as its forward did)."""
    h = residual + layer.self_attn.o_proj(attn_out.reshape(*attn_out.shape[:-2], -1))
    mlp = layer.mlp
    with mlp_tiles(layer, mlp_tile):
        run_mlp = mlp if mlp_tile is not None else MethodType(type(mlp).forward, mlp)
        return h + run_mlp(layer.post_attention_layernorm(h))


def _attend(layer: nn.Module, q, k, v, attention_mask, kwargs) -> torch.Tensor:
    """The model's attention function over the whole unit, called as its attention module does."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attn = layer.self_attn
    eager = getattr(sys.modules.get(type(attn).__module__), "eager_attention_forward", None)
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager)
    window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(attn.config, "sliding_window", None)
    out, _ = fn(attn, q, k, v, attention_mask, dropout=0.0 if not attn.training else attn.attention_dropout,
                scaling=attn.scaling, sliding_window=window, **kwargs)
    return out


def _tiled_layer_forward(self: nn.Module, hidden_states: torch.Tensor, attention_mask=None, position_ids=None,
                         past_key_values=None, use_cache=False, position_embeddings=None, **kwargs) -> torch.Tensor:
    if past_key_values is not None or position_embeddings is None:
        raise ValueError("a layer with its attention side in tiles trains without a KV cache and needs the "
                         f"rotary position_embeddings; got past_key_values={type(past_key_values).__name__}, "
                         f"position_embeddings={type(position_embeddings).__name__}")
    tile, n = getattr(self, _TILE_ATTR), hidden_states.shape[-2]
    spans = [(s, min(s + tile, n)) for s in range(0, n, tile)]
    grad = torch.is_grad_enabled()

    def run(fn, *args):
        return checkpoint(fn, self, *args, use_reentrant=False) if grad else fn(self, *args)

    cos, sin = position_embeddings
    parts = [run(_project, hidden_states[..., a:b, :], cos[..., a:b, :], sin[..., a:b, :]) for a, b in spans]
    q, k, v = (torch.cat(p, dim=2) if len(p) > 1 else p[0] for p in zip(*parts))
    del parts
    out = _attend(self, q, k, v, attention_mask, dict(kwargs, position_ids=position_ids))
    del q, k, v
    inner = getattr(self.mlp, MLP_TILE_ATTR, None)  # smaller MLP tiles nest inside a tile
    outs = [run(_post, out[:, a:b], hidden_states[..., a:b, :], inner if inner and inner < b - a else None)
            for a, b in spans]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)
