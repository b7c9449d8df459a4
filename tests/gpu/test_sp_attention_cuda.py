"""The CUDA kernels (torch varlen, flash-attn) on the head-sharded problems of SP ranks: uneven
head counts, replicated and expanded GQA heads (shapes from ``tests/helpers/sp_problems.py``),
bf16 against float32 SDPA, forward and gradients."""
import pytest
import torch

from infinipipe_hf.runtime.attention import varlen as ac
from infinipipe_hf.runtime.attention.sdpa import sdpa_backend
from tests.helpers.cuda_attention import KERNELS, as_float, cuda_kernel, input_grads, rel_error
from tests.helpers.sp_problems import LAYOUTS, rank_problems

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("heads,kv_heads,sp", LAYOUTS)
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_on_sp_rank_shapes_equals_sdpa(name, heads, kv_heads, sp):
    kernel = cuda_kernel(name)
    for a in rank_problems(heads, kv_heads, sp, device="cuda", dtype=torch.bfloat16):
        ref = as_float(a)
        got = ac.run_kernel(a, kernel)
        want = sdpa_backend(ref)
        assert got.shape == want.shape and rel_error(got, want) < 1e-2
        g = torch.randn_like(want)
        for i, (x, y) in enumerate(zip(input_grads(a, got, g.bfloat16()), input_grads(ref, want, g))):
            assert rel_error(x, y) < 2e-2, f"gradient {i}: relative error {rel_error(x, y):.3e}"
