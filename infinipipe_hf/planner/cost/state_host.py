"""Model states in host memory: their host bytes and the optimizer step they move to the CPU.

What a state-offload mode (:mod:`infinipipe_hf.layout.state_offload`) keeps on the device, and
the host copies ``states`` offload makes in every action, are :mod:`states`'; this part prices the
rest, per GPU (a rank holds its shard: everything below is over the shard's elements).

Host bytes (:meth:`StateHostCost.host_bytes`):
- ``optimizer``: the fp32 master weights (``weight_bytes_per_param``), the optimizer's moments
  (``optimizer_bytes_per_param``) and a pinned buffer the gradients are copied into
  (``reduce_bytes_per_param``): 4 + 8 + 4 = 16 bytes per parameter of the shard;
- ``states``: weights, accumulated gradients and moments (``state_bytes_per_param``: 16).

Step tail (:meth:`StateHostCost.step_tail_s`): after the stage's last backward and its gradient
reduction, the step runs on the CPU, one FSDP unit (decoder layer; embedding; norm + head) after
another: its gradient shard is copied down (``optimizer`` offload; ``states`` offload already
has it on host), the CPU's AdamW updates it (``host_optimizer_params_per_s``), and its updated
weights are copied up (``optimizer`` only; ``states`` fetches them when they next run).  Down,
step and up of different units overlap (copy engines for each direction, the CPU), so the tail is
``max(all downs, all steps, all ups) + the first unit's down + the last unit's up``
(:func:`pipelined_tail_s`): exact for equal units when the CPU step is the slowest of the three
(the usual case: 1e9 parameters/s against 10e9 of copies at 40 GB/s), otherwise an upper bound by
less than one unit's stage.  Copies go at ``host_bandwidth_bytes_per_s`` per direction.  The tail
does not overlap the gradient reduction before it (the step needs reduced gradients).

The module-level functions price the same mechanisms for schedules outside the pipeline cost model
(the ZeRO-3 alternatives in :mod:`infinipipe_hf.planner.alternatives`), with
:func:`~.states.unit_reduced_state_bytes` for their device bytes.
"""
from __future__ import annotations

from functools import cached_property
from typing import Sequence

from infinipipe_hf.layout import StateOffload
from infinipipe_hf.planner.cost.profile import HardwareProfile
from infinipipe_hf.planner.cost.states import StatePrecision


def host_state_bytes_per_param(offload: StateOffload, precision: StatePrecision) -> float:
    """Host bytes per parameter of a rank's shard under ``offload`` (module docstring)."""
    p = precision
    if offload.weights_on_host:
        return p.state_bytes_per_param
    if offload.optimizer_on_host:
        return p.weight_bytes_per_param + p.optimizer_bytes_per_param + p.reduce_bytes_per_param
    return 0.0


def device_kept_bytes_per_param(offload: StateOffload, precision: StatePrecision) -> float:
    """Device bytes per parameter of a rank's shard kept through a step, gradients apart
    (:meth:`StatePrecision.kept_bytes_per_param`)."""
    return precision.kept_bytes_per_param(offload)


def unit_copy_s(numels: Sequence[float], bytes_per_param: float, profile: HardwareProfile) -> list[float]:
    """Seconds to copy each unit of ``numels`` elements of ``bytes_per_param`` between host and device."""
    bw = profile.host_bandwidth_bytes_per_s
    return [n * bytes_per_param / bw for n in numels]


def pipelined_tail_s(down: Sequence[float], step: Sequence[float], up: Sequence[float]) -> float:
    """Seconds of per-unit copy-down, CPU step and copy-up pipelined over the units (module docstring)."""
    if not step:
        return 0.0
    return max(sum(down), sum(step), sum(up)) + down[0] + up[-1]


def offloaded_step_tail_s(offload: StateOffload, shard_numels: Sequence[float], precision: StatePrecision,
                          profile: HardwareProfile, *, grads_on_device: bool = True) -> float:
    """Exposed seconds of the CPU optimizer step of one rank's units (``shard_numels``: the elements
    of each FSDP unit it holds); ``grads_on_device``: the reduced gradients are on the device at the
    step and are copied down first (``optimizer`` offload; ``states`` only when reduced per step)."""
    if not offload.optimizer_on_host or not shard_numels:
        return 0.0
    p, zeros = precision, [0.0] * len(shard_numels)
    down = unit_copy_s(shard_numels, p.reduce_bytes_per_param, profile) if grads_on_device else zeros
    step = [n / profile.host_optimizer_params_per_s for n in shard_numels]
    up = zeros if offload.weights_on_host else unit_copy_s(shard_numels, p.weight_bytes_per_param, profile)
    return pipelined_tail_s(down, step, up)


class StateHostCost:
    """Host bytes and the optimizer step's tail of a stage's model states (module docstring).

    ``states``: the stage's :class:`~infinipipe_hf.planner.cost.states.ShardedStates` (its mode,
    precision, per-unit shard elements and whether gradients are reduced per unit)."""

    def __init__(self, states, profile: HardwareProfile):
        self.states = states
        self.offload: StateOffload = states.offload
        self.precision: StatePrecision = states.precision
        self.profile = profile

    @staticmethod
    def from_stage(ctx, cost) -> "StateHostCost":
        """The stage's part (:mod:`.model`)."""
        return StateHostCost(cost.states, ctx.profile)

    @cached_property
    def _tails(self) -> list[float]:
        # ``states`` offload reducing per unit has its gradients on host before the step.
        on_device = not (self.offload.weights_on_host and self.states.reduces_per_unit)
        return [offloaded_step_tail_s(self.offload, shard, self.precision, self.profile, grads_on_device=on_device)
                for shard in self.states.shard_numel]

    def host_bytes(self, stage_index: int) -> float:
        """Host bytes of the stage's model states on one of its GPUs (0 without state offload)."""
        per_param = host_state_bytes_per_param(self.offload, self.precision)
        return sum(self.states.shard_numel[stage_index]) * per_param if per_param else 0.0

    def device_bytes(self, stage_index: int) -> float:
        """Device bytes of the stage's model states during a step (``states.peak_static_bytes``)."""
        return self.states.peak_static_bytes(stage_index)

    def step_tail_s(self, stage_index: int) -> float:
        """Exposed seconds of the offloaded optimizer step after the stage's last backward and
        gradient reduction (0 without optimizer offload)."""
        return self._tails[stage_index]
