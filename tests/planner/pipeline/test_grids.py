"""The knob grids: the unit token floors of a few round counts EPP tries with SP rounds."""
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.pipeline.grids import ROUND_COUNTS, round_count_floors


def test_round_count_floors_split_the_fullest_replica_evenly_with_and_without_room_for_any_packing():
    lengths = [1000] * 60 + [2000] * 4  # 68,000 tokens
    replicas = [list(range(0, 64, 2)), list(range(1, 64, 2))]  # 34,000 tokens each
    dims = ParallelDims(1, 4, 2, "sp", 8)
    floors = round_count_floors(lengths, replicas, dims)
    # ceil(34,000 / (4 R)) tokens per rank, and that plus the longest sequence, times the 4 ranks,
    # for the round counts whose split holds the longest sequence (1 to 4: 1,700 tokens at 5).
    even = [-(-34000 // (4 * r)) for r in ROUND_COUNTS]
    assert floors == [f * 4 for e in even[:4] for f in (e, e + 2000)] and even[4] < 2000
    assert all(f % dims.sp_degree == 0 for f in floors)


def test_round_count_floors_only_for_round_counts_whose_split_holds_the_longest_sequence():
    lengths = [9000] + [500] * 30  # 24,000 tokens, one replica
    floors = round_count_floors(lengths, [list(range(31))], ParallelDims(1, 2, 1, "sp", 8))
    # Two rounds or more split it into at most 6,000 tokens a rank, less than the longest
    # sequence: only one round's floors remain (12,000 tokens a rank, and 21,000).
    assert floors == [24000, 42000]
    # 797 tokens on 8 ranks: no round count gives a rank room for the 700-token sequence.
    assert round_count_floors([700, 97], [[0, 1]], ParallelDims(1, 8, 1, "sp", 8)) == []


def test_a_memory_cap_between_a_split_and_the_split_plus_the_longest_is_a_floor_too():
    lengths = [1000] * 60 + [2000] * 4  # 68,000 tokens, one replica on 4 ranks
    dims = ParallelDims(1, 4, 1, "sp", 8)
    plain = round_count_floors(lengths, [list(range(64))], dims)
    # Two rounds split a rank's 17,000 tokens into 8,500; with room for 9,000 a single-GPU unit
    # may be fuller than the split without the longest sequence's slack (10,500).
    capped = round_count_floors(lengths, [list(range(64))], dims, rank_cap=9000)
    assert set(capped) - set(plain) == {9000 * 4}
    # A cap outside every (split, split + longest) interval adds nothing.
    assert round_count_floors(lengths, [list(range(64))], dims, rank_cap=10 ** 6) == plain
    assert round_count_floors(lengths, [list(range(64))], dims, rank_cap=8500) == plain


def test_the_fewest_rounds_a_memory_cap_allows_are_tried_beyond_eight():
    lengths = [500] * 136  # 68,000 tokens, one replica on 4 ranks: 17,000 a rank
    dims = ParallelDims(1, 4, 1, "sp", 8)
    plain = round_count_floors(lengths, [list(range(136))], dims)
    # 1,800 tokens a GPU need 10 rounds (1,700 tokens a rank each), past ROUND_COUNTS' 8 (2,125).
    capped = round_count_floors(lengths, [list(range(136))], dims, rank_cap=1800)
    assert min(plain) == 2125 * 4 and max(ROUND_COUNTS) == 8
    assert {1700 * 4, 1800 * 4, 2200 * 4} <= set(capped) - set(plain)
