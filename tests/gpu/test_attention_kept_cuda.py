"""keep_attn on CUDA: torch's flash-attention pair passes its self-check, equals SDPA (forward and
the gradients from the kept output and log-sum-exp) in bf16, and an engine step at keep_attn (or
offload_attn, the same in host memory, or offload_pair, that in a pair whose second layer's input
is rebuilt) on every layer equals one with whole layers recomputed (the same kernels, so within
bf16 rounding).
The pair's code around the kernels is tested on CPU (tests/runtime/attention/test_kept_kernels_cpu.py)."""
import pytest
import torch

from infinipipe_hf import InfiniPipeConfig, PipelineEngine
from infinipipe_hf.runtime.attention import kept_kernels as kk
from infinipipe_hf.runtime.attention.sdpa import sdpa_backend
from infinipipe_hf.runtime.attention.types import AttentionSegments
from tests.helpers.reference import random_batch, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEVICE = "cuda"  # a module constant so the test logic can be dry-run on CPU
H, KV, D = 8, 2, 64
PROBLEMS = {"packed": ([300, 129, 77], [0, 0, 0]), "slice_with_context": ([200], [333]),
            "hybrid": ([150, 64, 33], [500, 0, 0]), "tiny_slices": ([1, 3], [700, 2])}
LENGTHS = [61, 23, 9, 5]


def _pair(dtype=torch.bfloat16):
    kernel = kk.kernel_for(DEVICE, dtype, D)
    assert not isinstance(kernel, str), kernel
    return kernel


def _rel(x, y):
    x, y = x.detach().float(), y.detach().float()
    return float((x - y).norm() / y.norm().clamp_min(1e-12))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_self_check_passes(dtype):
    _pair(dtype)


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
def test_pair_equals_sdpa_bf16(problem, window):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    lengths, contexts = PROBLEMS[problem]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    mk = lambda h, n: torch.randn(1, h, n, D, device=DEVICE, dtype=torch.bfloat16, generator=g)
    a = AttentionSegments(mk(H, offsets[-1]), [mk(KV, c + n) for n, c in zip(lengths, contexts)],
                          [mk(KV, c + n) for n, c in zip(lengths, contexts)], tuple(offsets), list(contexts),
                          D ** -0.5, 0.0, window)
    leaf = lambda t: t.float().requires_grad_(True)
    ref = AttentionSegments(leaf(a.query), [leaf(k) for k in a.keys], [leaf(v) for v in a.values], a.q_offsets,
                            a.context_lens, a.scaling, 0.0, window)
    want = sdpa_backend(ref)
    grad = torch.randn(want.shape, device=DEVICE, generator=g)
    wants = torch.autograd.grad(want, [ref.query, *ref.keys, *ref.values], grad)
    kernel = _pair()
    out, lse, aux = kernel.forward(a)
    assert _rel(out, want) < 1e-2
    dq, dks, dvs = kernel.backward(a, grad.bfloat16(), out, lse, aux)
    for i, (x, y) in enumerate(zip([dq, *dks, *dvs], wants)):
        assert x.shape == y.shape and _rel(x, y) < 2e-2, f"gradient {i} of {problem}: {_rel(x, y):.3e}"


def _step(model, levels):
    engine = PipelineEngine(model, InfiniPipeConfig(pp_degree=1, num_slices=[3], loss_chunk_tokens=16,
                                                    checkpoint_levels=("keep_attn", "mlp", "mlp_act")),
                            device=DEVICE)
    plan, _ = engine.make_plan(LENGTHS)
    assert "keep_attn" in engine.config.checkpoint_levels  # not dropped for this device and dtype
    layers = engine.layers_per_stage[0]
    plan.checkpoint_layers = {0: {u.id: (layers if levels is None else 0) for u in plan.units}}
    plan.checkpoint_levels = {} if levels is None else {0: {u.id: dict(levels) for u in plan.units}}
    out = engine.train_step(random_batch(LENGTHS, seed=3), plan=plan)
    return out.loss, {n: p.grad.float().cpu() for n, p in engine.named_parameters()}, engine.host_tier.stats


@pytest.mark.parametrize("level", ["keep_attn", "offload_attn", "offload_pair"])
def test_engine_keep_attn_equals_whole_layer_recompute_bf16(level):
    """``offload_attn`` also round-trips, per layer and token, the bf16 input and attention output
    and the float32 log-sum-exp per head through pinned host memory; ``offload_pair`` (the two
    layers one pair) all but the second layer's input, and its rebuild reads the first layer's
    input and attention output once more."""
    make = lambda: tiny_model("qwen2", num_layers=2, seed=6, hidden=256, heads=4, kv_heads=2).to(torch.bfloat16)
    want_loss, want, _ = _step(make(), None)
    loss, got, tier = _step(make(), {level: 2})
    assert loss == pytest.approx(want_loss, rel=1e-2)
    num = sum(float((got[n] - want[n]).pow(2).sum()) for n in want)
    den = sum(float(w.pow(2).sum()) for w in want.values())
    assert (num / den) ** 0.5 < 2e-2
    tokens = sum(LENGTHS)
    kept = tokens * (256 * 2 + 4 * 4)  # per layer: bf16 attention output, float32 lse per head
    host = {"keep_attn": 0, "offload_attn": 2 * (tokens * 256 * 2 + kept),
            "offload_pair": tokens * 256 * 2 + 2 * kept}[level]
    reread = tokens * (256 * 2 + 256 * 2) if level == "offload_pair" else 0
    # (a few bytes more if a torch keeps the kernel's random-number state on the device)
    assert host <= tier.bytes_out <= host + 1024 and tier.current_bytes == 0, (tier, host)
    assert tier.bytes_in == tier.bytes_out + reread, (tier, reread)
