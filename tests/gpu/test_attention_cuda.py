"""CUDA attention backends (torch varlen, flash-attn) equal the SDPA reference: forward and
gradients, packed units, slices with context and hybrids, bf16 (tolerance) and fp32 (fallback)."""
import pytest
import torch

from infinipipe_hf.runtime.attention import varlen as ac
from infinipipe_hf.runtime.attention.sdpa import sdpa_backend
from infinipipe_hf.runtime.attention.select import select_backend
from infinipipe_hf.runtime.attention.types import AttentionSegments
from tests.helpers.cuda_attention import KERNELS, as_float, cuda_kernel, input_grads, rel_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

H, KV, D = 8, 2, 64
PROBLEMS = {
    "packed": ([300, 129, 77], [0, 0, 0]),
    "slice_with_context": ([200], [333]),
    "hybrid": ([150, 64, 33], [500, 0, 0]),
    "tiny_slices": ([1, 3], [700, 2]),
}


def _problem(lengths, contexts, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    mk = lambda h, n: torch.randn(1, h, n, D, device="cuda", dtype=dtype, generator=g).requires_grad_(True)
    q = mk(H, offsets[-1])
    keys = [mk(KV, c + n) for n, c in zip(lengths, contexts)]
    values = [mk(KV, c + n) for n, c in zip(lengths, contexts)]
    return AttentionSegments(q, keys, values, tuple(offsets), list(contexts), D ** -0.5, 0.0, None)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_self_check_passes(name):
    assert ac.self_check(cuda_kernel(name), torch.device("cuda"), torch.bfloat16), \
        f"{name} is not lower-right causal on this build (torch {torch.__version__})"


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_kernel_equals_sdpa_bf16_forward_and_grads(name, problem):
    kernel = cuda_kernel(name)
    a = _problem(*PROBLEMS[problem], torch.bfloat16)
    ref = as_float(a)
    got = ac.run_kernel(a, kernel)
    want = sdpa_backend(ref)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert rel_error(got, want) < 1e-2
    g = torch.randn_like(want)
    for i, (x, y) in enumerate(zip(input_grads(a, got, g.bfloat16()), input_grads(ref, want, g))):
        assert rel_error(x, y) < 2e-2, f"gradient {i} of {problem}: relative error {rel_error(x, y):.3e}"


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_selected_backend_bf16_and_fp32_fallback(name):
    cuda_kernel(name)
    backend = select_backend(name, "cuda")
    a = _problem(*PROBLEMS["hybrid"], torch.bfloat16, seed=1)
    assert rel_error(backend(a), sdpa_backend(as_float(a))) < 1e-2
    a32 = _problem(*PROBLEMS["hybrid"], torch.float32, seed=2)
    assert not ac.kernel_can_run(a32)  # fp32 runs the exact SDPA path
    torch.testing.assert_close(backend(a32), sdpa_backend(a32), rtol=1e-6, atol=1e-6)


def test_auto_prefers_a_cuda_kernel():
    assert select_backend("auto", "cuda") in (ac.flash_backend, ac.varlen_backend)
