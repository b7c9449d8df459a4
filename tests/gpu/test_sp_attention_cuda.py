"""The CUDA kernels (torch varlen, flash-attn) on the head-sharded problems of SP ranks: uneven
head counts, replicated and expanded GQA heads (shapes from ``tests/unit/test_sp_backends.py``),
bf16 against float32 SDPA, forward and gradients."""
import pytest
import torch

from infinipipe_hf.runtime.attention import varlen as ac
from infinipipe_hf.runtime.attention.sdpa import sdpa_backend
from tests.gpu.test_attention_cuda import KERNELS, _as_float, _grads, _kernel, _rel
from tests.unit.test_sp_backends import LAYOUTS, rank_problems

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("heads,kv_heads,sp", LAYOUTS)
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_on_sp_rank_shapes_equals_sdpa(name, heads, kv_heads, sp):
    kernel = _kernel(name)
    for a in rank_problems(heads, kv_heads, sp, device="cuda", dtype=torch.bfloat16):
        ref = _as_float(a)
        got = ac.run_kernel(a, kernel)
        want = sdpa_backend(ref)
        assert got.shape == want.shape and _rel(got, want) < 1e-2
        g = torch.randn_like(want)
        for i, (x, y) in enumerate(zip(_grads(a, got, g.bfloat16()), _grads(ref, want, g))):
            assert _rel(x, y) < 2e-2, f"gradient {i}: relative error {_rel(x, y):.3e}"
