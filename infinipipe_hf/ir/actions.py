"""Actions: ``F<unit>`` / ``B<unit>`` on one stage, with a string form that round-trips.

Like ``torch.distributed.pipelining``'s ``1F0`` strings, an action list is plain text that can be
printed, diffed and parsed back: ``Action.parse(str(a)) == a``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache
from typing import Iterable

_ACTION_RE = re.compile(r"^\s*([FB])(\d+)\s*$")


class ActionKind(str, Enum):
    """What an action runs on its stage: a unit's forward or its backward (its string is the
    letter of the action's text form)."""

    FORWARD = "F"
    BACKWARD = "B"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Action:
    """The forward or backward (``kind``) of unit ``unit`` on a stage."""

    kind: ActionKind
    """An :class:`ActionKind` (its letter ``"F"`` / ``"B"`` is accepted)."""
    unit: int
    is_forward: bool = field(init=False, repr=False, compare=False)
    """Whether ``kind`` is the forward (kept as a plain attribute: the planner asks millions of times)."""

    def __post_init__(self) -> None:
        if self.kind.__class__ is not ActionKind:  # the letter given: typed here, once
            try:
                object.__setattr__(self, "kind", ActionKind(self.kind))
            except ValueError:
                raise ValueError(f"action kind must be F or B, got {self.kind!r}") from None
        if self.unit < 0:
            raise ValueError(f"unit id must be >= 0, got {self.unit!r}")
        object.__setattr__(self, "is_forward", self.kind is ActionKind.FORWARD)

    def __str__(self) -> str:
        return f"{self.kind.value}{self.unit}"

    @staticmethod
    def parse(text: str) -> "Action":
        m = _ACTION_RE.match(text)
        if not m:
            raise ValueError(f"cannot parse action {text!r}; expected 'F<unit>' or 'B<unit>', e.g. 'F3'")
        return Action(ActionKind(m.group(1)), int(m.group(2)))


@lru_cache(maxsize=1 << 16)
def F(unit: int) -> Action:
    """The forward of ``unit`` (one shared instance per unit: actions are immutable, and the
    planner builds millions of them)."""
    return Action(ActionKind.FORWARD, unit)


@lru_cache(maxsize=1 << 16)
def B(unit: int) -> Action:
    """The backward of ``unit`` (shared like :func:`F`'s)."""
    return Action(ActionKind.BACKWARD, unit)


def like(action: Action, unit: int) -> Action:
    """The action of the same kind as ``action`` on ``unit``."""
    return F(unit) if action.is_forward else B(unit)


def format_actions(actions: Iterable[Action]) -> str:
    return " ".join(str(a) for a in actions)


def parse_actions(text: str) -> list[Action]:
    return [Action.parse(tok) for tok in text.split()]
