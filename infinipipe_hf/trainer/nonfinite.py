"""Non-finite losses and gradients: stop naming where they came from, or skip the step.

Design: one NaN in a gradient turns every weight it touches into NaN at the optimizer step, and
from then on every loss, evaluation and checkpoint is garbage while the job exits 0.  Before each
optimizer step ``NonFiniteGuard.decide`` looks at the step's loss (the global mean, the same on
every rank) and its global gradient norm (also the same on every rank: the norm is reduced over
the stages and DP replicas hold all-reduced copies).  Only when either is not finite do the ranks
exchange what they see (one ``all_gather_object``): which of this rank's gradients are
non-finite, and which units' losses were non-finite on a last stage.  The happy path therefore
costs one ``math.isfinite`` per step.  Every rank then reaches the same decision:
- ``nonfinite_policy="stop"`` (default): ``NonFiniteError`` on every rank naming the step, the
  ranks and the units, before the optimizer step and before any checkpoint of that step;
- ``"skip"``: the step's gradients are dropped (``.grad = None``, so optimizers update nothing,
  weight decay and momentum included), the LR scheduler does not advance (as HF does after an
  fp16 overflow), a warning names the step, and ``nonfinite_skipped_steps`` counts them in logs.
``check_parameters`` (collective, before a save) refuses to write a checkpoint whose parameters
are not finite, so checkpoint rotation never deletes a good checkpoint in favour of a bad one.
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from infinipipe_hf.runtime.parallel.fsdp_api import local_tensor
from infinipipe_hf.trainer import notices

NONFINITE_POLICIES = ("stop", "skip")
_NAMED = 4
"""Tensors and units named per rank in a message; the rest are counted."""


class NonFiniteError(FloatingPointError):
    """A non-finite loss, gradient or parameter; raised with the same text on every rank."""


def _gather(obj: Any) -> list[Any]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def nonfinite_names(named: Iterable[tuple[str, torch.Tensor | None]]) -> list[str]:
    """Names of the tensors holding a NaN or an infinity (``None`` entries skipped); one device
    synchronisation for all of them."""
    names, flags = [], []
    for name, t in named:
        if t is not None:
            names.append(name)
            flags.append(torch.isfinite(local_tensor(t.detach())).all())
    if not names:
        return []
    ok = torch.stack(flags).cpu().tolist()
    return [n for n, good in zip(names, ok) if not good]


def _listed(names: list[str]) -> str:
    more = len(names) - _NAMED
    return ", ".join(names[:_NAMED]) + (f" and {more} more" if more > 0 else "")


def describe_unit(plan, unit_id: int) -> str:
    """``unit 3 (seq 0 tokens 0:20, seq 5 tokens 0:9)``."""
    unit = plan.unit_by_id.get(unit_id) if plan is not None else None
    if unit is None:
        return f"unit {unit_id}"
    return f"unit {unit_id} (" + ", ".join(f"seq {s.seq} tokens {s.start}:{s.end}" for s in unit.segments) + ")"


def check_parameters(engine, what: str) -> None:
    """Collective: raise ``NonFiniteError`` on every rank when any rank's parameters are not finite."""
    mine = nonfinite_names(engine.named_parameters())
    reports = _gather((engine.layout.describe(), mine))
    bad = [f"{where}: {_listed(names)}" for where, names in reports if names]
    if bad:
        raise NonFiniteError(f"refusing to save {what}: the model's parameters are not finite ("
                             + "; ".join(bad) + "); the checkpoints already saved are left as they "
                             "are (none is rotated out); resume from the newest of them")


