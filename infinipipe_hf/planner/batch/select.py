"""Checks on a batch of sequence lengths and on the sequence ids a planner step works on."""
from __future__ import annotations

from typing import Sequence


def check_batch(lengths: Sequence[int]) -> None:
    """A ``ValueError`` unless ``lengths`` holds at least one sequence, each of at least one token."""
    if len(lengths) == 0:
        raise ValueError("empty batch: plan_step needs at least one sequence; check that the data "
                         "loader yields non-empty batches")
    for i, n in enumerate(lengths):
        if int(n) != n or n < 1:
            raise ValueError(f"sequence {i} has length {n}; every sequence needs at least 1 token "
                             f"(drop empty documents before planning)")


def select_sequences(lengths: Sequence[int], seqs: Sequence[int] | None) -> list[int]:
    """Validated sequence ids to process (all of ``lengths`` when ``seqs`` is None)."""
    n = len(lengths)
    if seqs is None:
        chosen = list(range(n))
    else:
        chosen = [int(s) for s in seqs]
        bad = [s for s in chosen if not 0 <= s < n]
        if bad:
            raise ValueError(f"seqs contains ids {bad[:5]} outside the batch of {n} sequences; "
                             f"pass ids in 0..{n - 1}")
        if len(set(chosen)) != len(chosen):
            raise ValueError(f"seqs contains duplicate ids ({len(chosen)} given, {len(set(chosen))} "
                             f"distinct); give every sequence once")
    if not chosen:
        raise ValueError("no sequences to process (empty batch or empty seqs); give at least one")
    short = [s for s in chosen if int(lengths[s]) < 1]
    if short:
        raise ValueError(f"sequence {short[0]} has length {lengths[short[0]]}; every sequence needs "
                         f"at least 1 token (drop empty documents before planning)")
    return chosen
