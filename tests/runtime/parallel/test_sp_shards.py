"""Which tokens and heads each sequence-parallel rank owns (``runtime/parallel/sp_shards.py``), and the
rank's unit tensors (``UnitTensors.shard``).

The properties are checked against their definitions (cover every token / head once, sizes
within one of each other, every query head sees exactly its GQA K/V head), not against a copy
of the implementation; a few known layouts (LLaMA-30B's 52 heads at sp 8, Qwen2.5-7B's 28/4 at
sp 8) are spelled out by hand.
"""
from __future__ import annotations

import pytest
import torch

from infinipipe_hf.runtime.parallel.sp_shards import head_shards, token_shards


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 5, 7, 8, 37, 1000, 1001])
@pytest.mark.parametrize("sp", [1, 2, 3, 4, 8])
def test_token_shards_cover_each_token_once_and_differ_by_at_most_one(num_tokens, sp):
    t = token_shards(num_tokens, sp)
    covered = [i for r in range(sp) for i in range(*t.range(r))]
    assert covered == list(range(num_tokens))  # contiguous, in rank order, each once
    assert max(t.sizes) - min(t.sizes) <= 1
    assert all(n >= 1 for n in t.local_sizes)
    # Pads only where a rank has no token, and they sit after every real token.
    assert t.padded_total == num_tokens + sum(1 for n in t.sizes if n == 0)
    real = [n > 0 for n in t.sizes]
    assert real == sorted(real, reverse=True)


def test_token_shards_examples():
    assert token_shards(7, 2).sizes == (4, 3)
    assert token_shards(7, 4).range(3) == (6, 7)
    t = token_shards(1, 4)
    assert t.sizes == (1, 0, 0, 0) and t.local_sizes == (1, 1, 1, 1) and t.range(2) == (1, 1)
    with pytest.raises(ValueError):
        token_shards(0, 2)


def _query_to_kv(heads: int, kv_heads: int, sp: int) -> dict[int, int]:
    """Global K/V head each global query head uses, as each rank's kernel will see it."""
    seen = {}
    for s in head_shards(heads, kv_heads, sp):
        for i in range(s.num_q):
            if s.expand is None:
                local_kv = i // (s.num_q // s.num_kv)
            else:
                local_kv = s.expand[i]
            assert 0 <= local_kv < s.num_kv
            seen[s.q_start + i] = s.kv_start + local_kv
    return seen


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1), (8, 2), (10, 2), (32, 8), (52, 52),
                                            (28, 4), (40, 8), (6, 6), (64, 8), (12, 3), (10, 5), (6, 3)])
@pytest.mark.parametrize("sp", [1, 2, 3, 4, 5, 8])
def test_head_shards_partition_query_heads_and_keep_gqa(heads, kv_heads, sp):
    if sp > heads:
        with pytest.raises(ValueError, match=f"sp_degree <= {heads}"):
            head_shards(heads, kv_heads, sp)
        return
    shards = head_shards(heads, kv_heads, sp)
    assert [s.q_start for s in shards] + [heads] == [0] + [s.q_end for s in shards]
    sizes = [s.num_q for s in shards]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    group = heads // kv_heads
    assert _query_to_kv(heads, kv_heads, sp) == {h: h // group for h in range(heads)}
    for s in shards:  # a rank receives only the K/V heads its queries use
        used = {h // group for h in range(s.q_start, s.q_end)}
        assert set(range(s.kv_start, s.kv_end)) == used


def test_uneven_heads_llama_30b_at_sp8():
    shards = head_shards(52, 52, 8)
    assert [s.num_q for s in shards] == [6, 7, 6, 7, 6, 7, 6, 7]
    assert all(s.expand is None and s.num_kv == s.num_q for s in shards)


def test_gqa_cuts_fall_on_group_boundaries_when_possible():
    # Qwen2.5-7B: 28 heads, 4 K/V heads (groups of 7) at sp 8: no rank needs two K/V heads.
    shards = head_shards(28, 4, 8)
    assert [s.num_q for s in shards] == [3, 4, 3, 4, 3, 4, 3, 4]
    assert all(s.num_kv == 1 and s.expand is None for s in shards)
    # Fewer K/V heads than ranks: each K/V head goes to two ranks (replication).
    assert [(s.kv_start, s.kv_end) for s in head_shards(4, 2, 4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    # 10 heads / 2 K/V heads at sp 4: cuts 0, 2, 5, 7, 10 fall on the group boundary 5.
    assert all(s.expand is None for s in head_shards(10, 2, 4))
    # 10 heads / 5 K/V heads (groups of 2) at sp 4: heads 2, 3, 4 use K/V heads 1, 1, 2 and
    # heads 7, 8, 9 use 3, 4, 4: those ranks expand K/V per query head.
    shards = head_shards(10, 5, 4)
    assert [s.expand for s in shards] == [None, (0, 0, 1), None, (0, 1, 1)]


def test_bad_head_configurations():
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        head_shards(6, 4, 2)
    with pytest.raises(ValueError, match="without an attention head"):
        head_shards(4, 2, 8)


def test_unit_tensors_shard_is_the_rank_token_range_with_pads_only_for_empty_ranks():
    from infinipipe_hf.ir.units import Segment, Unit
    from infinipipe_hf.runtime.stage.unit_tensors import build_unit_tensors

    batch = [{"input_ids": list(range(10, 30)), "labels": [-100] * 5 + list(range(15, 30))},
             {"input_ids": [7, 8, 9]}]
    unit = Unit(0, (Segment(0, 12, 20), Segment(1, 0, 3)))  # a tail slice packed with a short doc
    full = build_unit_tensors(unit, batch)
    for sp in (1, 2, 3, 4, 11, 16):
        shards = token_shards(unit.num_tokens, sp)
        parts = [full.shard(*shards.range(r), shards.local_sizes[r]) for r in range(sp)]
        real = [p for p, n in zip(parts, shards.sizes) if n]
        for name in ("input_ids", "position_ids", "labels"):
            got = torch.cat([getattr(p, name) for p in real], dim=1)
            assert torch.equal(got, getattr(full, name)), (sp, name)
        assert sum(p.num_label_tokens for p in parts) == full.num_label_tokens
        for p, n in zip(parts, shards.sizes):
            assert p.segments == full.segments and p.num_tokens == max(n, 1)
            if n == 0:  # one pad token: id 0, position 0, no label
                assert p.input_ids.tolist() == [[0]] and p.position_ids.tolist() == [[0]]
                assert p.labels.tolist() == [[-100]]
