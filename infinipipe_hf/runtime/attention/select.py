"""The attention backends by name, and the choice of one for a device.

The table is explicit: ``sdpa`` always, the CUDA ``varlen`` and ``flash`` backends gated by
whether they can run on the device.  ``register_backend`` adds another; nothing registers itself
on import.
"""
from __future__ import annotations

from typing import Callable

import torch

from infinipipe_hf.runtime.attention.sdpa import sdpa_backend
from infinipipe_hf.runtime.attention.types import AttentionBackend
from infinipipe_hf.runtime.attention.varlen import flash_available, flash_backend, varlen_available, varlen_backend

_BACKENDS: dict[str, tuple[AttentionBackend, Callable[[torch.device], bool]]] = {
    "sdpa": (sdpa_backend, lambda device: True),
    "varlen": (varlen_backend, varlen_available),
    "flash": (flash_backend, flash_available),
}
_AUTO_ORDER_CUDA = ("flash", "varlen", "sdpa")


def register_backend(name: str, fn: AttentionBackend, is_available: Callable[[torch.device], bool]) -> None:
    """Add a backend; ``is_available(device)`` gates its use."""
    _BACKENDS[name] = (fn, is_available)


def select_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """The backend ``name`` for ``device``; ``"auto"``: flash, then varlen on CUDA, else sdpa."""
    device = torch.device(device)
    if name == "auto":
        order = _AUTO_ORDER_CUDA if device.type == "cuda" else ("sdpa",)
        for cand in order:
            if cand in _BACKENDS and _BACKENDS[cand][1](device):
                return _BACKENDS[cand][0]
        raise AssertionError("sdpa is always available")
    if name not in _BACKENDS:
        known = sorted(set(_BACKENDS) | {"varlen", "flash"})
        raise ValueError(f"attention_backend={name!r} is not available in this installation "
                         f"(registered: {', '.join(sorted(_BACKENDS))}; known: {', '.join(known)}); "
                         f"use 'auto' or 'sdpa'")
    fn, ok = _BACKENDS[name]
    if not ok(device):
        raise ValueError(f"attention_backend={name!r} cannot run on device {device}; use 'auto' or 'sdpa'")
    return fn
