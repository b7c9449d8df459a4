"""Attention backends take the head-sharded problem of a sequence-parallel rank unchanged.

Each SP rank hands its backend an ``AttentionSegments`` with its own query heads (6 or 7 of
LLaMA-30B's 52 at sp 8, one of 4 at sp 4...) and the K/V heads they use (replicated GQA heads, or
one per query head where a rank straddles a GQA group).  The CUDA backends' packing
(``attention_cuda.run_kernel``) is checked here on CPU in float64 with SDPA-built stand-ins for
torch's varlen kernel (grouped K/V heads, and the older signature that needs them expanded) against
the SDPA backend, for every rank's shapes of several layouts; the fused kernels themselves are
checked the same way in ``tests/gpu/test_sp_attention_cuda.py``.
"""
import pytest
import torch

from infinipipe_hf.runtime.attention import varlen as ac
from infinipipe_hf.runtime.attention.sdpa import sdpa_backend
from infinipipe_hf.runtime.attention.types import AttentionSegments
from infinipipe_hf.runtime.parallel.sp_shards import head_shards
from tests.helpers.varlen_reference import sdpa_varlen_attn, sdpa_varlen_attn_torch29

D = 8
# (query heads, K/V heads, sp_degree): uneven MHA, GQA replicated, GQA straddling groups.
LAYOUTS = [(52, 52, 8), (4, 2, 4), (28, 4, 8), (10, 5, 4), (32, 8, 3)]


def rank_problems(heads, kv_heads, sp, device="cpu", dtype=torch.float64, seed=0):
    """One problem per SP rank, shaped as ``epp_attention_forward`` builds it on that rank."""
    g = torch.Generator(device=device).manual_seed(seed)
    lengths, contexts = [9, 4, 3], [11, 0, 0]  # a slice with context, then a packed pair
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    out = []
    for s in head_shards(heads, kv_heads, sp):
        kv = s.num_kv if s.expand is None else s.num_q  # expanded: one K/V per query head
        mk = lambda h, n: torch.randn(1, h, n, D, device=device, dtype=dtype, generator=g).requires_grad_(True)
        q = mk(s.num_q, offsets[-1])
        keys = [mk(kv, c + n) for n, c in zip(lengths, contexts)]
        values = [mk(kv, c + n) for n, c in zip(lengths, contexts)]
        out.append(AttentionSegments(q, keys, values, tuple(offsets), list(contexts), D ** -0.5, 0.0, None))
    return out


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("heads,kv_heads,sp", LAYOUTS)
def test_run_kernel_on_every_rank_shape_equals_sdpa(heads, kv_heads, sp, grouped):
    for a in rank_problems(heads, kv_heads, sp):
        want = sdpa_backend(a)
        kernel = ac.torch_varlen_kernel(sdpa_varlen_attn if grouped else sdpa_varlen_attn_torch29)
        assert kernel.grouped is grouped
        got = ac.run_kernel(a, kernel)
        assert got.shape == want.shape == (1, a.q_offsets[-1], a.query.shape[1], D)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        g = torch.randn_like(want)
        params = [a.query, *a.keys, *a.values]
        for x, y in zip(torch.autograd.grad(got, params, g), torch.autograd.grad(want, params, g)):
            torch.testing.assert_close(x, y, rtol=1e-11, atol=1e-11)
