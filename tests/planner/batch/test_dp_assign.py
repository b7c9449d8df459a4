"""DP assignment: every sequence once, replicas balanced by estimated time, deterministic."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.batch.dp_assign import assign_sequences, idle_replicas, replica_loads, sequence_cost
from infinipipe_hf.planner.batch.layer_time import LayerTime
from infinipipe_hf.planner.cost.model import CostModel

LLAMA3_8B = dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
COST = CostModel(ModelSpec.from_config_dict(LLAMA3_8B), dims=ParallelDims(pp_degree=4))
LT = LayerTime.of(COST)


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.one_of(st.integers(1, 5000), st.integers(1, 300_000)), min_size=1, max_size=80),
       dp=st.integers(1, 8))
def test_coverage_order_and_greedy_balance(lengths, dp):
    reps = assign_sequences(lengths, dp, COST)
    assert len(reps) == dp
    # every replica has work while there are sequences for it; the rest idle
    assert sum(1 for r in reps if not r) == idle_replicas(len(lengths), ParallelDims(dp_degree=dp)) == max(dp - len(lengths), 0)
    assert sorted(s for r in reps for s in r) == list(range(len(lengths)))
    for r in reps:
        assert r == sorted(r, key=lambda s: (-lengths[s], s))
    loads = replica_loads(lengths, reps, COST)
    costs = [sequence_cost(n, LT) for n in lengths]
    # greedy invariant: each replica got its last (cheapest) sequence while it was the least loaded
    for r, seqs in enumerate(reps):
        if seqs:
            before = loads[r] - costs[seqs[-1]]
            assert all(before <= loads[o] * (1 + 1e-9) for o in range(dp) if o != r)
    # hence the list-scheduling bound
    assert max(loads) <= (sum(costs) / dp + max(costs)) * (1 + 1e-9)
    assert assign_sequences(lengths, dp, COST) == reps


def test_balances_time_not_tokens():
    # 2 x 40K tokens weigh more than 80K... no: attention makes one 80K sequence dearer than two 40K
    lengths = [80_000, 40_000, 40_000, 30_000, 10_000]
    reps = assign_sequences(lengths, 2, COST)
    assert reps[0][0] == 0 and set(reps[1]) >= {1, 2}
    loads = replica_loads(lengths, reps, COST)
    assert max(loads) / min(loads) < 1.3


def test_single_replica_gets_all_longest_first():
    assert assign_sequences([3, 9, 9, 1], 1, COST) == [[1, 2, 0, 3]]


def test_ties_are_deterministic_by_seq_id():
    assert assign_sequences([100] * 4, 2, COST) == [[0, 2], [1, 3]]


def test_fewer_sequences_than_replicas_leave_the_last_replicas_idle():
    assert assign_sequences([10, 30], 4, COST) == [[1], [0], [], []]


@pytest.mark.parametrize("lengths, dp, match", [
    ([10, 20], 0, "dp_degree"),
    ([10, 0], 1, "at least 1 token"),
])
def test_user_errors(lengths, dp, match):
    with pytest.raises(ValueError, match=match):
        assign_sequences(lengths, dp, COST)
