"""The CUDA attention backends' packing logic, checked on CPU with a pure-PyTorch varlen kernel.

The fused kernels themselves need a GPU (tests/gpu/test_attention_cuda.py); everything around
them (cu_seqlens, key concatenation with context, head grouping, output layout, the self-check
that rejects a wrongly aligned causal mask, the SDPA fallbacks) is tested here in float64.
"""
import pytest
import torch
import torch.nn.functional as F

from infinipipe_hf.planner.units import Segment
from infinipipe_hf.runtime import attention_cuda as ac
from infinipipe_hf.runtime.attention import (AttentionSegments, EPPUnitContext, epp_attention_forward,
                                             sdpa_backend, select_backend)
from infinipipe_hf.runtime.kv_store import KVStore

H, KV, D = 4, 2, 8


def _problem(lengths, contexts, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    q = torch.randn(1, H, offsets[-1], D, dtype=dtype, generator=g, requires_grad=True)
    keys = [torch.randn(1, KV, c + n, D, dtype=dtype, generator=g, requires_grad=True)
            for n, c in zip(lengths, contexts)]
    values = [torch.randn(1, KV, c + n, D, dtype=dtype, generator=g, requires_grad=True)
              for n, c in zip(lengths, contexts)]
    return AttentionSegments(q, keys, values, tuple(offsets), list(contexts), D ** -0.5, 0.0, None)


def _grads(a, out, g_out):
    return torch.autograd.grad(out, [a.query, *a.keys, *a.values], g_out)


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("lengths,contexts", [([5, 9, 3], [0, 0, 0]), ([6], [11]), ([4, 7, 2], [13, 0, 0])])
def test_packed_kernel_equals_sdpa_forward_and_grad(lengths, contexts, grouped):
    a = _problem(lengths, contexts)
    want = sdpa_backend(a)
    got = ac.run_kernel(a, ac.reference_kernel, grouped)
    assert got.shape == want.shape == (1, sum(lengths), H, D)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g_out = torch.randn_like(want)
    for x, y in zip(_grads(a, got, g_out), _grads(a, want, g_out)):
        torch.testing.assert_close(x, y, rtol=1e-11, atol=1e-11)


def _upper_left_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, grouped):
    cq, ck = cu_q.tolist(), cu_k.tolist()
    outs = []
    for i in range(len(cq) - 1):
        qs = q[cq[i]:cq[i + 1]].transpose(0, 1)
        ks, vs = (t[ck[i]:ck[i + 1]].transpose(0, 1).repeat_interleave(H // KV, dim=0) for t in (k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(outs)


def test_self_check_accepts_lower_right_and_rejects_upper_left():
    assert ac._self_check(ac.reference_kernel, torch.device("cpu"), torch.float32) == (True, True)
    assert ac._self_check(_upper_left_kernel, torch.device("cpu"), torch.float32)[0] is False


def test_slices_through_kv_store_with_packed_kernel_equal_unsplit_causal():
    """The attention function + KV store + packed kernel: three slices of one sequence, the middle
    one packed with a short document, equal the unsplit causal attention (values and grads)."""
    T, S = 20, 6
    g = torch.Generator().manual_seed(3)
    mk = lambda h, n: torch.randn(1, h, n, D, dtype=torch.float64, generator=g, requires_grad=True)
    q, k, v = mk(H, T), mk(KV, T), mk(KV, T)
    q2, k2, v2 = mk(H, S), mk(KV, S), mk(KV, S)

    def ref(q, k, v):
        k, v = (t.repeat_interleave(H // KV, dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

    want, want2 = ref(q, k, v), ref(q2, k2, v2)
    backend = lambda a: ac.run_kernel(a, ac.reference_kernel, True)

    class Layer:
        layer_idx = 0

    store = KVStore()
    units = [[Segment(0, 0, 7)], [Segment(0, 7, 15), Segment(1, 0, S)], [Segment(0, 15, T)]]
    outs = []
    for uid, segs in enumerate(units):
        offs, qs, ks, vs = [0], [], [], []
        for s in segs:
            src = (q, k, v) if s.seq == 0 else (q2, k2, v2)
            qs.append(src[0][:, :, s.start:s.end])
            ks.append(src[1][:, :, s.start:s.end])
            vs.append(src[2][:, :, s.start:s.end])
            offs.append(offs[-1] + s.length)
        ctx = EPPUnitContext(uid, tuple(segs), tuple(offs), tuple(s.seq == 0 and s.end < T for s in segs),
                             store, backend)
        out, _ = epp_attention_forward(Layer(), torch.cat(qs, 2), torch.cat(ks, 2), torch.cat(vs, 2), None,
                                       scaling=D ** -0.5, epp_unit=ctx)
        outs.append(out)
    got = torch.cat([outs[0], outs[1][:, :8], outs[2]], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(outs[1][:, 8:], want2, rtol=1e-12, atol=1e-12)
    g_out = torch.randn(1, T, H, D, dtype=torch.float64, generator=g)
    g2 = torch.randn(1, S, H, D, dtype=torch.float64, generator=g)
    exp = torch.autograd.grad((want, want2), (q, k, v, q2, k2, v2), (g_out, g2))
    outs[2].backward(g_out[:, 15:])  # last slice first, as the schedule guarantees
    outs[1].backward(torch.cat([g_out[:, 7:15], g2], dim=1))
    outs[0].backward(g_out[:, :7])
    for got_g, exp_g in zip((q.grad, k.grad, v.grad, q2.grad, k2.grad, v2.grad), exp):
        torch.testing.assert_close(got_g, exp_g, rtol=1e-11, atol=1e-11)


def test_kernel_guards_fall_back_to_sdpa():
    a = _problem([5, 3], [2, 0], dtype=torch.float32)
    assert not ac.kernel_can_run(a)  # CPU, float32
    calls = []
    backend = ac.make_backend(lambda *args: calls.append(1), "spy", check=False)
    torch.testing.assert_close(backend(a), sdpa_backend(a))
    assert calls == []  # the kernel never ran on a problem it cannot compute


def test_cu_seqlens_are_cached_and_correct():
    cu_q, cu_k = ac.cu_seqlens((0, 5, 8), (7, 3), torch.device("cpu"))
    assert cu_q.tolist() == [0, 5, 8] and cu_k.tolist() == [0, 7, 10] and cu_q.dtype == torch.int32
    again = ac.cu_seqlens((0, 5, 8), (7, 3), torch.device("cpu"))
    assert again[0] is cu_q and again[1] is cu_k


def test_backend_selection_on_cpu():
    assert select_backend("auto", "cpu") is sdpa_backend
    for name in ("varlen", "flash"):
        with pytest.raises(ValueError, match="cannot run on device cpu|not available"):
            select_backend(name, "cpu")
