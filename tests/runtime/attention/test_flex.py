"""The FlexAttention backend on CPU (forward only, float64) against SDPA, and the per-kind routing.

FlexAttention's backward does not run on CPU in torch 2.13, so here: its forward and its masks
(packs, a slice with context, a hybrid, grouped K/V heads, a sliding window) against the SDPA
backend, its log-sum-exp against a dense reference, the block mask built once per unit across
layers, the refusal to train on CPU, and ``select_backend("auto", ..., table)`` routing each unit
kind by a measured table.  The backward and the compiled kernels: tests/gpu/test_flex_cuda.py.
"""
import random

import pytest
import torch

from infinipipe_hf.ir.units import Segment
from infinipipe_hf.runtime.attention import flex
from infinipipe_hf.runtime.attention import select as attn
from infinipipe_hf.runtime.attention.hf import epp_attention_forward
from infinipipe_hf.runtime.attention.kept_kernels import CPU_KERNEL
from infinipipe_hf.runtime.attention.kv_store import KVStore
from infinipipe_hf.runtime.attention.sdpa import sdpa_backend
from infinipipe_hf.runtime.attention.select import RoutedBackend, backend_for_kind, select_backend
from infinipipe_hf.runtime.attention.types import (
    AttentionSegments,
    EPPUnitContext,
    segment_mask,
    unit_kind,
)

D = 8
PROBLEMS = {"packed": ([5, 9, 3], [0, 0, 0]), "slice_with_context": ([6], [11]),
            "hybrid": ([4, 7, 2], [13, 0, 0]), "tiny_slices": ([1, 3], [17, 2]),
            "whole_sequence": ([150], [0]), "long_hybrid": ([140, 30, 9], [200, 0, 0])}


