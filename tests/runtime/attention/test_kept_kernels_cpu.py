"""keep_attn's CUDA kernel pair on CPU: everything but the fused kernels, against SDPA, float64.

The aten flash-attention pair is replaced by stand-ins with its exact signatures that compute the
forward from the softmax and the backward from the kept output and log-sum-exp only
(``tests/helpers/varlen_reference.py``).  So the pair's packing of a unit, the window arguments,
the hand-over of the log-sum-exp and random-number state from forward to backward, and the split
of the packed key gradients back into segments run here, for every unit shape, and then inside
whole pipelines (every level alone and mixed, grouped heads, a sliding window across slices),
compared with the unsplit HF model.  The self-check that guards the real kernels on a GPU is
shown to accept the right pair and to refuse a misaligned mask, a wrong backward and a kernel
that raises.  Left to tests/gpu/test_attention_kept_cuda.py: the fused kernels themselves.
"""
import functools

import pytest
import torch

from infinipipe_hf.runtime.attention import kept_kernels as kk
from infinipipe_hf.runtime.attention.sdpa import sdpa_backend
from infinipipe_hf.runtime.attention.types import AttentionSegments
from infinipipe_hf.runtime.recompute.layers import runnable_levels
from tests.helpers.local_pipeline import LENGTHS, MIX_CYCLE, NUM_LAYERS, build_stages, check, make_plan, with_levels
from tests.helpers.reference import random_batch, tiny_model
from tests.helpers.varlen_reference import sdpa_flash_attention_backward, sdpa_flash_attention_forward

H, KV, D = 4, 2, 8
PROBLEMS = {"packed": ([5, 9, 3], [0, 0, 0]), "slice_with_context": ([6], [11]),
            "hybrid": ([4, 7, 2], [13, 0, 0]), "tiny_slices": ([1, 3], [17, 2])}
FLASH_ON_CPU = kk.flash_varlen_kept_kernel(sdpa_flash_attention_forward, sdpa_flash_attention_backward)
PAIRS = {"flash_varlen": FLASH_ON_CPU, "flash_cpu": kk.CPU_KERNEL}


