"""Synthetic length distributions reproduce the published figures they stand for, for every seed."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infinipipe_hf.data.synthetic import long_tailed_batch, prolong_like, short_only, slimpajama_like

seeds = st.integers(min_value=0, max_value=2**32 - 1)


@settings(max_examples=25, deadline=None)
@given(seed=seeds, n=st.integers(min_value=50, max_value=1000))
def test_slimpajama_like_has_30_percent_long_documents_and_a_heavy_tail(seed, n):
    lengths = np.array(slimpajama_like(n=n, seed=seed))
    assert len(lengths) == n
    assert lengths.min() >= 1 and lengths.max() <= 131072
    assert abs((lengths > 4096).mean() - 0.30) <= 0.5 / n + 1e-9
    # Heavy tail: the longest documents are an order of magnitude above the median (a sample of
    # under 100 documents can miss the tail: 21 of 3000 seeds at n=50, none of 3000 at n=100).
    if n >= 100:
        assert lengths.max() > 8 * np.median(lengths)


def test_slimpajama_like_tokens_mostly_in_documents_under_64k():
    # Meta's 128K job: documents under 64K carry more than 75% of the tokens.
    lengths = np.array(slimpajama_like(n=4096, seed=3))
    assert lengths[lengths < 65536].sum() / lengths.sum() > 0.75


@settings(max_examples=25, deadline=None)
@given(seed=seeds, n=st.integers(min_value=200, max_value=1000))
def test_prolong_like_has_60_percent_of_tokens_in_64k_documents(seed, n):
    lengths = np.array(prolong_like(n=n, seed=seed))
    assert len(lengths) == n and lengths.max() <= 131072
    share = lengths[lengths >= 65536].sum() / lengths.sum()
    assert 0.55 <= share <= 0.65
    # Most documents are still short: the long ones are few.
    assert (lengths >= 65536).mean() < 0.2


@settings(max_examples=25, deadline=None)
@given(seed=seeds, max_len=st.integers(min_value=64, max_value=8192))
def test_short_only_respects_max_len(seed, max_len):
    lengths = short_only(n=300, max_len=max_len, seed=seed)
    assert len(lengths) == 300 and all(16 <= x <= max_len for x in lengths)
    assert len(set(lengths)) > 10


@pytest.mark.parametrize("fn", [slimpajama_like, prolong_like, short_only])
def test_generators_are_deterministic_and_seed_dependent(fn):
    assert fn(seed=7) == fn(seed=7)
    assert fn(seed=7) != fn(seed=8)
    assert all(isinstance(x, int) for x in fn(seed=7))


@settings(max_examples=50, deadline=None)
@given(seed=seeds, budget=st.integers(min_value=1000, max_value=2_000_000))
def test_long_tailed_batch_fills_but_never_exceeds_the_budget(seed, budget):
    pool = slimpajama_like(n=512, seed=1)
    batch = long_tailed_batch(pool, budget, seed=seed)
    assert batch and sum(batch) <= budget
    # Drawn without replacement from the pool.
    remaining = list(pool)
    for x in batch:
        remaining.remove(x)
    # Nothing left in the pool would still fit (the batch is as full as the pool allows).
    assert not any(x <= budget - sum(batch) for x in remaining)
    assert long_tailed_batch(pool, budget, seed=seed) == batch


def test_user_errors_are_value_errors():
    with pytest.raises(ValueError, match="max_len"):
        slimpajama_like(max_len=4096)
    with pytest.raises(ValueError, match="max_len"):
        prolong_like(max_len=32768)
    with pytest.raises(ValueError, match="n must"):
        short_only(n=0)
    with pytest.raises(ValueError, match="no document fits"):
        long_tailed_batch([5000, 6000], token_budget=4000)
    with pytest.raises(ValueError, match="empty"):
        long_tailed_batch([], token_budget=4000)
