"""partition_layers: balance, extras, explicit splits and error messages."""
import pytest

from infinipipe_hf.ir.partition import partition_layers


def _sizes(ranges):
    return [len(r) for r in ranges]


def test_even_split_is_contiguous_and_covers_all_layers():
    ranges = partition_layers(8, 4)
    assert ranges == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]


def test_uneven_layers_differ_by_at_most_one():
    sizes = _sizes(partition_layers(10, 4))
    assert sum(sizes) == 10 and max(sizes) - min(sizes) == 1


def test_extras_move_layers_off_the_end_stages():
    # 32 layers, head costs 2 layers: last stage gets fewer layers, max stage cost is minimal (9).
    sizes = _sizes(partition_layers(32, 4, last_stage_extra=2.0))
    assert sizes[-1] < sizes[1]
    costs = [s + (2.0 if i == 3 else 0.0) for i, s in enumerate(sizes)]
    assert max(costs) == 9
    sizes = _sizes(partition_layers(32, 4, first_stage_extra=3.0, last_stage_extra=3.0))
    assert sizes[0] < sizes[1] and sizes[-1] < sizes[2] and sum(sizes) == 32


def test_every_stage_keeps_one_layer_even_with_huge_extras():
    sizes = _sizes(partition_layers(4, 4, first_stage_extra=100.0, last_stage_extra=100.0))
    assert sizes == [1, 1, 1, 1]


def test_explicit_split_is_used():
    assert partition_layers(6, 3, layer_split=[1, 3, 2]) == [range(0, 1), range(1, 4), range(4, 6)]


def test_pp_degree_too_large_names_both_numbers():
    with pytest.raises(ValueError, match=r"pp_degree=8 exceeds the model's 4 decoder layers; use pp_degree <= 4"):
        partition_layers(4, 8)


@pytest.mark.parametrize("split", [[2, 1], [4, 0], [1, 1, 2], [2, 3]])
def test_bad_split_names_split_and_layer_count(split):
    with pytest.raises(ValueError, match=r"layer_split=\[.*\].* 4 decoder layers"):
        partition_layers(4, 2, layer_split=split)


def test_non_positive_arguments():
    with pytest.raises(ValueError, match="pp_degree"):
        partition_layers(4, 0)
    with pytest.raises(ValueError, match="num_layers"):
        partition_layers(0, 1)
