"""The CUDA attention backends on CPU: everything but the fused kernel call, against SDPA.

The kernels are replaced by SDPA-built functions with their exact signatures
(``tests/helpers/varlen_reference.py``), so the real argument construction (``window_size`` vs
``is_causal``, ``enable_gqa``, flash-attn's keywords), ``cu_seqlens``/``max_seqlen``, the head
layout (grouped or expanded K/V), context handling, the self-check, the backend's fallbacks and
the backend selection all run here, in float64, compared with the SDPA backend (values and
gradients).  Left to tests/gpu/test_attention_cuda.py: the fused kernels themselves and the
pinned host-to-device copy of ``cu_seqlens`` (both need CUDA).
"""
import warnings

import pytest
import torch

from infinipipe_hf.ir.units import Segment
from infinipipe_hf.runtime.attention import select as attn
from infinipipe_hf.runtime.attention import varlen as ac
from infinipipe_hf.runtime.attention.hf import epp_attention_forward
from infinipipe_hf.runtime.attention.kv_store import KVStore
from infinipipe_hf.runtime.attention.sdpa import sdpa_backend
from infinipipe_hf.runtime.attention.select import select_backend
from infinipipe_hf.runtime.attention.types import AttentionSegments, EPPUnitContext
from tests.helpers.varlen_reference import (
    sdpa_flash_attn_varlen_func,
    sdpa_varlen_attn,
    sdpa_varlen_attn_torch29,
    upper_left_varlen_attn,
)

H, KV, D = 4, 2, 8
CPU64 = dict(device_types=("cpu",), dtypes=(torch.float64,))
KERNELS = {
    "varlen": lambda: ac.torch_varlen_kernel(sdpa_varlen_attn),
    "varlen_torch29": lambda: ac.torch_varlen_kernel(sdpa_varlen_attn_torch29),
    "flash": lambda: ac.flash_attn_kernel(sdpa_flash_attn_varlen_func),
}
PROBLEMS = {"packed": ([5, 9, 3], [0, 0, 0]), "slice_with_context": ([6], [11]),
            "hybrid": ([4, 7, 2], [13, 0, 0]), "tiny_slices": ([1, 3], [17, 2])}


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


def test_kernel_signatures_decide_causality_and_grouped_heads():
    assert ac.torch_varlen_kernel(sdpa_varlen_attn).grouped is True
    assert ac.torch_varlen_kernel(sdpa_varlen_attn_torch29).grouped is False  # K/V heads expanded
    assert ac.flash_attn_kernel(sdpa_flash_attn_varlen_func).grouped is True
    # the installed torch's own varlen_attn (its call needs CUDA; its signature does not)
    assert ac.torch_varlen_kernel().grouped is True
    with pytest.raises(ImportError):
        ac.flash_attn_kernel()  # flash-attn is not installed on the CPU machine


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_backend_equals_sdpa_forward_and_grad(name, problem):
    """The whole backend (guards, self-check, packing, kernel arguments) on CPU, float64."""
    backend = ac.make_backend(name, KERNELS[name], **CPU64)
    a = _problem(*PROBLEMS[problem])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the self-check must pass: no fallback warning
        got = backend(a)
    want = sdpa_backend(a)
    assert got.shape == want.shape == (1, a.q_offsets[-1], H, D)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    g_out = torch.randn_like(want)
    for x, y in zip(_grads(a, got, g_out), _grads(a, want, g_out)):
        torch.testing.assert_close(x, y, rtol=1e-11, atol=1e-11)


def test_self_check_accepts_lower_right_and_rejects_upper_left():
    assert ac.self_check(KERNELS["varlen"](), torch.device("cpu"), torch.float64)
    wrong = ac.torch_varlen_kernel(upper_left_varlen_attn)
    assert not ac.self_check(wrong, torch.device("cpu"), torch.float64)
    backend = ac.make_backend("upper_left", lambda: wrong, **CPU64)
    a = _problem(*PROBLEMS["hybrid"])
    with pytest.warns(RuntimeWarning, match="does not compute lower-right causal attention.*using SDPA"):
        got = backend(a)
    torch.testing.assert_close(got, sdpa_backend(a))  # the fallback is exact


def test_a_kernel_error_propagates_instead_of_disabling_the_backend():
    def broken(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
               enable_gqa=False):
        raise TypeError("bad argument")

    backend = ac.make_backend("broken", lambda: ac.torch_varlen_kernel(broken), **CPU64)
    with pytest.raises(TypeError, match="bad argument"):
        backend(_problem(*PROBLEMS["packed"]))


