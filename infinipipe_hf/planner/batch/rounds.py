"""Sequences and micro-batches into rounds, for the schedules that are not pipelines.

A round is one micro-batch on every GPU group at once.  :func:`lockstep_rounds` deals equal
groups their micro-batches slowest first, ``groups`` per round, which minimises the sum of the
rounds' maxima for a given set of micro-batches; :func:`blast` (FlexSP's sequence blaster) puts
whole sequences, longest first, into the round with the fewest tokens so far.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def lockstep_rounds(times: Sequence[float], groups: int) -> list[list[int]]:
    """Indices of micro-batches per round: slowest first, ``groups`` per round."""
    order = sorted(range(len(times)), key=lambda i: (-times[i], i))
    return [order[i:i + groups] for i in range(0, len(order), groups)]


def blast(lengths: Sequence[int], num_rounds: int) -> list[list[int]]:
    """Sequences into ``num_rounds`` rounds, longest first into the round with the fewest tokens."""
    rounds: list[list[int]] = [[] for _ in range(num_rounds)]
    tokens = np.zeros(num_rounds)
    for s in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = int(np.argmin(tokens))
        rounds[r].append(s)
        tokens[r] += lengths[s]
    return [r for r in rounds if r]
