"""One knob setting for a whole run: the best *static* configuration of a schedule over many batches.

Tuning per batch (what ``plan_step`` and ``plan_alternative`` do) is the most a baseline could
get; real runs fix their configuration once: Seq1F1B one slice count and one checkpoint setting,
DeepSpeed one SP degree and micro-batch length, torchtitan one CP degree.  Every setting a
schedule could be launched with is tried on *all* batches of a run, with one checkpoint count for
the run (the largest any batch needs: fewer would not fit that batch; a setting where that count
does not fit some batch -- checkpointing one layer first costs the memory of its rebuild -- is
out), and the setting with the least total step time wins.  A packing length ``2^k`` packs each
batch at ``max(its longest, 2^k)`` (packing never cuts a sequence).  Throughput is total tokens
over total time.  Pipeline baselines: :mod:`.static_pipeline`; alternatives: :mod:`.static_alternative`.

Trade-off: the grids are the per-batch grids, so a static setting is never luckier than tuning.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class StaticResult:
    """The best single setting of a schedule over a run's batches."""

    schedule: str
    feasible: bool
    """Some setting fits every batch."""
    knobs: dict = field(default_factory=dict)
    """The setting (with ``checkpoint_layers``, the run's uniform count)."""
    step_times_s: list[float] = field(default_factory=list)
    tokens_per_s: float = 0.0
    """Total tokens of the run over total step time."""
    settings_tried: int = 0
    error: str | None = None

    def summary(self) -> dict:
        d = {"schedule": self.schedule, "feasible": self.feasible, "knobs": dict(self.knobs),
             "tokens_per_s": self.tokens_per_s, "step_times_s": list(self.step_times_s),
             "settings_tried": self.settings_tried}
        if self.error:
            d["error"] = self.error
        return d


def static_result(schedule: str, batches: Sequence[Sequence[int]], best: tuple | None, tried: int,
                  error: str | None) -> StaticResult:
    """The result of a static search whose best is ``(total time, knobs, step times)`` or None."""
    if best is None:
        return StaticResult(schedule, False, settings_tried=tried,
                            error=error or f"{schedule}: no single setting fits every batch of the run")
    total, knobs, times = best
    tokens = sum(sum(b) for b in batches)
    return StaticResult(schedule, True, knobs, times, tokens / total, tried)
