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
"""
from __future__ import annotations

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


def offload_saved(tier: HostTier, tag: object) -> torch.autograd.graph.saved_tensors_hooks:
    """A ``saved_tensors_hooks`` context that keeps the tensors autograd saves in ``tier``."""

    def pack(t: torch.Tensor):
        if isinstance(t, nn.Parameter) or t.numel() == 0:
            return t
        return _Offloaded(tier, tier.put(t, tag))

    def unpack(packed):
        return packed.unpack() if isinstance(packed, _Offloaded) else packed

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)
