"""Pipeline metrics the trainer adds to HF's logs: throughput, MFU, bubbles, recompute, memory.

Design: ``StepMetrics`` accumulates per-step numbers from ``StepOutput`` (identical on every rank:
they come from the plan and its simulation, plus the global token counts), and ``flush`` turns
the window since the last log into averages.  No collective is needed, so logging can never
desynchronise ranks.  Trade-off: bubble fraction and per-stage peak memory are the planner's
*predicted* values for the executed plan (the same numbers on every rank); the measured peak of
this rank's device is added on CUDA only.  MFU uses the 6 * params * tokens rule (attention
FLOPs not counted, recompute not credited), the usual convention.

``TrainingCounts`` keeps what HF's own bookkeeping gets wrong for a token-budget pipeline: the
sequences and tokens of one ``train()`` call (HF counts one sample per rank per step), and the
optimizer steps that had no label token at all, which must not enter the logged mean as 0.0.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch


def recomputed_layers(plan) -> int:
    """Decoder-layer forwards recomputed in the step: checkpointed layers summed over cells."""
    return int(sum(n for per_unit in plan.checkpoint_layers.values() for n in per_unit.values()))


@dataclass
class StepMetrics:
    """Window of steps since the last log line."""

    num_params: int
    """Parameters of the whole model (for MFU)."""
    world_size: int
    """Devices the step runs on (MFU divides by all of them)."""
    peak_flops: float | None
    """Peak FLOP/s of one device; ``None``: no MFU."""
    tokens: int = 0
    steps: int = 0
    bubble: list[float] = field(default_factory=list)
    recomputed: int = 0
    peak_memory: list[float] = field(default_factory=list)
    window_start: float | None = None

    def __post_init__(self) -> None:
        if self.num_params < 1 or self.world_size < 1:
            raise ValueError(f"num_params and world_size must be >= 1, got {self.num_params}, "
                             f"{self.world_size}")

    def start(self) -> None:
        if self.window_start is None:
            self.window_start = time.perf_counter()

    def add(self, out, sim=None) -> None:
        """Count one micro-batch's ``StepOutput``; ``sim``: its plan's simulation, if planned
        outside the engine (look-ahead)."""
        self.tokens += int(out.num_tokens)
        self.steps += 1
        self.recomputed += recomputed_layers(out.plan)
        if sim is not None:
            self.bubble.append(float(sim.bubble_fraction))
            peaks = [float(b) for b in sim.peak_memory_bytes]
            self.peak_memory = [max(a, b) for a, b in zip(self.peak_memory, peaks)] if self.peak_memory \
                else peaks

    def flush(self, device: torch.device) -> dict[str, float]:
        """Metrics of the window, then reset it; empty when no step ran since the last call."""
        if not self.steps or self.window_start is None:
            return {}
        elapsed = max(time.perf_counter() - self.window_start, 1e-9)
        logs = {"tokens_per_s": self.tokens / elapsed,
                "recomputed_layers_per_step": self.recomputed / self.steps}
        if self.peak_flops:
            logs["mfu"] = 6.0 * self.num_params * self.tokens / elapsed / (self.peak_flops * self.world_size)
        if self.bubble:
            logs["bubble_fraction"] = sum(self.bubble) / len(self.bubble)
        for s, b in enumerate(self.peak_memory):
            logs[f"planned_peak_memory_gib_stage{s}"] = b / 2**30
        if device.type == "cuda":
            logs["measured_peak_memory_gib_this_rank"] = torch.cuda.max_memory_allocated(device) / 2**30
        self.tokens = self.steps = self.recomputed = 0
        self.bubble, self.peak_memory, self.window_start = [], [], None
        return logs


@dataclass
class TrainingCounts:
    """Sequences and tokens trained in one ``train()`` call, and its label-free optimizer steps."""

    sequences: int = 0
    """Sequences (document pieces) of every global batch trained, counted once (not per rank)."""
    tokens: int = 0
    """Their tokens."""
    skipped: set[int] = field(default_factory=set)
    """0-based indices of optimizer steps without a single label token."""
    first_step: int | None = None
    """Index of the first optimizer step this call trained (after a resume: not 0)."""
    window_start: int | None = None
    """Index of the first step of the current logging window."""

    def add_batch(self, batch, step: int) -> None:
        if self.first_step is None:
            self.first_step = step
        if self.window_start is None:
            self.window_start = step
        self.sequences += len(batch)
        self.tokens += sum(len(item["input_ids"]) for item in batch)

    def skip_step(self, step: int) -> bool:
        """Mark step ``step`` label-free; True the first time (one warning per step)."""
        new = step not in self.skipped
        self.skipped.add(step)
        return new

    def correct_window_loss(self, loss: float, global_step: int) -> dict[str, float]:
        """HF's window loss averages over every step, a label-free one as 0.0: average over the
        steps that trained instead (NaN when none did), and say how many were skipped."""
        start = self.window_start if self.window_start is not None else global_step
        self.window_start = None
        n = global_step - start
        k = sum(1 for s in range(start, global_step) if s in self.skipped)
        if not k or n <= 0:
            return {}
        return {"loss": loss * n / (n - k) if k < n else math.nan, "skipped_steps": k}

    def final_metrics(self, logs: dict, global_step: int) -> dict[str, float]:
        """End-of-training metrics: throughput of the global batches, mean loss over the steps
        that trained."""
        out: dict[str, float] = {}
        runtime = float(logs.get("train_runtime") or 0.0)
        if runtime > 0:
            out["train_samples_per_second"] = round(self.sequences / runtime, 3)
            out["train_tokens_per_second"] = round(self.tokens / runtime, 3)
        n = global_step - (self.first_step if self.first_step is not None else global_step)
        k = len(self.skipped)
        if k and "train_loss" in logs and n > 0:
            out["train_loss"] = logs["train_loss"] * n / (n - k) if k < n else math.nan
        return out