class NonFiniteGuard:
    """The non-finite checks of one ``train()`` call (see the module docstring)."""

    def __init__(self, policy: str, engine) -> None:
        if policy not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite_policy={policy!r} is not known; use 'stop' or 'skip'")
        self.policy = policy
        self.engine = engine
        self.skipped = 0
        """Optimizer steps skipped for a non-finite loss or gradient norm in this ``train()``."""
        self._loss_finite = True
        self._loss = 0.0
        self._units: list[str] = []
        self._micro = 0
        self._marked: Any = None

    def record(self, out) -> None:
        """Note one micro-batch's ``StepOutput`` (its loss is global; its units this rank's)."""
        self._micro += 1
        if not math.isfinite(out.loss):
            self._loss_finite, self._loss = False, out.loss
            tag = f"micro-batch {self._micro}: " if self._micro > 1 else ""
            self._units += [tag + describe_unit(out.plan, u) for u in getattr(out, "nonfinite_units", ())]

    def _message(self, step: int, grad_norm: float) -> str:
        """Collective: what every rank holds that is not finite, in one sentence per rank."""
        lay = self.engine.layout
        grads = nonfinite_names((n, p.grad) for n, p in self.engine.named_parameters())
        reports = _gather((lay.describe(), grads, self._units))
        what = [] if self._loss_finite else [f"the loss is {self._loss}"]
        if not math.isfinite(grad_norm):
            what.append(f"the gradient norm is {grad_norm}")
        parts = [f"step {step}: " + " and ".join(what)]
        for where, names, bad_units in reports:
            if bad_units:
                parts.append(f"non-finite token losses on {where} from {_listed(bad_units)}")
            if names:
                parts.append(f"non-finite gradients on {where}: {_listed(names)}")
        if not math.isfinite(grad_norm) and not any(r[1] for r in reports):
            parts.append("every gradient element is finite (their sum of squares overflowed)")
        if not self._loss_finite and not any(r[2] for r in reports):
            parts.append("every unit's loss is finite (their sum overflowed)")
        return "; ".join(parts)

    def decide(self, grad_norm: float, step: int, optimizer=None) -> bool:
        """Before the optimizer step (collective only when something is not finite): ``True`` when
        the step is to be skipped; raises ``NonFiniteError`` under the ``stop`` policy."""
        norm = float(grad_norm) if grad_norm is not None else 0.0
        bad = not (self._loss_finite and math.isfinite(norm))
        message = self._message(step, norm) if bad else ""
        self._loss_finite, self._units, self._micro = True, [], 0
        if not bad:
            self._unmark()
            return False
        if self.policy == "stop":
            raise NonFiniteError(f"{message}. The optimizer step was not applied and nothing of this "
                                 f"step was saved; resume from the last checkpoint (lower the learning "
                                 f"rate or check the data named above), or set nonfinite_policy='skip' "
                                 f"to skip such steps and keep training")
        self.skipped += 1
        notices.warn(f"{message}. Step {step} is skipped (no optimizer or scheduler update); "
                     f"{self.skipped} skipped so far (logged as 'nonfinite_skipped_steps')")
        if optimizer is not None:
            self._drop(optimizer)
        return True

    def _drop(self, optimizer) -> None:
        """No update: gradients removed, and accelerate told the step was skipped (the scheduler
        then holds the learning rate, as after an fp16 overflow)."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None
        if getattr(optimizer, "scaler", None) is None and isinstance(getattr(optimizer, "_is_overflow", None), bool):
            optimizer._is_overflow = True
            self._marked = optimizer
        else:
            notices.warn(f"{type(optimizer).__name__} is not accelerate's optimizer wrapper this version "
                         f"knows: the learning-rate scheduler advances on skipped steps")

    def _unmark(self) -> None:
        if self._marked is not None:
            self._marked._is_overflow = False
            self._marked = None

    def log_fields(self) -> dict[str, float]:
        """``nonfinite_skipped_steps`` (this ``train()`` so far) once a step was skipped."""
        return {"nonfinite_skipped_steps": float(self.skipped)} if self.skipped else {}


def guard_of(trainer) -> NonFiniteGuard:
    """The trainer's guard for the current ``train()`` (made on first use)."""
    guard = getattr(trainer, "_nonfinite_guard", None)
    if guard is None:
        guard = trainer._nonfinite_guard = NonFiniteGuard(trainer.args.nonfinite_policy, trainer.engine)
    return guard
