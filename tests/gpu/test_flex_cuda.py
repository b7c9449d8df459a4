"""The FlexAttention backend on CUDA (compiled Triton kernels) equals the SDPA reference: forward
and every input gradient, per unit kind (whole sequence, pack, slice with context, hybrid), grouped
K/V heads, a sliding window, float32 and bfloat16; its block mask is built once per unit; the
selection lets it train here.  (The attention-backend table with its backward is measured by step 2
of benchmarks/gpu/gpu_suite.sh, not here: its compiles would eat this step's time.)"""
import pytest
import torch

from infinipipe_hf.runtime.attention import flex
from infinipipe_hf.runtime.attention.sdpa import sdpa_backend
from infinipipe_hf.runtime.attention.select import can_train, select_backend
from infinipipe_hf.runtime.attention.types import AttentionSegments, unit_kind
from tests.helpers.cuda_attention import as_float, input_grads, rel_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

H, KV, D = 8, 2, 64
PROBLEMS = {
    "sequence": ([384], [0]),
    "packed": ([300, 129, 77], [0, 0, 0]),
    "slice": ([200], [333]),
    "hybrid": ([150, 64, 33], [500, 0, 0]),
    "tiny_slices": ([1, 3], [700, 2]),
}
# Relative (norm) error against float32 SDPA; a misaligned mask or a lost context is off by order one.
TOL = {torch.float32: (2e-3, 5e-3), torch.bfloat16: (1.5e-2, 3e-2)}  # (output, gradients)


def _problem(lengths, contexts, dtype, window=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    mk = lambda h, n: torch.randn(1, h, n, D, device="cuda", dtype=dtype, generator=g).requires_grad_(True)
    keys = [mk(KV, c + n) for n, c in zip(lengths, contexts)]
    values = [mk(KV, c + n) for n, c in zip(lengths, contexts)]
    return AttentionSegments(mk(H, offsets[-1]), keys, values, tuple(offsets), list(contexts), D ** -0.5, 0.0,
                             window)


def _check(a, dtype):
    ref = as_float(a)
    got, want = flex.flex_backend(a), sdpa_backend(ref)
    assert got.shape == want.shape and got.dtype == dtype
    out_tol, grad_tol = TOL[dtype]
    assert rel_error(got, want) < out_tol, f"output off by {rel_error(got, want):.3e}"
    g = torch.randn_like(want)
    for i, (x, y) in enumerate(zip(input_grads(a, got, g.to(dtype)), input_grads(ref, want, g))):
        assert rel_error(x, y) < grad_tol, f"gradient {i}: relative error {rel_error(x, y):.3e}"


# bfloat16 (what training runs) on every unit kind; float32 on a pack and a hybrid (one more compile)
CASES = [(p, torch.bfloat16) for p in sorted(PROBLEMS)] + [("packed", torch.float32), ("hybrid", torch.float32)]


@pytest.mark.parametrize("problem,dtype", CASES)
def test_flex_equals_sdpa_forward_and_grads(problem, dtype):
    a = _problem(*PROBLEMS[problem], dtype)
    if problem != "tiny_slices":
        assert unit_kind(a) == problem
    _check(a, dtype)


def test_flex_sliding_window_bf16():
    _check(_problem(*PROBLEMS["hybrid"], torch.bfloat16, window=96, seed=2), torch.bfloat16)


def test_flex_lse_equals_dense_reference():
    a = _problem(*PROBLEMS["hybrid"], torch.float32, seed=3)
    with torch.no_grad():
        _, lse = flex.flex_unit_attention(a, return_lse=True)
        rows = []
        for i, (k, c) in enumerate(zip(a.keys, a.context_lens)):
            q = a.query[:, :, a.q_offsets[i]:a.q_offsets[i + 1]]
            s = (q @ k.repeat_interleave(H // KV, dim=1).transpose(-1, -2)) * a.scaling
            n = q.shape[2]
            allowed = torch.arange(c + n, device="cuda")[None] <= torch.arange(c, c + n, device="cuda")[:, None]
            rows.append(torch.logsumexp(s.masked_fill(~allowed, float("-inf")), dim=-1))
    assert rel_error(lse, torch.cat(rows, dim=2)) < 1e-3


def test_block_mask_once_per_unit_and_flex_trains_here():
    flex.clear_block_masks()
    before = flex.block_masks_built()
    for layer in range(3):
        a = _problem(*PROBLEMS["hybrid"], torch.bfloat16, seed=layer)
        flex.flex_backend(a).sum().backward()
    assert flex.block_masks_built() - before == 1
    assert can_train("flex", "cuda") and select_backend("flex", "cuda") is flex.flex_backend



def test_engine_trains_with_flex_like_the_unsplit_model():
    """A pp 1 step with slices, packs and checkpointed layers (their recompute runs flex again),
    fp32 on CUDA, against the float64 CPU reference."""
    import copy

    from infinipipe_hf import InfiniPipeConfig, PipelineEngine
    from tests.helpers.reference import random_batch, reference_loss_and_grads, tiny_model

    ref = tiny_model("llama", num_layers=2, seed=7, hidden=128, heads=4, kv_heads=2)
    lengths = [61, 23, 9, 5]
    batch = random_batch(lengths, seed=3, with_labels=True)
    want_loss, want = reference_loss_and_grads(ref, batch)
    cfg = InfiniPipeConfig(pp_degree=1, num_slices=[3], loss_chunk_tokens=16, checkpointing="full",
                           attention_backend="flex")
    engine = PipelineEngine(copy.deepcopy(ref).to(torch.float32), cfg, device="cuda")
    assert engine.runner.backend is flex.flex_backend
    plan, _ = engine.make_plan(lengths)
    assert any(s.start > 0 for u in plan.units for s in u.segments), "the plan must slice"
    assert any(len(u.segments) > 1 for u in plan.units), "the plan must pack"
    out = engine.train_step(batch, plan=plan)
    assert out.loss == pytest.approx(want_loss, rel=1e-4)
    for n, p in engine.named_parameters():
        assert rel_error(p.grad.double().cpu(), want[n]) < 2e-3, n

