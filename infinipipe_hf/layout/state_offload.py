"""Where a stage's model states live between uses: the state-offload modes (one table).

========== ===================================== ==============================================
mode       in host memory                        on the device during a step
========== ===================================== ==============================================
none       --                                    weights, gradients, optimizer states
optimizer  fp32 master weights, AdamW moments    weights, gradients (the step runs on the CPU:
                                                 gradients down, updated weights up)
states     weights, gradients, AdamW moments     the layers running now, gathered from host
                                                 (FSDP2 ``CPUOffloadPolicy``), and one layer's
                                                 gradient before it goes to host
========== ===================================== ==============================================

Like a shard mode this is a layout choice (the layout search picks it); what it costs is the
cost model's (``planner/cost/states.py``, ``planner/cost/state_host.py``).  Code asks a
:class:`StateOffload` what it keeps where, never compares its name.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StateOffload:
    """Which model states of a stage live in host memory (module docstring)."""

    name: str
    optimizer_on_host: bool = False
    """AdamW moments and fp32 master weights on host; the optimizer step runs on the CPU."""
    weights_on_host: bool = False
    """Weights and accumulated gradients on host too; layers are copied to the device to run."""
    summary: str = ""
    """What the mode does in words (messages)."""

    def __str__(self) -> str:
        return self.name

    @property
    def offloaded(self) -> bool:
        return self.optimizer_on_host or self.weights_on_host


OFFLOAD_TABLE: dict[str, StateOffload] = {m.name: m for m in (
    StateOffload("none"),
    StateOffload("optimizer", optimizer_on_host=True, summary="optimizer states in host memory"),
    StateOffload("states", optimizer_on_host=True, weights_on_host=True,
                 summary="weights, gradients and optimizer states in host memory"),
)}
STATE_OFFLOADS = tuple(OFFLOAD_TABLE)
NO_OFFLOAD = OFFLOAD_TABLE["none"]


def state_offload(mode: str | StateOffload) -> StateOffload:
    """The row of ``mode`` (a name or a row); ``ValueError`` when it is not known."""
    if isinstance(mode, StateOffload):
        return mode
    if mode not in OFFLOAD_TABLE:
        raise ValueError(f"state_offload={mode!r} is not known; use one of {', '.join(STATE_OFFLOADS)}")
    return OFFLOAD_TABLE[mode]
