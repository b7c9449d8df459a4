"""The K/V store sharded over the SP ranks sharing a K/V head (``workers/sp_kv_shards.py``):
pp 1 x sp 4 with 2 K/V heads (groups of 2 ranks) and 1 K/V head (one group of 4), a long
sequence in five slices plus short ones, every checkpoint level, with and without ``offload_kv``:
loss and every gradient equal single-process HF in float64, and the store's bytes of one K/V
group add up to one rank's replicated store."""
from __future__ import annotations

import re

import pytest

from tests.distributed.launch import check_cases

CASES = [f"sp4_kv{kv}_{what}" for kv in (2, 1) for what in ("plain", "levels", "levels_offload_kv")]

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(900)  # the first test of a merged launch waits for all of it
@pytest.mark.merged_launch("kv_shards_world4")
def test_sharded_kv_store_exact_and_one_r_th_per_rank(suite_run):
    check_cases(suite_run, 4, CASES)
    ratios = [float(x) for x in re.findall(r"CASE sp4_kv1_plain OK .*?peak_store_ratio=([0-9.]+)", suite_run.output)]
    assert len(ratios) == 4 and all(0.2 <= x <= 0.31 for x in ratios), ratios  # about 1/4 per rank
