"""``HostTier``: tensors of one stage held in host memory between their forward and backward.

Design: ``put`` copies a device tensor into host memory and returns a :class:`HostTensor` handle;
``get`` copies it back (and, unless ``keep``, frees the host copy).  On CUDA the host copy is a
pinned CPU tensor and both copies run ``non_blocking`` on a side stream ordered by events, so they
overlap the compute stream; ``prefetch`` starts the copy back ahead of use, one tensor ahead: the
executor prefetches a unit's last offloaded input when its backward starts, and reading one
prefetches the next (``prefetch_tag``), so at most two offloaded inputs of a unit are on the device.  On the CPU the "device" is the CPU too: the host copy is a
separate CPU storage and ``get`` returns a fresh tensor, so tests can see a tensor leave its
storage and come back, and every copy runs synchronously.

Accounting (bytes of the host copies): ``current_bytes``, ``peak_bytes``, ``bytes_out`` /
``bytes_in`` (copied out / back) and their counts; ``resident`` bytes (optimizer states held by
``HostOptimizer``) count in ``current_bytes`` and ``peak_bytes`` too.  Handles carry a tag (the unit
id) so a whole unit's tensors can be prefetched or dropped at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class HostTensor:
    """One tensor's host copy and how to bring it back."""

    host: torch.Tensor | None
    device: torch.device
    tag: object = None
    nbytes: int = 0
    out_event: object = None  # CUDA: copy to host finished
    back: torch.Tensor | None = None  # CUDA prefetch: the device copy on its way
    back_event: object = None

    @property
    def released(self) -> bool:
        return self.host is None


@dataclass
class TierStats:
    """What crossed between the tiers, in bytes and copies."""

    current_bytes: int = 0
    peak_bytes: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    copies_out: int = 0
    copies_in: int = 0
    resident: dict = field(default_factory=dict)
    """name -> bytes held outside put/get (optimizer states)."""


class HostTier:
    """Host memory of one stage (module docstring)."""

    def __init__(self) -> None:
        self.stats = TierStats()
        self._streams: dict[torch.device, object] = {}
        self._live: dict[int, HostTensor] = {}  # id(handle) -> handle, for leaks
        self._by_tag: dict[object, list[HostTensor]] = {}  # live handles of a tag, in put order

    # --- accounting ---------------------------------------------------------------------------
    @property
    def current_bytes(self) -> int:
        return self.stats.current_bytes

    @property
    def peak_bytes(self) -> int:
        return self.stats.peak_bytes

    def _add(self, n: int) -> None:
        s = self.stats
        s.current_bytes += n
        s.peak_bytes = max(s.peak_bytes, s.current_bytes)

    def set_resident(self, name: str, nbytes: int) -> None:
        """Count ``nbytes`` held under ``name`` (replacing its previous count)."""
        self._add(int(nbytes) - self.stats.resident.get(name, 0))
        self.stats.resident[name] = int(nbytes)

    def reset_peak(self) -> None:
        self.stats.peak_bytes = self.stats.current_bytes

    def reset_stats(self) -> None:
        """Zero the copy counters and the peak (``current_bytes`` stays: it is what is held)."""
        keep = self.stats
        self.stats = TierStats(current_bytes=keep.current_bytes, peak_bytes=keep.current_bytes,
                               resident=keep.resident)

    # --- copies -------------------------------------------------------------------------------
    def _stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def put(self, t: torch.Tensor, tag: object = None) -> HostTensor:
        """Copy ``t`` to host memory; the caller drops its own reference to free the device copy."""
        src = t.detach()
        nbytes = src.numel() * src.element_size()
        if src.device.type == "cuda":
            host = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=True)
            stream = self._stream(src.device)
            stream.wait_stream(torch.cuda.current_stream(src.device))
            with torch.cuda.stream(stream):
                host.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            src.record_stream(stream)  # the allocator keeps its memory until the copy is done
        else:
            host, event = torch.empty(src.shape, dtype=src.dtype, device="cpu"), None
            host.copy_(src)
        h = HostTensor(host, src.device, tag, nbytes, event)
        self._live[id(h)] = h
        self._by_tag.setdefault(tag, []).append(h)
        self._add(nbytes)
        self.stats.bytes_out += nbytes
        self.stats.copies_out += 1
        return h

    def prefetch(self, h: HostTensor) -> None:
        """Start copying ``h`` back to its device (CUDA; a no-op on the CPU or when under way)."""
        if h.released or h.back is not None or h.device.type != "cuda":
            return
        stream = self._stream(h.device)
        with torch.cuda.stream(stream):
            stream.wait_event(h.out_event)
            h.back = torch.empty(h.host.shape, dtype=h.host.dtype, device=h.device)
            h.back.copy_(h.host, non_blocking=True)
            h.back_event = torch.cuda.Event()
            h.back_event.record(stream)

    def prefetch_tag(self, tag: object, depth: int = 1) -> None:
        """Prefetch the ``depth`` most recently put live tensors of ``tag`` (the next the backward
        reads: it reads them in reverse order).  A bounded lookahead: bringing a whole unit back at
        once would hold every offloaded input on the device again."""
        for h in self._by_tag.get(tag, ())[::-1][:depth]:
            self.prefetch(h)

    def get(self, h: HostTensor, keep: bool = False) -> torch.Tensor:
        """``h`` back on its device (a new tensor); the host copy is freed unless ``keep``."""
        if h.released:
            raise RuntimeError("a host-tier tensor was read after it was released (read twice without keep=True?)")
        if h.device.type == "cuda":
            self.prefetch(h)
            current = torch.cuda.current_stream(h.device)
            current.wait_event(h.back_event)
            out = h.back
            out.record_stream(current)
            h.back = h.back_event = None
        else:
            out = h.host.clone()
        self.stats.bytes_in += h.nbytes
        self.stats.copies_in += 1
        if not keep:
            self.release(h)
        return out

    def release(self, h: HostTensor) -> None:
        """Free ``h``'s host copy (idempotent)."""
        if h.released:
            return
        if h.out_event is not None:
            h.out_event.synchronize()  # a pinned buffer must not be reused while a copy reads it
        h.host = h.back = None
        self._live.pop(id(h), None)
        same = self._by_tag.get(h.tag, [])
        for i in range(len(same) - 1, -1, -1):  # usually the last: backward reads in reverse
            if same[i] is h:
                del same[i]
                break
        if not same:
            self._by_tag.pop(h.tag, None)
        self._add(-h.nbytes)

    def release_tag(self, tag: object) -> None:
        for h in list(self._by_tag.get(tag, ())):
            self.release(h)

    def clear(self) -> None:
        """Free every host copy (end of a step)."""
        for h in list(self._live.values()):
            self.release(h)

    def live_tags(self) -> set:
        return set(self._by_tag)
