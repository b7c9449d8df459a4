"""Timing and memory probes shared by the profiler: CUDA events on GPU, ``perf_counter`` on CPU.

Design: one ``time_fn(fn, device)`` that runs warm-up calls, then times each repetition and
returns the median in milliseconds.  On CUDA the repetitions are bracketed by CUDA events and the
host synchronises once at the end, so the launch queue stays full the way it does in training
(timing with host clocks around every call would add a sync per call and measure launch latency).
On CPU a synchronous wall clock is the only clock there is.  The median (not the mean) keeps one
slow repetition (allocator growth, a clock change) from moving a cost coefficient.

Memory: ``saved_bytes`` counts the distinct storages autograd keeps for backward through
``torch.autograd.graph.saved_tensors_hooks`` (parameters excluded: they are model states, not
activations); ``forward_peak_bytes`` is the CUDA allocator's peak above the pre-forward level.
The allocator peak is a CUDA-only fact, so on CPU it is reported as ``None`` rather than guessed.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Iterable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, *, warmup: int = 2, repeat: int = 5) -> float:
    """Median milliseconds of ``fn()`` over ``repeat`` runs after ``warmup`` runs."""
    if repeat < 1 or warmup < 0:
        raise ValueError(f"repeat must be >= 1 and warmup >= 0, got repeat={repeat}, warmup={warmup}")
    for _ in range(warmup):
        fn()
    synchronize(device)
    if device.type == "cuda":
        pairs = []
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in pairs]
    else:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    # Views of one storage (e.g. the q/k/v split of a fused projection) must count once.
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def saved_bytes(fn: Callable[[], object], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of distinct storages autograd saves while ``fn()`` runs, excluding ``exclude``."""
    skip = {_storage_key(t) for t in exclude}
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            key = _storage_key(t)
            if key not in skip:
                seen[key] = key[1]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return int(sum(seen.values()))


def forward_peak_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """Allocator peak above the starting level while ``fn()`` runs (result kept alive); CUDA only."""
    if device.type != "cuda":
        return None
    synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del out
    return int(peak)
