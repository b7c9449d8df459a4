"""What an ``offload`` layer saves for its backward goes to the host tier and comes back.

An ``offload`` layer runs under the same non-reentrant checkpoint as a ``full`` one; the
checkpoint saves the layer's input (its only saved tensor outside the checkpoint's own hook),
and :func:`offload_saved` routes that through ``torch.autograd.graph.saved_tensors_hooks``: the
pack hook copies it into the :class:`~.host_tier.HostTier` (tagged with the unit, so the executor
can prefetch the first one a backward reads, and each read the next) and the device copy is freed with the
last reference; the unpack hook brings it back when the recompute needs it.  Parameters are never
copied (they stay on the device anyway).
An ``offload_attn`` layer (``keep_attn`` in host memory) runs under the same hooks; what its
attention store keeps (output, log-sum-exp) is not autograd-saved, so the store puts it in the
same tier itself (``recompute/keep_attn.py``).
An ``offload_pair`` pair (``recompute/offload_pair.py``) runs its first layer under these hooks,
recording the packed input; its second layer's hooks (:func:`rebuild_saved`) pack that layer's
input as a :class:`_Rebuilt`, which puts nothing in the tier and rebuilds the input in backward
from the first layer's packed one (read with ``keep=True``: the first layer's own recompute reads
it again).
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import nn

from infinipipe_hf.runtime.offload.host_tier import HostTensor, HostTier


class _Offloaded:
    """A packed tensor: its host copy, and the device copy once brought back (unpacked once,
    read any number of times)."""

    __slots__ = ("tier", "handle", "back")

    def __init__(self, tier: HostTier, handle: HostTensor) -> None:
        self.tier, self.handle, self.back = tier, handle, None

    def unpack(self) -> torch.Tensor:
        if self.back is None:
            self.back = self.tier.get(self.handle)
            self.tier.prefetch_tag(self.handle.tag)  # the next input the backward reads
        return self.back

    def __del__(self) -> None:  # a graph freed without its backward (an aborted step)
        try:
            self.tier.release(self.handle)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def offload_saved(tier: HostTier, tag: object,
                  record: list[_Offloaded] | None = None) -> torch.autograd.graph.saved_tensors_hooks:
    """A ``saved_tensors_hooks`` context that keeps the tensors autograd saves in ``tier``; each
    packed one is appended to ``record`` when given (a pair's first layer: its input)."""
    return torch.autograd.graph.saved_tensors_hooks(_offloading_pack(tier, tag, record), _unpack)


def _offloading_pack(tier: HostTier, tag: object, record: list[_Offloaded] | None = None):
    """The pack hook that puts a saved tensor in ``tier`` (parameters and empty tensors stay)."""

    def pack(t: torch.Tensor):
        if isinstance(t, nn.Parameter) or t.numel() == 0:
            return t
        packed = _Offloaded(tier, tier.put(t, tag))
        if record is not None:
            record.append(packed)
        return packed

    return pack


def _unpack(packed):
    return packed.unpack() if isinstance(packed, (_Offloaded, _Rebuilt)) else packed


class _Rebuilt:
    """A pair's second layer's packed input: nothing held but how to rebuild it, ``replay`` of the
    first layer's forward from that layer's packed input ``source``; rebuilt once, read any number
    of times."""

    __slots__ = ("source", "replay", "back")

    def __init__(self, source: _Offloaded, replay: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.source, self.replay, self.back = source, replay, None

    def unpack(self) -> torch.Tensor:
        if self.back is None:
            src = self.source
            # keep=True: the first layer's recompute, next in the backward, reads its input again.
            x = src.back if src.back is not None else src.tier.get(src.handle, keep=True)
            self.back = self.replay(x)
            self.source = self.replay = None  # the first layer's input goes with its own recompute
            src.tier.prefetch_tag(src.handle.tag)  # the next thing the backward reads
        return self.back


def rebuild_saved(layer_input: torch.Tensor, source: _Offloaded, replay: Callable[[torch.Tensor], torch.Tensor],
                  tier: HostTier, tag: object) -> torch.autograd.graph.saved_tensors_hooks:
    """``saved_tensors_hooks`` for a pair's second layer: its checkpoint's saved ``layer_input``
    is packed as a :class:`_Rebuilt` (``replay(source's tensor)`` in backward), anything else
    goes to ``tier`` as :func:`offload_saved` sends it."""
    wanted = weakref.ref(layer_input)  # the hooks must not keep the input alive
    offload = _offloading_pack(tier, tag)

    def pack(t: torch.Tensor):
        return _Rebuilt(source, replay) if t is wanted() else offload(t)

    return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)
