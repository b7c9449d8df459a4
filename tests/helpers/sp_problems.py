"""The attention problem each sequence-parallel rank hands its backend, for several head layouts
(uneven MHA, replicated GQA heads, GQA groups straddling ranks): CPU tests and GPU tests share it."""
import torch

from infinipipe_hf.runtime.attention.types import AttentionSegments
from infinipipe_hf.runtime.parallel.sp_shards import head_shards

HEAD_DIM = 8
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
        mk = lambda h, n: torch.randn(1, h, n, HEAD_DIM, device=device, dtype=dtype, generator=g).requires_grad_(True)
        q = mk(s.num_q, offsets[-1])
        keys = [mk(kv, c + n) for n, c in zip(lengths, contexts)]
        values = [mk(kv, c + n) for n, c in zip(lengths, contexts)]
        out.append(AttentionSegments(q, keys, values, tuple(offsets), list(contexts), HEAD_DIM ** -0.5, 0.0, None))
    return out