def _problem(lengths, contexts, window=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    mk = lambda h, n: torch.randn(1, h, n, D, dtype=torch.float64, generator=g, requires_grad=True)
    q = mk(H, offsets[-1])
    keys = [mk(KV, c + n) for n, c in zip(lengths, contexts)]
    values = [mk(KV, c + n) for n, c in zip(lengths, contexts)]
    return AttentionSegments(q, keys, values, tuple(offsets), list(contexts), D ** -0.5, 0.0, window)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_pair_equals_sdpa_forward_and_gradients_from_the_kept_lse(pair, problem, window):
    kernel = PAIRS[pair]
    a = _problem(*PROBLEMS[problem], window=window)
    want = sdpa_backend(a)
    with torch.no_grad():
        out, lse, aux = kernel.forward(a)
    assert out.shape == want.shape == (1, a.q_offsets[-1], H, D)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    g_out = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    wants = torch.autograd.grad(want, [a.query, *a.keys, *a.values], g_out)
    with torch.no_grad():
        dq, dks, dvs = kernel.backward(a, g_out, out, lse, aux)
    for got, exp in zip([dq, *dks, *dvs], wants):
        assert got.shape == exp.shape
        torch.testing.assert_close(got, exp, rtol=1e-11, atol=1e-11)


def test_window_keywords_only_where_the_window_binds():
    a = _problem([5, 3], [2, 0], window=7)  # 7 keys in segment 0: the window does not bind
    assert kk._window(a, (7, 3)) == {}
    a.sliding_window = 4
    assert kk._window(a, (7, 3)) == {"window_size_left": 3, "window_size_right": 0}


def _wrong_lse_backward(*args, **kwargs):
    args = list(args)
    args[5] = args[5] + 0.5  # the log-sum-exp the backward starts from
    return sdpa_flash_attention_backward(*args, **kwargs)


def _raising_forward(*args, **kwargs):
    raise TypeError("_flash_attention_forward() got an unexpected keyword argument 'scale'")


def test_self_check_accepts_the_right_pair_and_refuses_wrong_ones():
    cpu = torch.device("cpu")
    assert kk.self_check(FLASH_ON_CPU, cpu, torch.float64) is None
    assert kk.self_check(kk.CPU_KERNEL, cpu, torch.float64) is None
    upper_left = kk.flash_varlen_kept_kernel(functools.partial(sdpa_flash_attention_forward, upper_left=True),
                                             functools.partial(sdpa_flash_attention_backward, upper_left=True))
    assert "output is off by" in kk.self_check(upper_left, cpu, torch.float64)
    wrong_backward = kk.flash_varlen_kept_kernel(sdpa_flash_attention_forward, _wrong_lse_backward)
    assert "gradient" in kk.self_check(wrong_backward, cpu, torch.float64)
    raising = kk.flash_varlen_kept_kernel(_raising_forward, sdpa_flash_attention_backward)
    assert "raised TypeError: _flash_attention_forward() got an unexpected" in kk.self_check(raising, cpu,
                                                                                              torch.float64)


def test_self_check_runs_under_no_grad():
    """The first ask for the pair can come from evaluation (``torch.no_grad``), as on a GPU."""
    with torch.no_grad():
        assert kk.self_check(FLASH_ON_CPU, torch.device("cpu"), torch.float64) is None


def test_kernel_choice_and_reasons():
    assert kk.kernel_for("cpu", torch.float64) is kk.CPU_KERNEL
    assert kk.kernel_for("cpu", torch.bfloat16, 100) is kk.CPU_KERNEL
    assert "float16 or bfloat16, not torch.float32" in kk.kernel_for("cuda", torch.float32)
    assert "multiple of 8, not 100" in kk.kernel_for("cuda", torch.bfloat16, 100)
    assert "at most 256" in kk.kernel_for("cuda", torch.bfloat16, 512)
    assert "no attention kernel pair for meta" in kk.kernel_for("meta", torch.bfloat16)
    if not torch.cuda.is_available():
        assert "none is available" in kk.kernel_for("cuda:0", torch.bfloat16, 64)


def test_levels_dropped_on_cuda_name_the_dtype():
    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=31)
    layers = [layer for st in build_stages(model, 1) for _, layer in st.decoder_layers()]
    every = ("keep_attn", "mlp", "mlp_act")
    kept, why = runnable_levels(every, layers, torch.device("cuda"), torch.float32)
    assert kept == ("mlp", "mlp_act") and "float16 or bfloat16, not torch.float32" in why


@pytest.fixture
def flash_pair_on_cpu(monkeypatch):
    """Every keep_attn layer runs the CUDA pair's code (on the CPU stand-ins); counts its calls."""
    calls = []

    def kernel_for(device, dtype, head_dim=None):
        calls.append((str(device), dtype))
        return FLASH_ON_CPU

    monkeypatch.setattr(kk, "kernel_for", kernel_for)
    return calls


@pytest.mark.parametrize("pp", [1, 2])
def test_pipeline_keep_attn_on_every_layer_with_the_flash_pair(flash_pair_on_cpu, pp):
    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=40)
    batch = random_batch(LENGTHS, seed=40, with_labels=True)
    plan = make_plan(pp, "1f1b", "none")
    plan.checkpoint_levels = {s: {u.id: {"keep_attn": NUM_LAYERS // pp} for u in plan.units} for s in range(pp)}
    check(model, build_stages(model, pp), plan, batch)
    assert flash_pair_on_cpu, "the keep_attn layers did not run the flash pair"


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_pipeline_mixed_levels_with_the_flash_pair(flash_pair_on_cpu, family):
    model = tiny_model(family, num_layers=NUM_LAYERS, seed=41)
    batch = random_batch(LENGTHS, seed=41)
    plan = with_levels(make_plan(2, "1f1b", "none"), MIX_CYCLE)
    assert any("keep_attn" in per for st in plan.checkpoint_levels.values() for per in st.values())
    check(model, build_stages(model, 2), plan, batch, chunk=3)
    assert flash_pair_on_cpu


def test_sliding_window_across_slices_with_the_flash_pair(flash_pair_on_cpu):
    model = tiny_model("mistral", num_layers=NUM_LAYERS, seed=42)
    model.config.sliding_window = 5  # shorter than the slices and their contexts
    plan = make_plan(2, "1f1b", "none")
    plan.checkpoint_levels = {s: {u.id: {"keep_attn": 2} for u in plan.units} for s in range(2)}
    check(model, build_stages(model, 2), plan, random_batch(LENGTHS, seed=42))
    assert flash_pair_on_cpu
