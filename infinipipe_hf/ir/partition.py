"""Contiguous decoder-layer ranges per pipeline stage, balancing cost: the one home of both policies.

``partition_layers`` (the engine's) and ``balanced_layer_split`` (the planner's default when it
is given no split) both minimise the most loaded stage but break ties differently (even spread vs
front-loaded), so a plan made without the engine's split may assume another one; the engine
always passes its own.  One policy for both is a behaviour change left for later.

Design: every decoder layer costs one unit; the first stage additionally pays
``first_stage_extra`` layer-equivalents (embeddings) and the last stage ``last_stage_extra``
(final norm, LM head, loss).  We minimise the most expensive stage (the pipeline runs at the pace
of its slowest stage), then, among the splits reaching that optimum, minimise the sum of squared
stage costs so spare capacity is spread evenly instead of piling onto one stage.  Two small
dynamic programmes (O(pp * layers^2)) are exact and deterministic; layer counts are tiny, so the
trade-off of an exact search over a greedy one costs nothing.  An explicit ``layer_split`` is
validated and used as given.
"""
from __future__ import annotations

_EPS = 1e-9


def _balanced_split(num_layers: int, extras: list[float]) -> list[int]:
    """Layers per stage minimising the most expensive stage, then the sum of squared stage costs;
    ``extras[s]``: stage ``s``'s cost beside its layers (one stage per entry)."""
    inf = float("inf")
    L, S = num_layers, len(extras)
    # best_max[p][l]: minimal max stage cost placing layers [0, l) on stages [0, p).
    best_max = [[inf] * (L + 1) for _ in range(S + 1)]
    best_max[0][0] = 0.0
    for p in range(1, S + 1):
        for l in range(p, L - (S - p) + 1):
            for k in range(p - 1, l):
                if best_max[p - 1][k] == inf:
                    continue
                c = max(best_max[p - 1][k], (l - k) + extras[p - 1])
                if c < best_max[p][l]:
                    best_max[p][l] = c
    cap = best_max[S][L] + _EPS
    # Second pass: among splits whose every stage is within the optimum, minimise sum of squares.
    best_sq = [[inf] * (L + 1) for _ in range(S + 1)]
    choice = [[-1] * (L + 1) for _ in range(S + 1)]
    best_sq[0][0] = 0.0
    for p in range(1, S + 1):
        for l in range(p, L - (S - p) + 1):
            for k in range(p - 1, l):
                if best_sq[p - 1][k] == inf:
                    continue
                c = (l - k) + extras[p - 1]
                if c > cap:
                    continue
                v = best_sq[p - 1][k] + c * c
                if v < best_sq[p][l] - _EPS:
                    best_sq[p][l] = v
                    choice[p][l] = k
    split, l = [], L
    for p in range(S, 0, -1):
        k = choice[p][l]
        assert k >= 0, (num_layers, extras)
        split.append(l - k)
        l = k
    return split[::-1]


def partition_layers(num_layers: int, pp_degree: int, *, layer_split: list[int] | None = None,
                     first_stage_extra: float = 0.0, last_stage_extra: float = 0.0) -> list[range]:
    """Contiguous layer ranges, one per stage, every stage with at least one decoder layer."""
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
    if not isinstance(pp_degree, int) or pp_degree < 1:
        raise ValueError(f"pp_degree must be a positive integer, got {pp_degree!r}")
    if pp_degree > num_layers:
        raise ValueError(f"pp_degree={pp_degree} exceeds the model's {num_layers} decoder layers; "
                         f"use pp_degree <= {num_layers}")
    if first_stage_extra < 0 or last_stage_extra < 0:
        raise ValueError(f"stage extras must be >= 0, got first_stage_extra={first_stage_extra}, "
                         f"last_stage_extra={last_stage_extra}")
    if layer_split is not None:
        split = list(layer_split)
        if (len(split) != pp_degree or any(not isinstance(n, int) or n < 1 for n in split)
                or sum(split) != num_layers):
            base, rem = divmod(num_layers, pp_degree)
            even = [base + (1 if i < rem else 0) for i in range(pp_degree)]
            raise ValueError(
                f"layer_split={split} is invalid for a model with {num_layers} decoder layers and "
                f"pp_degree={pp_degree}: it must list {pp_degree} positive layer counts summing to "
                f"{num_layers}, e.g. {even}")
    else:
        extras = [0.0] * pp_degree
        extras[0] += float(first_stage_extra)
        extras[-1] += float(last_stage_extra)
        split = _balanced_split(num_layers, extras)
    ranges, lo = [], 0
    for n in split:
        ranges.append(range(lo, lo + n))
        lo += n
    return ranges


def balanced_layer_split(num_layers: int, pp_degree: int, first_extra: float = 0.0,
                         last_extra: float = 0.0) -> list[int]:
    """Contiguous layers per stage minimising the most loaded stage's cost (in layer units).

    Binary search on the bottleneck; stages get at least one layer each.
    """
    if pp_degree > num_layers:
        raise ValueError(f"pp_degree={pp_degree} exceeds the model's {num_layers} decoder layers; "
                         f"use pp_degree <= {num_layers}")

    def split_under(cap: float) -> list[int] | None:
        counts: list[int] = []
        remaining = num_layers
        for stage in range(pp_degree):
            extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == pp_degree - 1 else 0.0)
            stages_left = pp_degree - stage - 1
            if stage == pp_degree - 1:
                n = remaining
            else:
                n = int(max(cap - extra, 0) + 1e-9)
                n = max(1, min(n, remaining - stages_left))
            if n < 1 or n + extra > cap + 1e-9:
                return None
            counts.append(n)
            remaining -= n
        return counts if remaining == 0 else None

    lo, hi = 1.0, num_layers + first_extra + last_extra
    best = split_under(hi)
    assert best is not None
    for _ in range(60):
        mid = (lo + hi) / 2
        got = split_under(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    return best
