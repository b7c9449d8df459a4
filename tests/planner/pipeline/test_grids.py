"""The knob grids: the unit token floors of a few round counts EPP tries with SP rounds."""
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.pipeline.grids import ROUND_COUNTS, round_count_floors


def test_round_count_floors_split_the_fullest_replica_evenly_with_and_without_room_for_any_packing():
    lengths = [1000] * 60 + [2000] * 4  # 68,000 tokens
    replicas = [list(range(0, 64, 2)), list(range(1, 64, 2))]  # 34,000 tokens each
    dims = ParallelDims(1, 4, 2, "sp", 8)
    floors = round_count_floors(lengths, replicas, dims)
    # ceil(34,000 / (4 R)) tokens per rank, and that plus the longest sequence, times the 4 ranks.
    even = [-(-34000 // (4 * r)) for r in ROUND_COUNTS]
    assert floors == [f * 4 for e in even for f in (e, e + 2000)]
    assert all(f % dims.sp_degree == 0 for f in floors)


def test_round_count_floors_keep_units_above_the_longest_sequence():
    lengths = [9000] + [500] * 30  # 24,000 tokens, one replica
    floors = round_count_floors(lengths, [list(range(31))], ParallelDims(1, 2, 1, "sp", 8))
    # Even splits of three rounds or more (at most 4,000 tokens per rank) hold no more than the
    # longest sequence and are dropped; with it added per rank every round count is kept (four
    # rounds' 24,000 once: one round's even split is the same floor).
    assert floors == [24000, 42000, 12000, 30000, 26000, 22800, 22000, 21430, 21000]
    # 797 tokens on 8 ranks: one round's even split (100 tokens a rank, rounded up) holds the
    # longest sequence; the others only with it added.
    assert round_count_floors([700, 97], [[0, 1]], ParallelDims(1, 8, 1, "sp", 8)) == [
        800, 6400, 6000, 5872, 5800, 5760, 5736, 5720, 5704]
