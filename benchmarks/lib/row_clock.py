"""The clock of the runtime rows (``runtime_rows.py``): what one timed call of a unit costs.

On CPU a row's seconds are the calling thread's CPU time (``time.thread_time``), with the wall
clock beside it: on a shared machine the wall clock also counts the time the scheduler gave the
core away, while the thread's CPU time is the work alone.  On CUDA the host only queues kernels,
so thread CPU time means nothing there: the device is synchronised before the call (earlier work,
such as an untimed context unit, is not charged to it) and after it (its kernels have finished),
and the row's seconds are that wall time.  Trade-off: a CUDA call is then timed from an empty
queue, so a unit too small to hide its kernel launches pays them in full, as a one-layer action
does; a deep stage queues its layers back to back and pays less per layer.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


class RowClock:
    """Times calls on ``device``; ``seconds()`` is the median a row reports (module docstring)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.cpu: list[float] = []
        self.wall: list[float] = []

    @property
    def synchronized(self) -> bool:
        return self.device.type == "cuda"

    def run(self, fn: Callable[[], object]):
        if self.synchronized:
            torch.cuda.synchronize(self.device)
        c0, w0 = time.thread_time(), time.perf_counter()
        out = fn()
        if self.synchronized:
            torch.cuda.synchronize(self.device)
        self.wall.append(time.perf_counter() - w0)
        self.cpu.append(time.thread_time() - c0)
        return out

    def seconds(self) -> float:
        """Median CPU seconds of the thread on CPU, median synchronised wall seconds on CUDA."""
        return float(statistics.median(self.wall if self.synchronized else self.cpu))

    def wall_seconds(self) -> float:
        return float(statistics.median(self.wall))
