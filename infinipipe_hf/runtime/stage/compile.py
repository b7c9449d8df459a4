"""Per-layer ``torch.compile`` of a stage's decoder layers (``compile_layers``).

What is compiled: each decoder layer's ``forward``, once, with every activation dimension dynamic
(``dynamic=True``), so units of every size reuse the same graphs; layers of one class share them
(parameters are graph inputs, not constants), as torchtitan's per-block compile does.  The
compiled callable is the layer's instance ``forward``: module hooks (FSDP2's all-gathers, PEFT's)
stay outside the graph and run eagerly, and parameter names do not change.

Where the graph breaks: the ``epp`` attention function reads the unit's segment table and the
Python KV store, which a graph cannot hold; the layer runs it through :data:`EPP_COMPILED`, the
same function behind ``torch.compiler.disable``, so each layer compiles as the part before the
attention core (norm, Q/K/V projections, rotary) and the part after it (output projection,
residuals, norm, MLP).  Sequence-parallel all-to-alls, the KV store, ``keep_attn`` and every
attention backend run eagerly inside that break.  Its output is returned contiguous (HF copies it
there anyway) so the graph after the break sees one memory layout for every unit kind.

Around a layer: checkpoints (whole layer, ``keep_attn``, ``offload``'s saved-tensor hooks) wrap
the compiled call and replay it; the MLP levels trace into the graph (one graph per level).  A
layer whose MLP runs in tiles (``mlp_tile_tokens``) runs eagerly: the tile loop's trip count is
the unit's token count, which a dynamic graph would specialise on.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from infinipipe_hf.runtime.attention.hf import EPP_ATTENTION
from infinipipe_hf.runtime.recompute.tiled_mlp import _TILE_ATTR  # set while a layer's MLP runs in tiles

EPP_COMPILED = "epp_compiled"
"""The attention implementation name compiled stages use (``epp`` behind a graph break)."""

_EAGER_ATTR = "_epp_eager_forward"


@dataclass(frozen=True)
class LayerCompile:
    """How a stage compiles its decoder layers."""

    backend: str = "inductor"
    """``torch.compile`` backend (HF's ``torch_compile_backend``)."""
    mode: str | None = None
    """``torch.compile`` mode, e.g. ``max-autotune-no-cudagraphs`` (HF's ``torch_compile_mode``);
    ``None``: the backend's default."""


@torch.compiler.disable
def epp_attention_eager(module, query, key, value, attention_mask, **kwargs):
    """The registered ``epp`` attention function, run eagerly from inside a compiled layer."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    out, weights = ALL_ATTENTION_FUNCTIONS[EPP_ATTENTION](module, query, key, value, attention_mask, **kwargs)
    out = out.contiguous()
    # A view (one segment's output often is) would make the graph after the break guard on its
    # base, and recompile for units whose output is not one.
    return (out.clone() if out._is_view() else out), weights


def register_compiled_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(EPP_COMPILED, epp_attention_eager)


def compile_stage_layers(stage, settings: LayerCompile = LayerCompile()) -> int:
    """Compile every decoder layer of ``stage`` (a ``StageModule``) in place; the number compiled.

    Call it after ``build_stage`` and before FSDP2 shards the stage (as torchtitan does); calling
    it twice is a no-op for layers already compiled.  Compilation itself happens at the first call
    of each graph (slow on CPU: tens of seconds for a tiny model)."""
    register_compiled_attention()
    stage.config._attn_implementation = EPP_COMPILED
    n = 0
    for _, layer in stage.decoder_layers():
        if _EAGER_ATTR not in vars(layer):
            compile_layer(layer, settings)
            n += 1
    return n


def compile_layer(layer: nn.Module, settings: LayerCompile) -> None:
    """Give ``layer`` a compiled instance ``forward`` (eager when its MLP runs in tiles)."""
    eager = layer.forward
    kw = {} if settings.mode is None else {"mode": settings.mode}
    compiled = torch.compile(eager, dynamic=True, backend=settings.backend, **kw)
    mlp = getattr(layer, "mlp", None)

    def forward(*args, **kwargs):
        if mlp is not None and getattr(mlp, _TILE_ATTR, None) is not None:
            return eager(*args, **kwargs)
        return compiled(*args, **kwargs)

    setattr(layer, _EAGER_ATTR, eager)
    layer.forward = forward


def is_compiled(layer: nn.Module) -> bool:
    return _EAGER_ATTR in vars(layer)


def layer_compile_settings(config) -> LayerCompile | None:
    """The ``LayerCompile`` an ``InfiniPipeConfig`` asks for, or ``None`` (compile off);
    ``ValueError`` for a backend this torch does not have."""
    if not getattr(config, "compile_layers", False):
        return None
    backends = torch._dynamo.list_backends(exclude_tags=())
    if config.compile_backend not in backends:
        raise ValueError(f"compile_backend={config.compile_backend!r} is not a torch.compile backend of "
                         f"this torch; use one of {', '.join(sorted(backends))}")
    if config.compile_mode in ("reduce-overhead", "max-autotune"):
        warnings.warn(f"compile_mode={config.compile_mode!r} records CUDA graphs, once per unit size "
                      f"(units change size every step) and around an eager attention; prefer "
                      f"'max-autotune-no-cudagraphs' or the default", stacklevel=2)
    return LayerCompile(backend=config.compile_backend, mode=config.compile_mode)


def compile_profiled_layer(layer: nn.Module, config, settings: LayerCompile = LayerCompile()) -> None:
    """Compile the profiler's lone decoder layer the way a stage compiles its layers: its attention
    implementation (``config._attn_implementation``, e.g. ``sdpa``) runs eagerly behind the same
    graph break, so the profile prices the compiled layer the runtime runs."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = config._attn_implementation
    if not name.endswith("_compiled"):
        AttentionInterface.register(f"{name}_compiled", torch.compiler.disable(ALL_ATTENTION_FUNCTIONS[name]))
        config._attn_implementation = f"{name}_compiled"
    compile_layer(layer, settings)