def test_guards_fall_back_to_sdpa_without_building_the_kernel():
    built = []
    backend = ac.make_backend("spy", lambda: built.append(1), **CPU64)
    a32 = _problem([5, 3], [2, 0], dtype=torch.float32)
    torch.testing.assert_close(backend(a32), sdpa_backend(a32))  # float32: not a kernel dtype here
    a = _problem([5, 3], [2, 0])
    a.dropout = 0.1
    assert not ac.kernel_can_run(a, *CPU64.values())
    a.dropout, a.sliding_window = 0.0, 4  # narrower than the 7 keys of segment 0
    assert not ac.kernel_can_run(a, *CPU64.values())
    a.sliding_window = 7
    assert ac.kernel_can_run(a, *CPU64.values())
    assert not ac.kernel_can_run(_problem([5], [0]))  # defaults: CUDA and half precision only
    assert built == []  # the kernel was never built for a problem it cannot compute


def test_whole_sequences_can_go_to_sdpa_and_the_rest_to_the_kernel():
    calls = []

    def counting_kernel():
        k = KERNELS["varlen"]()
        return ac.VarlenKernel(k.name, lambda *args: calls.append(1) or k.call(*args), k.grouped)

    backend = ac.make_backend("varlen", counting_kernel, whole_sequences_to_sdpa=True, **CPU64)
    whole = _problem([9], [0])
    torch.testing.assert_close(backend(whole), sdpa_backend(whole), rtol=0, atol=0)
    assert calls == [] and ac.whole_causal_sequence(whole)
    for problem in ("packed", "slice_with_context"):
        a = _problem(*PROBLEMS[problem])
        assert not ac.whole_causal_sequence(a)
        torch.testing.assert_close(backend(a), sdpa_backend(a))
    assert len(calls) == 3  # the first call's self-check, then one per unit with several segments or a context
    windowed = _problem([9], [0])
    windowed.sliding_window = 4
    assert not ac.whole_causal_sequence(windowed)


def test_slices_through_kv_store_with_the_varlen_backend_equal_unsplit_causal():
    """The attention function + KV store + backend: three slices of one sequence, the middle one
    packed with a short document, equal the unsplit causal attention (values and grads)."""
    import torch.nn.functional as F

    T, S = 20, 6
    g = torch.Generator().manual_seed(3)
    mk = lambda h, n: torch.randn(1, h, n, D, dtype=torch.float64, generator=g, requires_grad=True)
    q, k, v = mk(H, T), mk(KV, T), mk(KV, T)
    q2, k2, v2 = mk(H, S), mk(KV, S), mk(KV, S)

    def ref(q, k, v):
        k, v = (t.repeat_interleave(H // KV, dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)

    want, want2 = ref(q, k, v), ref(q2, k2, v2)
    backend = ac.make_backend("varlen", KERNELS["varlen"], **CPU64)

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


def test_cu_seqlens_are_cached_and_correct(monkeypatch):
    cu_q, cu_k = ac.cu_seqlens((0, 5, 8), (7, 3), torch.device("cpu"))
    assert cu_q.tolist() == [0, 5, 8] and cu_k.tolist() == [0, 7, 10] and cu_q.dtype == torch.int32
    again = ac.cu_seqlens((0, 5, 8), (7, 3), torch.device("cpu"))
    assert again[0] is cu_q and again[1] is cu_k
    monkeypatch.setattr(ac, "_CU_CACHE_MAX", 1)  # a full cache is emptied, never grows unbounded
    ac.cu_seqlens((0, 2), (4,), torch.device("cpu"))
    assert len(ac._CU_CACHE) == 1


def test_backend_selection(monkeypatch):
    assert select_backend("auto", "cpu") is sdpa_backend
    for name in ("varlen", "flash"):
        with pytest.raises(ValueError, match="cannot run on device cpu"):
            select_backend(name, "cpu")
    cuda = torch.device("cuda")  # selection logic only: nothing runs on the device
    for flash_ok, varlen_ok, want in [(True, True, ac.flash_backend), (False, True, ac.varlen_backend),
                                      (False, False, sdpa_backend)]:
        monkeypatch.setitem(attn._BACKENDS, "flash", (ac.flash_backend, lambda d, ok=flash_ok: ok))
        monkeypatch.setitem(attn._BACKENDS, "varlen", (ac.varlen_backend, lambda d, ok=varlen_ok: ok))
        assert select_backend("auto", cuda) is want


def test_availability_checks(monkeypatch):
    import sys
    import types

    assert not ac.varlen_available(torch.device("cpu")) and not ac.flash_available(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ac.varlen_available(torch.device("cuda"))  # torch ships varlen_attn
    assert not ac.flash_available(torch.device("cuda"))  # flash-attn is not installed here
    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = sdpa_flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    assert ac.flash_available(torch.device("cuda"))
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", None)  # a torch without it
    assert not ac.varlen_available(torch.device("cuda"))
