"""The token-budget sampler under data parallelism: every step feeds every replica, long pieces
are one replica's work, every token once per epoch, the step count fixed across epochs."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infinipipe_hf.trainer.batches.sampler import TokenBudgetBatchSampler, group_replica_batches


def _check_epochs(sampler: TokenBudgetBatchSampler, lengths: list[int], epochs=(0, 1, 2)) -> None:
    for epoch in epochs:
        batches = sampler.batches(epoch)
        assert len(batches) == len(sampler)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        for b in batches:
            assert len(b) >= min(sampler.dp_degree, len(lengths)), (epoch, b)


@pytest.mark.filterwarnings("ignore:.*idle every step")
@settings(max_examples=120, deadline=None)
@given(lengths=st.lists(st.one_of(st.integers(2, 100), st.integers(2, 1024)), min_size=1, max_size=60),
       dp=st.integers(1, 8), seed=st.integers(0, 3))
def test_every_step_feeds_every_replica_and_every_piece_trains_once(lengths, dp, seed):
    sampler = TokenBudgetBatchSampler(lengths, 1024, dp_degree=dp, seed=seed)
    _check_epochs(sampler, lengths)
    share = 1024 // dp
    over = []
    for b in sampler.batches(0):
        # a replica batch holds one share, or one piece longer than a share alone
        long = [lengths[i] for i in b if lengths[i] > share]
        if sum(lengths[i] for i in b) > sum(long) + max(dp - len(long), 0) * share:
            over.append(b)
    assert len(over) <= 1, over  # only the step the epoch's last pieces joined


def test_long_documents_are_one_replica_each():
    # long-document data: every piece is longer than a replica's share of 1024 // 2
    lengths = [1000, 900, 800, 700, 600, 550]
    sampler = TokenBudgetBatchSampler(lengths, 1024, dp_degree=2, seed=0)
    batches = sampler.batches(0)
    assert len(batches) == 3 and all(len(b) == 2 for b in batches)
    # steps pair pieces of similar size, so the replicas finish together
    assert sorted(sorted(lengths[i] for i in b) for b in batches) == [[550, 600], [700, 800], [900, 1000]]


def test_dp1_is_the_plain_token_budget_packing():
    lengths = [5, 7, 3, 9, 2, 6]
    one = TokenBudgetBatchSampler(lengths, 12, seed=1)
    assert all(sum(lengths[i] for i in b) <= 12 for b in one.batches(0))
    _check_epochs(one, lengths)


def test_short_pieces_fill_each_replica_share():
    lengths = [100] * 40
    sampler = TokenBudgetBatchSampler(lengths, 1000, dp_degree=2, seed=0)
    assert len(sampler) == 4  # 8 replica batches of 5 pieces (500 tokens), 2 per step
    assert all(sum(lengths[i] for i in b) == 1000 for b in sampler.batches(0))


def test_last_step_short_of_replicas_is_redealt_or_joins_the_step_before():
    lengths = [10, 10, 10, 10]
    assert group_replica_batches([[0], [1], [2, 3]], lengths, 2) == [[0, 1], [2, 3]]
    # the last group has one replica batch of two pieces: redealt over both replicas
    assert group_replica_batches([[0], [1], [2, 3]], [10, 10, 6, 4], 2) == [[0, 1], [2, 3]]
    # the last group has one piece: it joins the group before
    assert group_replica_batches([[0], [1], [2]], lengths, 2) == [[0, 1, 2]]
    # a single short group keeps what it has
    assert group_replica_batches([[0]], lengths, 2) == [[0]]


def test_fewer_pieces_than_replicas_warns_and_keeps_every_piece():
    with pytest.warns(UserWarning, match="1 replica.* idle every step"):
        sampler = TokenBudgetBatchSampler([50], 1024, dp_degree=2)
    assert sampler.batches(0) == [[0]]


def test_step_count_is_the_same_every_epoch_with_many_ties():
    lengths = [300, 300, 300, 200, 200, 100, 100, 100, 100, 30, 30, 30, 1000, 999]
    sampler = TokenBudgetBatchSampler(lengths, 1024, dp_degree=4, seed=5)
    _check_epochs(sampler, lengths, epochs=range(12))


@pytest.mark.parametrize("tokens, dp, match", [
    (3, 2, "gives each of the dp_degree=2 replicas 1 token"),
    (1024, 0, "dp_degree must be a positive integer"),
])
def test_user_errors(tokens, dp, match):
    with pytest.raises(ValueError, match=match):
        TokenBudgetBatchSampler([2, 2], tokens, dp_degree=dp)
