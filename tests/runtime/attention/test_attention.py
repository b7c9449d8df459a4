"""Slice attention with a KV store equals causal attention of the unsplit sequence."""
import pytest
import torch
import torch.nn.functional as F

from infinipipe_hf.ir.units import Segment
from infinipipe_hf.runtime.attention.hf import epp_attention_forward
from infinipipe_hf.runtime.attention.kv_store import KVStore
from infinipipe_hf.runtime.attention.sdpa import sdpa_backend
from infinipipe_hf.runtime.attention.select import select_backend
from infinipipe_hf.runtime.attention.types import EPPUnitContext, segment_mask

H, KV, D = 4, 2, 8


class _Layer:
    layer_idx = 3


def _reference(q, k, v):
    k = k.repeat_interleave(H // KV, dim=1)
    v = v.repeat_interleave(H // KV, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


def _qkv(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda h: torch.randn(1, h, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    return mk(H), mk(KV), mk(KV)


def _ctx(segments, total_len, store, unit_id=0):
    offsets = [0]
    for s in segments:
        offsets.append(offsets[-1] + s.length)
    cont = tuple(s.end < total_len[s.seq] for s in segments)
    return EPPUnitContext(unit_id, tuple(segments), tuple(offsets), cont, store, sdpa_backend)


@pytest.mark.parametrize("cuts", [(7, 16), (1, 2), (11, 12)])
def test_slices_with_context_equal_full_causal_forward_and_grad(cuts):
    T = 20
    q, k, v = _qkv(T)
    g_out = torch.randn(1, T, H, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = _reference(q, k, v)
    want_grads = torch.autograd.grad(want, (q, k, v), g_out)

    store = KVStore()
    bounds = [0, *cuts, T]
    outs = []
    for i in range(3):
        a, b = bounds[i], bounds[i + 1]
        ctx = _ctx([Segment(0, a, b)], [T], store, unit_id=i)
        out, w = epp_attention_forward(_Layer(), q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], None,
                                       scaling=D ** -0.5, epp_unit=ctx)
        assert w is None and out.shape == (1, b - a, H, D)
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=1), want, rtol=1e-12, atol=1e-12)
    for i in (2, 1, 0):  # backward of the last slice first, as the schedule guarantees
        a, b = bounds[i], bounds[i + 1]
        outs[i].backward(g_out[:, a:b])
    for got, exp in zip((q.grad, k.grad, v.grad), want_grads):
        torch.testing.assert_close(got, exp, rtol=1e-12, atol=1e-12)
    assert len(store) == 2  # the two slices that continue stored their K/V


def test_first_slice_receives_kv_grads_from_later_slice():
    """dK of the first slice includes what the later slice sends back through the store."""
    T = 12
    q, k, v = _qkv(T, seed=3)
    g_out = torch.ones(1, T, H, D, dtype=torch.float64)
    want = torch.autograd.grad(_reference(q, k, v), (k,), g_out)[0]
    store = KVStore()
    o0, _ = epp_attention_forward(_Layer(), q[:, :, :5], k[:, :, :5], v[:, :, :5], None,
                                  epp_unit=_ctx([Segment(0, 0, 5)], [T], store))
    o1, _ = epp_attention_forward(_Layer(), q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], None,
                                  epp_unit=_ctx([Segment(0, 5, T)], [T], store, 1))
    o1.backward(g_out[:, 5:])
    o0.backward(g_out[:, :5])
    torch.testing.assert_close(k.grad, want, rtol=1e-12, atol=1e-12)
    # The context leaves did receive gradient from the later slice.
    leaf = store._entries[(3, 0)][0].k
    assert leaf.grad is not None and leaf.grad.abs().sum() > 0


def test_packed_segments_do_not_attend_to_each_other():
    q, k, v = _qkv(15, seed=5)
    store = KVStore()
    segs = [Segment(0, 0, 6), Segment(1, 0, 9)]
    out, _ = epp_attention_forward(_Layer(), q, k, v, None, epp_unit=_ctx(segs, [6, 9], store))
    want = torch.cat([_reference(q[:, :, :6], k[:, :, :6], v[:, :, :6]),
                      _reference(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:])], dim=1)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert len(store) == 0  # whole sequences store nothing


def test_hybrid_unit_tail_slice_plus_short_sequence():
    T = 14
    q, k, v = _qkv(T + 4, seed=7)
    store = KVStore()
    epp_attention_forward(_Layer(), q[:, :, :8], k[:, :, :8], v[:, :, :8], None,
                          epp_unit=_ctx([Segment(0, 0, 8)], [T, 4], store))
    segs = [Segment(0, 8, T), Segment(1, 0, 4)]
    out, _ = epp_attention_forward(_Layer(), q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], None,
                                   epp_unit=_ctx(segs, [T, 4], store, 1))
    want_tail = _reference(q[:, :, :T], k[:, :, :T], v[:, :, :T])[:, 8:]
    want_short = _reference(q[:, :, T:], k[:, :, T:], v[:, :, T:])
    torch.testing.assert_close(out, torch.cat([want_tail, want_short], dim=1), rtol=1e-12, atol=1e-12)


def test_mask_is_lower_right_aligned_with_window():
    m = segment_mask(3, 4, None, "cpu")
    assert m.tolist() == [[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0], [1] * 7]
    w = segment_mask(2, 3, 2, "cpu")  # query abs pos 3 sees keys 2,3; pos 4 sees 3,4
    assert w.tolist() == [[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]


def test_context_missing_is_a_clear_error():
    q, k, v = _qkv(4)
    with pytest.raises(RuntimeError, match="needs \\[0, 6\\)"):
        epp_attention_forward(_Layer(), q, k, v, None, epp_unit=_ctx([Segment(0, 6, 10)], [10], KVStore()))


def test_put_is_idempotent_and_keeps_grads():
    store = KVStore()
    k = torch.randn(1, KV, 3, D)
    e1 = store.put(0, 0, 0, 3, k, k)
    e1.k.grad = torch.ones_like(e1.k)
    e2 = store.put(0, 0, 0, 3, k * 2, k * 2)
    assert e2 is e1 and e2.k.grad is not None
    assert store.bytes() == 3 * k.numel() * k.element_size()
    store.free_sequence(0)
    assert len(store) == 0 and store.bytes() == 0


def test_select_backend():
    assert select_backend("auto", "cpu") is sdpa_backend
    assert select_backend("sdpa", "cpu") is sdpa_backend
    with pytest.raises(ValueError, match="attention_backend='flash'"):
        select_backend("flash", "cpu")


def test_outside_a_stage_is_an_error():
    q, k, v = _qkv(4)
    with pytest.raises(RuntimeError, match="epp_unit"):
        epp_attention_forward(_Layer(), q, k, v, None)


def test_cpu_profiles_count_context_slices_as_sdpa_runs_them():
    """On CPU only SDPA trains, and it runs a slice with context through an explicit mask."""
    from infinipipe_hf.runtime.attention.select import context_pairs

    assert context_pairs("cpu") == "rectangle"
