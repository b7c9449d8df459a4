"""Peak memory of a block of CPU work, rebuilt from the allocator's events.

CUDA has ``max_memory_allocated``; the CPU allocator keeps no such counter.  Under
``torch.profiler.profile(profile_memory=True)`` every allocation and free of the CPU allocator is a
``[memory]`` event (time, signed bytes); replaying them in time order gives the bytes allocated
since the block started, whose maximum is the block's peak *above* what was alive at its start.
That includes everything a step allocates (receive buffers, the KV store, gradients, each op's
temporaries), not only what autograd saves.

:func:`peak_from_events` is the pure replay; :class:`MemoryProbe` runs a block under the profiler.
Trade-offs: frees of blocks allocated before the probe started are not reported (the profiler
does not know their size), so the figure is an upper bound when such frees happen, except for
blocks allocated while an earlier probe ran, whose frees are reported below zero; so the probe
collects garbage before it starts.  Only the probing thread's events are recorded: a tensor freed
on another thread (gloo's worker) never comes down, so the runtime keeps those buffers until its
own thread drops them.  A probed step is slower, so it is not a timed one; allocations outside torch's allocator
are not counted.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class MemoryTrace:
    """What a replay of allocation events found."""

    peak_bytes: int
    """Highest bytes allocated since the start (0 if nothing was ever allocated)."""
    peak_time: float
    """Time of the event that reached the peak (the first such; the start time if none)."""
    final_bytes: int
    """Bytes still allocated after the last event (net of the block)."""
    num_events: int


def _replay(events: Iterable[tuple[float, int]]) -> tuple[list[float], list[int]]:
    """Event times in order (ties keep the given order) and the bytes allocated after each."""
    ordered = sorted(enumerate(events), key=lambda e: (e[1][0], e[0]))
    times, levels, level = [], [], 0
    for _, (t, nbytes) in ordered:
        level += int(nbytes)
        times.append(t)
        levels.append(level)
    return times, levels


def peak_from_events(events: Iterable[tuple[float, int]]) -> MemoryTrace:
    """Replay ``(time, signed bytes)`` events in time order (ties keep the given order)."""
    times, levels = _replay(events)
    peak, peak_time = 0, times[0] if times else 0.0
    for t, level in zip(times, levels):
        if level > peak:
            peak, peak_time = level, t
    return MemoryTrace(peak, peak_time, levels[-1] if levels else 0, len(times))


def window_peaks(events: Iterable[tuple[float, int]], windows: Iterable[tuple[float, float]]) -> list[int]:
    """Highest bytes allocated (since the start of ``events``) inside each ``(start, end)`` window:
    the level entering the window counts, so a window with no events reads the level it inherits."""
    times, levels = _replay(events)
    out = []
    for start, end in windows:
        i = bisect.bisect_left(times, start)
        best = levels[i - 1] if i > 0 else 0
        while i < len(times) and times[i] <= end:
            best = max(best, levels[i])
            i += 1
        out.append(best)
    return out


class MemoryProbe:
    """``with MemoryProbe() as probe: ...`` then ``probe.trace`` (a :class:`MemoryTrace` of the CPU
    allocator's events inside the block)."""

    def __init__(self) -> None:
        self.trace: MemoryTrace | None = None
        self.events: list[tuple[float, int]] = []
        """The ``(time, signed bytes)`` allocator events of the block (for :func:`window_peaks`)."""
        self._prof = None

    def __enter__(self) -> "MemoryProbe":
        import gc

        from torch.profiler import ProfilerActivity, profile

        gc.collect()  # see the module docstring: earlier garbage must not be freed inside the block
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        from torch._C._autograd import DeviceType

        self._prof.__exit__(*exc)
        events = [(e.start_ns() * 1e-9, e.nbytes()) for e in self._prof.profiler.kineto_results.events()
                  if e.name() == "[memory]" and e.device_type() == DeviceType.CPU]
        self.trace = peak_from_events(events)
        self.events = events
        self._prof = None
