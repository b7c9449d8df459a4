"""What a slice with K/V context costs torch SDPA on CPU against the cost model's two pair counts.

With a profile of ``context_pairs="band"`` the cost model prices a segment of ``n`` tokens after
``C`` tokens of context by its causal band, ``n^2 + 2 C n`` pairs
(:class:`~infinipipe_hf.planner.cost.compute.UnitShape`), as a block-skipping causal kernel works.
The runtime's ``sdpa`` backend runs such a segment with an explicit boolean mask
(``runtime/attention/sdpa.py``), and torch's CPU kernel then computes the masked blocks too, so
CPU profiles count ``"rectangle"``: ``2 n (C + n)``.  Per shape, forward plus backward of one attention call (the benchmark
model's 8 heads of 32 dims; one thread's CPU time on the runtime rows' clock, median of repeats,
best of three interleaved rounds):

- ``masked_ms``: the masked call of ``n`` queries over ``C + n`` keys, as the runtime makes it;
- ``band_ms``: the band model's price, the causal ``(C + n)^2`` call scaled by its share of pairs;
- ``masked_over_band``: what the band count misses on CPU for that slice;
- ``rectangle_ms``, ``masked_over_rectangle``: the same for the rectangle count.

    python -m benchmarks.cpu.sdpa_masked_band     # writes benchmarks/results/sdpa_masked_band.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.lib.paths import RESULTS
from benchmarks.lib.row_clock import RowClock
from infinipipe_hf.ir.units import Segment
from infinipipe_hf.planner.cost.compute import UnitShape
from infinipipe_hf.runtime.attention.types import segment_mask

HEADS, HEAD_DIM = 8, 32
SHAPES = ((256, 256), (512, 512), (512, 1024), (1024, 1024), (1024, 2048), (384, 1664))
"""(n, C): slices of the CPU profile's fit and held-out shapes and of the simulator benchmark."""


def _median_ms(fn, repeat: int) -> float:
    clock = RowClock()
    for _ in range(repeat):
        clock.run(fn)
    return clock.seconds() * 1e3


def _call(q, k, v, **kw):
    def run():
        F.scaled_dot_product_attention(q, k, v, **kw).sum().backward()
    return run


def measure(n: int, context: int, repeat: int, rounds: int) -> dict:
    def leaf(length):
        return torch.randn(1, HEADS, length, HEAD_DIM, requires_grad=True)
    total = context + n
    q, k, v, q_big = leaf(n), leaf(total), leaf(total), leaf(total)
    mask = segment_mask(n, context, None, q.device)  # the runtime's mask for this segment
    masked = _call(q, k, v, attn_mask=mask)
    causal_big = _call(q_big, k, v, is_causal=True)
    best = min((_median_ms(masked, repeat), _median_ms(causal_big, repeat)) for _ in range(rounds))
    band_share = UnitShape.of([Segment(0, context, total)]).pairs / (total * total)
    rectangle_share = UnitShape.of([Segment(0, context, total)], "rectangle").pairs / (total * total)
    band, rectangle = best[1] * band_share, best[1] * rectangle_share
    return {"n": n, "context": context, "masked_ms": best[0], "causal_total_ms": best[1],
            "band_share": band_share, "band_ms": band, "masked_over_band": best[0] / band,
            "rectangle_share": rectangle_share, "rectangle_ms": rectangle,
            "masked_over_rectangle": best[0] / rectangle}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "sdpa_masked_band.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    load = os.getloadavg()
    rows = []
    for n, context in SHAPES:
        rows.append(measure(n, context, args.repeat, args.rounds))
        r = rows[-1]
        print(f"n={n} C={context}: masked {r['masked_ms']:.1f} ms, band {r['band_ms']:.1f} ms "
              f"(x{r['masked_over_band']:.2f}), rectangle {r['rectangle_ms']:.1f} ms "
              f"(x{r['masked_over_rectangle']:.2f})", flush=True)
    report = {"what": __doc__.split("\n")[0], "heads": HEADS, "head_dim": HEAD_DIM, "rows": rows,
              "torch": torch.__version__, "machine": platform.platform(), "threads": 1,
              "load_average_at_start": load, "load_average_at_end": os.getloadavg()}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
