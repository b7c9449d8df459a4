"""The CUDA attention kernels by name, and the comparisons the GPU attention tests make: a kernel
(skipped where it is not installed), a float32 copy of a problem, its input gradients and the
relative error of a result."""
import pytest
import torch

from infinipipe_hf.runtime.attention import varlen as ac
from infinipipe_hf.runtime.attention.types import AttentionSegments

KERNELS = {"varlen": (ac.torch_varlen_kernel, ac.varlen_available),
           "flash": (ac.flash_attn_kernel, ac.flash_available)}


def as_float(a):
    leaf = lambda t: t.detach().float().requires_grad_(True)
    return AttentionSegments(leaf(a.query), [leaf(k) for k in a.keys], [leaf(v) for v in a.values],
                             a.q_offsets, a.context_lens, a.scaling, a.dropout, a.sliding_window)


def input_grads(a, out, g):
    return torch.autograd.grad(out, [a.query, *a.keys, *a.values], g)


def rel_error(x, y):
    x, y = x.detach().float(), y.detach().float()
    return float((x - y).norm() / y.norm().clamp_min(1e-12))


def cuda_kernel(name):
    factory, available = KERNELS[name]
    if not available(torch.device("cuda")):
        pytest.skip(f"{name} attention is not installed here")
    return factory()
