"""Actions: ``F<unit>`` / ``B<unit>`` on one stage, with a string form that round-trips.

Like ``torch.distributed.pipelining``'s ``1F0`` strings, an action list is plain text that can be
printed, diffed and parsed back: ``Action.parse(str(a)) == a``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

_ACTION_RE = re.compile(r"^\s*([FB])(\d+)\s*$")


@dataclass(frozen=True)
class Action:
    """``kind`` is ``"F"`` (forward) or ``"B"`` (backward) of unit ``unit`` on a stage."""

    kind: str
    unit: int

    def __post_init__(self) -> None:
        assert self.kind in ("F", "B"), f"action kind must be F or B, got {self.kind!r}"
        assert self.unit >= 0, f"unit id must be >= 0, got {self.unit}"

    def __str__(self) -> str:
        return f"{self.kind}{self.unit}"

    @property
    def is_forward(self) -> bool:
        return self.kind == "F"

    @staticmethod
    def parse(text: str) -> "Action":
        m = _ACTION_RE.match(text)
        if not m:
            raise ValueError(f"cannot parse action {text!r}; expected 'F<unit>' or 'B<unit>', e.g. 'F3'")
        return Action(m.group(1), int(m.group(2)))


def F(unit: int) -> Action:
    return Action("F", unit)


def B(unit: int) -> Action:
    return Action("B", unit)


def format_actions(actions: Iterable[Action]) -> str:
    return " ".join(str(a) for a in actions)


def parse_actions(text: str) -> list[Action]:
    return [Action.parse(tok) for tok in text.split()]
