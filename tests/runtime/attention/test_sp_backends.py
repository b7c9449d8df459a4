"""Attention backends take the head-sharded problem of a sequence-parallel rank unchanged.

Each SP rank hands its backend an ``AttentionSegments`` with its own query heads (6 or 7 of
LLaMA-30B's 52 at sp 8, one of 4 at sp 4...) and the K/V heads they use (replicated GQA heads, or
one per query head where a rank straddles a GQA group).  The CUDA backends' packing
(``runtime/attention/varlen.py``'s ``run_kernel``) is checked here on CPU in float64 with SDPA-built stand-ins for
torch's varlen kernel (grouped K/V heads, and the older signature that needs them expanded) against
the SDPA backend, for every rank's shapes of several layouts; the fused kernels themselves are
checked the same way in ``tests/gpu/test_sp_attention_cuda.py``.
"""
import pytest
import torch

from infinipipe_hf.runtime.attention import varlen as ac
from infinipipe_hf.runtime.attention.sdpa import sdpa_backend
from tests.helpers.sp_problems import HEAD_DIM, LAYOUTS, rank_problems
from tests.helpers.varlen_reference import sdpa_varlen_attn, sdpa_varlen_attn_torch29


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("heads,kv_heads,sp", LAYOUTS)
def test_run_kernel_on_every_rank_shape_equals_sdpa(heads, kv_heads, sp, grouped):
    for a in rank_problems(heads, kv_heads, sp):
        want = sdpa_backend(a)
        kernel = ac.torch_varlen_kernel(sdpa_varlen_attn if grouped else sdpa_varlen_attn_torch29)
        assert kernel.grouped is grouped
        got = ac.run_kernel(a, kernel)
        assert got.shape == want.shape == (1, a.q_offsets[-1], a.query.shape[1], HEAD_DIM)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        g = torch.randn_like(want)
        params = [a.query, *a.keys, *a.values]
        for x, y in zip(torch.autograd.grad(got, params, g), torch.autograd.grad(want, params, g)):
            torch.testing.assert_close(x, y, rtol=1e-11, atol=1e-11)
