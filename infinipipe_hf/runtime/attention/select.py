"""The attention backends by name, and the choice of one for a device and, measured, per unit kind.

The table is explicit: ``sdpa`` always, the CUDA ``varlen`` and ``flash`` backends and ``flex``
(FlexAttention) gated by whether they can run on the device.  ``register_backend`` adds another;
nothing registers itself on import.

``"auto"`` without a measured table keeps a fixed order (flash, then varlen on CUDA, else sdpa).
With the profile's measured table (``HardwareProfile.attention_backends``, written by
``python -m infinipipe_hf.profile``: :mod:`infinipipe_hf.profiling.attention_backends`) it routes
each unit kind (:data:`~.types.UNIT_KINDS`) to the fastest backend the table ranks that can train
on this device.  A backend counts as able to train only where its backward runs: FlexAttention on
CPU runs forward only, so it is never chosen there, and asking for it by name is an error.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from infinipipe_hf.runtime.attention.flex import backward_runs, flex_available, flex_backend
from infinipipe_hf.runtime.attention.sdpa import sdpa_backend
from infinipipe_hf.runtime.attention.types import UNIT_KINDS, AttentionBackend, AttentionSegments, unit_kind
from infinipipe_hf.runtime.attention.varlen import flash_available, flash_backend, varlen_available, varlen_backend

_BACKENDS: dict[str, tuple[AttentionBackend, Callable[[torch.device], bool]]] = {
    "sdpa": (sdpa_backend, lambda device: True),
    "varlen": (varlen_backend, varlen_available),
    "flash": (flash_backend, flash_available),
    "flex": (flex_backend, flex_available),
}
_FORWARD_ONLY: dict[str, Callable[[torch.device], bool]] = {"flex": lambda device: not backward_runs(device)}
_AUTO_ORDER_CUDA = ("flash", "varlen", "sdpa")


def register_backend(name: str, fn: AttentionBackend, is_available: Callable[[torch.device], bool]) -> None:
    """Add a backend; ``is_available(device)`` gates its use."""
    _BACKENDS[name] = (fn, is_available)


def backend_named(name: str) -> AttentionBackend:
    """The registered backend ``name`` whatever the device (the profiler times each one)."""
    if name not in _BACKENDS:
        raise ValueError(f"no attention backend {name!r} is registered ({', '.join(sorted(_BACKENDS))})")
    return _BACKENDS[name][0]


def can_train(name: str, device: torch.device | str) -> bool:
    """Whether backend ``name`` is registered and runs forward and backward on ``device``."""
    device = torch.device(device)
    if name not in _BACKENDS or not _BACKENDS[name][1](device):
        return False
    forward_only = _FORWARD_ONLY.get(name)
    return not (forward_only is not None and forward_only(device))


def available_backends(device: torch.device | str) -> dict[str, bool]:
    """The backends that run on ``device``, each with whether its backward runs there too."""
    device = torch.device(device)
    return {name: can_train(name, device) for name, (_, ok) in _BACKENDS.items() if ok(device)}


def _auto(device: torch.device) -> AttentionBackend:
    order = _AUTO_ORDER_CUDA if device.type == "cuda" else ("sdpa",)
    for cand in order:
        if can_train(cand, device):
            return _BACKENDS[cand][0]
    raise AssertionError("sdpa is always available")


def measured_routes(table: Mapping[str, Any], device: torch.device | str) -> dict[str, str]:
    """Per unit kind, the fastest backend of the measured ``table`` that trains on ``device``
    (its ``ranking``: backends fastest first; else its ``fastest``).  Kinds the table has no usable
    entry for are left out."""
    routes, ranking, fastest = {}, table.get("ranking") or {}, table.get("fastest") or {}
    for kind in UNIT_KINDS:
        for name in ranking.get(kind) or ([fastest[kind]] if kind in fastest else []):
            if can_train(name, device):
                routes[kind] = name
                break
    return routes


class RoutedBackend:
    """An ``AttentionBackend`` that sends each unit to the backend its unit kind is routed to."""

    def __init__(self, routes: Mapping[str, str], default: AttentionBackend):
        self.routes = dict(routes)
        """unit kind -> backend name, from the measured table"""
        self._fns = {kind: _BACKENDS[name][0] for kind, name in self.routes.items()}
        self._default = default
        self.__name__ = "routed(" + ", ".join(f"{k}={v}" for k, v in self.routes.items()) + ")"

    def __call__(self, a: AttentionSegments) -> torch.Tensor:
        return self.for_kind(unit_kind(a))(a)

    def for_kind(self, kind: str) -> AttentionBackend:
        return self._fns.get(kind, self._default)


def backend_for_kind(backend: AttentionBackend, kind: str) -> AttentionBackend:
    """The backend that runs units of ``kind`` under ``backend`` (itself unless it routes)."""
    return backend.for_kind(kind) if isinstance(backend, RoutedBackend) else backend


def masks_context(backend: AttentionBackend) -> bool:
    """Whether ``backend`` runs a slice with K/V context through an explicit mask, computing the
    masked blocks too (SDPA; flash, varlen and FlexAttention skip them)."""
    return backend is sdpa_backend


def context_pairs(device: torch.device | str, table: Mapping[str, Any] | None = None, backend: str = "auto") -> str:
    """How ``backend`` runs slices with K/V context on ``device`` counts their pairs
    (``HardwareProfile.context_pairs``): ``"rectangle"`` for SDPA's masked call, else ``"band"``.
    Read from the ``slice`` route; a measured table sending hybrids elsewhere is priced alike."""
    return "rectangle" if masks_context(backend_for_kind(select_backend(backend, device, table), "slice")) else "band"


def select_backend(name: str, device: torch.device | str,
                   table: Mapping[str, Any] | None = None) -> AttentionBackend:
    """The backend ``name`` for ``device``.  ``"auto"``: per unit kind from the measured ``table``
    when it has entries that train here, else flash, then varlen on CUDA, else sdpa."""
    device = torch.device(device)
    if name == "auto":
        default = _auto(device)
        routes = measured_routes(table or {}, device)
        fns = {_BACKENDS[n][0] for n in routes.values()}
        if not routes or fns == {default}:
            return default  # one backend for every kind: no routing
        return RoutedBackend(routes, default)
    if name not in _BACKENDS:
        known = sorted(set(_BACKENDS) | {"varlen", "flash", "flex"})
        raise ValueError(f"attention_backend={name!r} is not available in this installation "
                         f"(registered: {', '.join(sorted(_BACKENDS))}; known: {', '.join(known)}); "
                         f"use 'auto' or 'sdpa'")
    fn, ok = _BACKENDS[name]
    if not ok(device):
        raise ValueError(f"attention_backend={name!r} cannot run on device {device}; use 'auto' or 'sdpa'")
    if not can_train(name, device):
        raise ValueError(f"attention_backend={name!r} cannot train on {device.type}: its backward does not "
                         f"run there (torch {torch.__version__}); use 'auto' or 'sdpa'")
    return fn
