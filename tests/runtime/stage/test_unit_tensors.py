"""Unit tensors: labels shifted on the whole sequence, positions, cu_seqlens; chunked loss."""
import pytest
import torch
import torch.nn.functional as F

from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.runtime.stage.loss import chunked_lm_loss
from infinipipe_hf.runtime.stage.unit_tensors import build_unit_tensors, label_token_count
from tests.helpers import reference


def test_slice_labels_cross_the_cut_and_positions_continue():
    batch = [{"input_ids": list(range(100, 110))}, {"input_ids": torch.tensor([7, 8, 9])}]
    t = build_unit_tensors(Unit(4, (Segment(0, 6, 10), Segment(1, 0, 3))), batch)
    assert t.unit_id == 4 and t.num_tokens == 7
    assert t.input_ids.tolist() == [[106, 107, 108, 109, 7, 8, 9]]
    assert t.position_ids.tolist() == [[6, 7, 8, 9, 0, 1, 2]]
    assert t.labels.tolist() == [[107, 108, 109, -100, 8, 9, -100]]
    assert t.cu_seqlens_q.tolist() == [0, 4, 7] and t.cu_seqlens_k.tolist() == [0, 10, 13]
    assert t.num_label_tokens == 5
    first = build_unit_tensors(Unit(0, (Segment(0, 0, 6),)), batch)
    assert first.labels.tolist() == [[101, 102, 103, 104, 105, 106]]  # last token predicts the next slice


def test_user_labels_respected():
    batch = [{"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]}]
    t = build_unit_tensors(Unit(0, (Segment(0, 0, 4),)), batch)
    assert t.labels.tolist() == [[-100, 3, 4, -100]]
    assert label_token_count(batch) == 2


def test_label_count_matches_reference_helper():
    batch = reference.random_batch([5, 9, 1, 12], with_labels=True, seed=3)
    assert label_token_count(batch) == reference.label_token_count(batch)


@pytest.mark.parametrize("bad,match", [
    (Unit(0, (Segment(2, 0, 1),)), "sequence 2 but the batch has 1"),
    (Unit(0, (Segment(0, 0, 9),)), "ends past sequence 0's 4 tokens"),
    (Unit(0, (Segment(0, 0, 2), Segment(0, 2, 4))), "two segments of sequence 0"),
])
def test_plan_batch_mismatch_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        build_unit_tensors(bad, [{"input_ids": [1, 2, 3, 4]}])


def test_labels_length_mismatch():
    with pytest.raises(ValueError, match="labels have 2 tokens but input_ids 3"):
        label_token_count([{"input_ids": [1, 2, 3], "labels": [1, 2]}])


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_chunked_loss_equals_full_cross_entropy(chunk):
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(6, 11, bias=False).double()
    h = torch.randn(1, 9, 6, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, 11, (1, 9), generator=g)
    y[0, [2, 8]] = -100
    want = F.cross_entropy(head(h)[0], y[0], ignore_index=-100, reduction="sum") / 17
    gw = torch.autograd.grad(want, (h, head.weight))
    got = chunked_lm_loss(head, h, y, 17, chunk)
    gg = torch.autograd.grad(got, (h, head.weight))
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
    for a, b in zip(gg, gw):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)


def test_chunked_loss_without_labels_is_zero_with_graph():
    head = torch.nn.Linear(4, 5)
    h = torch.randn(1, 3, 4, requires_grad=True)
    loss = chunked_lm_loss(head, h, torch.full((1, 3), -100), 10)
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(h.grad) == 0
    with pytest.raises(ValueError, match="label_token_count must be >= 1"):
        chunked_lm_loss(head, h, torch.zeros(1, 3, dtype=torch.long), 0)


def test_a_step_converts_each_sequence_once_and_builds_the_same_tensors(monkeypatch):
    from infinipipe_hf.runtime.stage import unit_tensors as ut

    batch = [{"input_ids": list(range(100, 120)), "labels": list(range(20))}, {"input_ids": [7, 8, 9]}]
    units = [Unit(0, (Segment(0, 0, 8),)), Unit(1, (Segment(0, 8, 16),)), Unit(2, (Segment(0, 16, 20), Segment(1, 0, 3)))]
    fresh = [build_unit_tensors(u, batch) for u in units]
    calls = []
    real = ut._as_long
    monkeypatch.setattr(ut, "_as_long", lambda x, what, i: calls.append((what, i)) or real(x, what, i))
    cache = ut.SequenceCache(batch)
    cached = [build_unit_tensors(u, batch, cache) for u in units]
    # ids and labels of sequence 0 once for its three slices, not once per unit
    assert sorted(calls) == [("input_ids", 0), ("input_ids", 1), ("labels", 0)]
    for a, b in zip(fresh, cached):
        for name in ("input_ids", "position_ids", "labels", "cu_seqlens_q", "cu_seqlens_k"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert (a.segments, a.num_label_tokens) == (b.segments, b.num_label_tokens)


def test_moving_to_a_device_keeps_the_offsets_on_the_host():
    t = build_unit_tensors(Unit(0, (Segment(0, 2, 6),)), [{"input_ids": list(range(10))}])
    moved = t.to(torch.device("meta"))
    assert moved.input_ids.device.type == moved.labels.device.type == moved.position_ids.device.type == "meta"
    assert moved.cu_seqlens_q is t.cu_seqlens_q and moved.cu_seqlens_k.device.type == "cpu"
    assert t.to("cpu").input_ids is t.input_ids  # already there: no copy


def test_label_positions_are_found_on_the_host_and_give_the_same_loss():
    batch = [{"input_ids": [1, 2, 3, 4, 5, 6], "labels": [1, -100, -100, 4, 5, 6]}, {"input_ids": [7, 8]}]
    t = build_unit_tensors(Unit(0, (Segment(0, 0, 6), Segment(1, 0, 2))), batch)
    assert t.label_index.tolist() == [2, 3, 4, 6]  # shifted: [-100, -100, 4, 5, 6, -100, 8, -100]
    shard = t.shard(2, 6, 4)
    assert shard.label_index.tolist() == [0, 1, 2] and shard.num_label_tokens == 3
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(4, 9, bias=False).double()
    hidden = torch.randn(1, 8, 4, generator=g, dtype=torch.float64)
    want = chunked_lm_loss(head, hidden, t.labels, 4, 2)
    got = chunked_lm_loss(head, hidden, t.labels, 4, 2, label_index=t.label_index)
    assert torch.equal(got, want)