def _problem(lengths, contexts, heads=4, kv_heads=2, window=None, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    mk = lambda h, n: torch.randn(1, h, n, D, dtype=torch.float64, generator=g, requires_grad=grad)
    keys = [mk(kv_heads, c + n) for n, c in zip(lengths, contexts)]
    values = [mk(kv_heads, c + n) for n, c in zip(lengths, contexts)]
    return AttentionSegments(mk(heads, offsets[-1]), keys, values, tuple(offsets), list(contexts), D ** -0.5,
                             0.0, window)


def _dense_lse(a):
    """Natural-log log-sum-exp of each query's allowed scores, [1, heads, T], by hand."""
    heads, rows = a.query.shape[1], []
    for i, (k, c) in enumerate(zip(a.keys, a.context_lens)):
        q = a.query[:, :, a.q_offsets[i]:a.q_offsets[i + 1]]
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        s = (q @ k.transpose(-1, -2)) * a.scaling
        s = s.masked_fill(~segment_mask(q.shape[2], c, a.sliding_window, q.device), float("-inf"))
        rows.append(torch.logsumexp(s, dim=-1))
    return torch.cat(rows, dim=2)


# every problem with grouped heads (4 on 2); heads without groups, one K/V head, and a window on some
CASES = [(p, 4, 2, None) for p in sorted(PROBLEMS)] + [
    ("hybrid", 4, 4, None), ("packed", 6, 1, None), ("long_hybrid", 6, 1, 4), ("slice_with_context", 4, 2, 4),
    ("whole_sequence", 4, 2, 32), ("tiny_slices", 4, 4, 2)]


@pytest.mark.parametrize("problem,heads,kv_heads,window", CASES)
def test_forward_and_lse_equal_sdpa(problem, heads, kv_heads, window):
    a = _problem(*PROBLEMS[problem], heads=heads, kv_heads=kv_heads, window=window)
    with torch.no_grad():
        got, lse = flex.flex_unit_attention(a, return_lse=True)
        want = sdpa_backend(a)
        backend_out = flex.flex_backend(a)
    assert got.shape == want.shape == (1, a.q_offsets[-1], heads, D)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(backend_out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, _dense_lse(a), rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # keep_attn's CPU pair computes the same log-sum-exp
        torch.testing.assert_close(lse, CPU_KERNEL.forward(a)[1], rtol=1e-12, atol=1e-12)


def test_the_comparison_catches_a_misaligned_mask(monkeypatch):
    """Upper-left causality on a slice with context (query positions from 0) is caught."""
    a = _problem([6], [11])
    real = flex.segment_tables

    def upper_left(problem, device):
        q_seg, q_pos, k_seg, k_pos = real(problem, device)
        return q_seg, q_pos - problem.context_lens[0], k_seg, k_pos

    flex.clear_block_masks()
    monkeypatch.setattr(flex, "segment_tables", upper_left)
    with torch.no_grad():
        wrong = flex.flex_unit_attention(a)[0]
    flex.clear_block_masks()
    assert not torch.allclose(wrong, sdpa_backend(a), atol=1e-3)


def test_block_lists_equal_create_block_mask():
    """The tiles computed from the segments are exactly those ``create_block_mask`` finds by
    evaluating the mask_mod on every pair (random packs, slices, hybrids, windows, tile sizes)."""
    from torch.nn.attention.flex_attention import create_block_mask

    rng = random.Random(0)
    for _ in range(60):
        n = rng.randint(1, 5)
        lengths = [rng.randint(1, 90) for _ in range(n)]
        contexts = [rng.choice([0, 0, rng.randint(1, 200)]) for _ in range(n)]
        window, block = rng.choice([None, None, 1, 5, 17, 64]), rng.choice([8, 16, 32])
        a = _problem(lengths, contexts, heads=1, kv_heads=1, window=window)
        mask_mod = flex.make_mask_mod(*flex.segment_tables(a, "cpu"), window)
        want = create_block_mask(mask_mod, None, None, a.q_offsets[-1], a.q_offsets[-1] + sum(contexts),
                                 device="cpu", BLOCK_SIZE=block)
        any_pair, full = flex.segment_blocks(a, block)
        got = [*flex._ordered(any_pair & ~full, "cpu"), *flex._ordered(full, "cpu")]
        for x, y in zip(got, (want.kv_num_blocks, want.kv_indices, want.full_kv_num_blocks, want.full_kv_indices)):
            assert torch.equal(x, y), (lengths, contexts, window, block)


def test_segment_tables_of_a_hybrid():
    a = _problem([2, 3], [4, 0])
    q_seg, q_pos, k_seg, k_pos = (t.tolist() for t in flex.segment_tables(a, "cpu"))
    assert q_seg == [0, 0, 1, 1, 1] and q_pos == [4, 5, 0, 1, 2]
    assert k_seg == [0] * 6 + [1] * 3 and k_pos == [0, 1, 2, 3, 4, 5, 0, 1, 2]


def _unit(segments, lengths, store, backend, unit_id=0):
    offsets = [0]
    for s in segments:
        offsets.append(offsets[-1] + s.length)
    cont = tuple(s.end < lengths[s.seq] for s in segments)
    return EPPUnitContext(unit_id, tuple(segments), tuple(offsets), cont, store, backend)


class _Layer:
    def __init__(self, idx):
        self.layer_idx = idx


def test_block_mask_built_once_per_unit_across_layers():
    """Three decoder layers of a stage run a hybrid unit through the HF attention function: one
    block mask; the next unit (other geometry) builds one more; the same unit again builds none."""
    flex.clear_block_masks()
    lengths, layers, store = {0: 24, 1: 5}, [_Layer(i) for i in range(3)], KVStore()
    g = torch.Generator().manual_seed(3)
    qkv = lambda T: (torch.randn(1, 4, T, D, dtype=torch.float64, generator=g),
                     torch.randn(1, 2, T, D, dtype=torch.float64, generator=g),
                     torch.randn(1, 2, T, D, dtype=torch.float64, generator=g))
    first = _unit([Segment(0, 0, 16)], lengths, store, flex.flex_backend, 0)
    second = _unit([Segment(0, 16, 24), Segment(1, 0, 5)], lengths, store, flex.flex_backend, 1)
    with torch.no_grad():
        for ctx, T in ((first, 16), (second, 13)):
            before = flex.block_masks_built()
            for layer in layers:
                out, _ = epp_attention_forward(layer, *qkv(T), None, epp_unit=ctx)
                assert out.shape == (1, T, 4, D)
            assert flex.block_masks_built() - before == 1
        before = flex.block_masks_built()
        for layer in layers:
            epp_attention_forward(layer, *qkv(13), None, epp_unit=second)
        assert flex.block_masks_built() == before


def test_stage_of_layers_equals_sdpa():
    """The same hybrid unit through three layers with flex and with SDPA: equal outputs."""
    lengths = {0: 24, 1: 5}
    g = torch.Generator().manual_seed(4)
    inputs = [tuple(torch.randn(1, h, T, D, dtype=torch.float64, generator=g) for h in (4, 2, 2))
              for T in (16, 13)]
    outs = {}
    for name, backend in (("flex", flex.flex_backend), ("sdpa", sdpa_backend)):
        store, outs[name] = KVStore(), []
        units = [_unit([Segment(0, 0, 16)], lengths, store, backend, 0),
                 _unit([Segment(0, 16, 24), Segment(1, 0, 5)], lengths, store, backend, 1)]
        with torch.no_grad():
            for ctx, qkv in zip(units, inputs):
                for i in range(3):
                    outs[name].append(epp_attention_forward(_Layer(i), *qkv, None, epp_unit=ctx)[0])
    for got, want in zip(outs["flex"], outs["sdpa"]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_flex_refuses_to_train_on_cpu():
    with pytest.raises(ValueError, match="cannot train on cpu.*use 'auto' or 'sdpa'"):
        select_backend("flex", "cpu")
    a = _problem([5, 9], [0, 3], grad=True)
    with pytest.raises(ValueError, match="backward runs only on CUDA"):
        flex.flex_backend(a)
    with torch.no_grad():  # evaluation: the forward runs
        assert flex.flex_backend(a).shape == (1, 14, 4, D)
    assert attn.available_backends("cpu") == {"sdpa": True, "flex": False}
    assert not attn.can_train("flex", "cpu") and attn.can_train("sdpa", "cpu")


def test_dropout_goes_to_sdpa():
    a = _problem([5, 9], [0, 3])
    a.dropout = 0.5
    torch.manual_seed(0)
    with torch.no_grad():
        want = sdpa_backend(a)
        torch.manual_seed(0)
        got = flex.flex_backend(a)
    torch.testing.assert_close(got, want)


def test_unit_kinds():
    assert unit_kind(_problem([7], [0])) == "sequence"
    assert unit_kind(_problem([7], [4])) == "slice"
    assert unit_kind(_problem([7, 3], [0, 0])) == "packed"
    assert unit_kind(_problem([7, 3], [4, 0])) == "hybrid"


def _table(**ranking):
    return {"ranking": ranking, "fastest": {k: v[0] for k, v in ranking.items()}}


def test_auto_routes_each_unit_kind_by_the_measured_table(monkeypatch):
    calls = []

    def fake(name):
        def backend(a):
            calls.append((name, unit_kind(a)))
            return sdpa_backend(a)
        return backend

    monkeypatch.setitem(attn._BACKENDS, "fast_pack", (fake("fast_pack"), lambda d: True))
    monkeypatch.setitem(attn._BACKENDS, "fast_slice", (fake("fast_slice"), lambda d: True))
    table = _table(packed=["fast_pack", "sdpa"], slice=["fast_slice", "sdpa"], hybrid=["flex", "fast_pack"],
                   sequence=["sdpa"])
    routed = select_backend("auto", "cpu", table)
    assert isinstance(routed, RoutedBackend)
    # flex ranks first for hybrids but cannot train on CPU: the next one that can
    assert routed.routes == {"sequence": "sdpa", "packed": "fast_pack", "slice": "fast_slice",
                             "hybrid": "fast_pack"}
    for lengths, contexts in (([7], [0]), ([7, 3], [0, 0]), ([7], [4]), ([7, 3], [4, 0])):
        a = _problem(lengths, contexts)
        torch.testing.assert_close(routed(a), sdpa_backend(a))
    assert calls == [("fast_pack", "packed"), ("fast_slice", "slice"), ("fast_pack", "hybrid")]
    assert backend_for_kind(routed, "sequence") is sdpa_backend
    assert routed.__name__ == "routed(sequence=sdpa, packed=fast_pack, slice=fast_slice, hybrid=fast_pack)"
    assert backend_for_kind(sdpa_backend, "slice") is sdpa_backend


def test_auto_without_a_usable_table_keeps_the_fixed_order():
    assert select_backend("auto", "cpu") is sdpa_backend
    assert select_backend("auto", "cpu", {}) is sdpa_backend
    # a GPU's table on CPU: flex and varlen cannot train here, sdpa for every kind, no routing
    gpu_table = _table(packed=["flex", "varlen", "sdpa"], slice=["varlen", "sdpa"], hybrid=["flex"])
    assert select_backend("auto", "cpu", gpu_table) is sdpa_backend
    assert select_backend("sdpa", "cpu", gpu_table) is sdpa_backend  # a named backend ignores the table
    assert attn.measured_routes({"fastest": {"packed": "sdpa", "slice": "flex"}}, "cpu") == {"packed": "sdpa"}


def test_unknown_backend_names_flex():
    with pytest.raises(ValueError, match="known: flash, flex, .*varlen"):
        select_backend("nope", "cpu")
    with pytest.raises(ValueError, match="no attention backend 'nope'"):
        attn.backend_named("nope")
