"""The sharded K/V store's gather and its backward, with uneven chunks, in one process.

A K/V group of ``r`` ranks is played by ``r`` threads whose collectives meet at a barrier
(the real one is ``runtime/parallel/kv_group.py``).  Each thread stores its chunks of the same
entries (lengths that ``r`` does not divide, one shorter than ``r``: a rank without rows), reads
the context, and backpropagates a gradient of its own: the context must be the whole K/V in token
order on every rank, and each rank's chunk gradients (device leaves, and the host accumulators
with ``offload``) the sum of every rank's gradient rows of that chunk; ``PendingKVGrad`` then
returns them widened to the slice.
"""
from __future__ import annotations

import threading

import pytest
import torch

from infinipipe_hf.runtime.attention.kv_shards import chunk_rows, widen
from infinipipe_hf.runtime.attention.kv_store import KVStore, PendingKVGrad

D = 3


class ThreadGroup:
    """``size`` threads exchanging through shared slots; ``position`` is per thread."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size)
        self.slots: list = [None] * size
        self.local = threading.local()
        self.calls = [0] * size

    @property
    def position(self) -> int:
        return self.local.position

    def _exchange(self, send):
        """Every thread's ``send``, in position order, once all have arrived."""
        me = self.position
        self.calls[me] += 1
        self.barrier.wait()
        self.slots[me] = send.clone()
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        assert len({g.numel() for g in got}) == 1, [g.numel() for g in got]  # equal parts, as NCCL needs
        return got

    def all_gather(self, send, what):
        return torch.cat(self._exchange(send))

    def reduce_scatter(self, send, what):
        parts = [g.view(self.size, -1)[self.position] for g in self._exchange(send)]
        return sum(parts[1:], parts[0].clone())


def run_ranks(group: ThreadGroup, fn) -> list:
    out: list = [None] * group.size
    errors: list = []

    def body(p):
        group.local.position = p
        try:
            out[p] = fn(p)
        except BaseException as exc:  # reported below
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=body, args=(p,)) for p in range(group.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("r,lengths", [(3, [5, 2, 7]), (2, [1, 4, 3]), (4, [6])])
def test_gather_reassembles_and_sums_chunk_gradients(r, lengths, offload, heads):
    torch.manual_seed(0)
    total = sum(lengths)
    k_full = torch.randn(1, heads, total, D, dtype=torch.float64)
    v_full = torch.randn(1, heads, total, D, dtype=torch.float64)
    grads_k = [torch.randn(1, heads, total, D, dtype=torch.float64) for _ in range(r)]
    grads_v = [torch.randn(1, heads, total, D, dtype=torch.float64) for _ in range(r)]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    group = ThreadGroup(r)

    def rank(p):
        store = KVStore()
        store.offload = offload
        with torch.enable_grad():
            entries = [store.put(0, 0, s, s + n, k_full[:, :, s:s + n], v_full[:, :, s:s + n], group)
                       for s, n in zip(starts, lengths)]
            ck, cv = store.context(0, 0, total, group)
            assert torch.equal(ck, k_full) and torch.equal(cv, v_full)
            torch.autograd.backward([ck, cv], [grads_k[p], grads_v[p]])
        held = store.bytes()
        pending = []
        for e, s, n in zip(entries, starts, lengths):
            out = torch.zeros(1, requires_grad=True)
            k_own = torch.zeros(1, heads, n, D, dtype=torch.float64, requires_grad=True)
            v_own = torch.zeros(1, heads, n, D, dtype=torch.float64, requires_grad=True)
            PendingKVGrad.apply(out, k_own, v_own, e).sum().backward()
            pending.append((k_own.grad, v_own.grad))
        return held, pending

    results = run_ranks(group, rank)
    assert group.calls == [2] * r  # one collective forward, one backward
    sum_k, sum_v = sum(grads_k), sum(grads_v)
    kept = 0
    for p, (held, pending) in enumerate(results):
        for (gk, gv), s, n in zip(pending, starts, lengths):
            lo, hi = token_shards_range(n, r, p)
            want_k = torch.zeros(1, heads, n, D, dtype=torch.float64)
            want_v = torch.zeros_like(want_k)
            want_k[:, :, lo:hi] = sum_k[:, :, s + lo:s + hi]
            want_v[:, :, lo:hi] = sum_v[:, :, s + lo:s + hi]
            torch.testing.assert_close(gk, want_k, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(gv, want_v, rtol=1e-12, atol=1e-12)
        kept += held
    # K, V and their gradients once over the group (nothing on the device when offloaded).
    assert kept == (0 if offload else 4 * heads * total * D * 8)


def token_shards_range(n: int, r: int, p: int) -> tuple[int, int]:
    class G:
        size, position = r, p
    return chunk_rows(n, G)


def test_chunks_cover_the_entry_in_order_and_widen_pads_with_zeros():
    class G:
        size = 3
        position = 0
    spans = []
    for p in range(3):
        G.position = p
        spans.append(chunk_rows(7, G))
    assert spans == [(0, 3), (3, 5), (5, 7)]
    g = torch.ones(1, 1, 2, D)
    full = widen(g, (3, 5), 7)
    assert full.shape == (1, 1, 7, D) and full[:, :, 3:5].eq(1).all() and full.sum() == 2 * D


def test_mixing_sharded_and_whole_entries_is_an_error():
    store = KVStore()
    k = torch.zeros(1, 1, 4, D)
    store.put(0, 0, 0, 4, k, k)

    class G:
        size, position = 2, 0

    with pytest.raises(RuntimeError, match="sharded"):
        store.context(0, 0, 4, G)
