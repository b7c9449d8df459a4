"""``HostTier`` (runtime/offload/host_tier.py) and the ``saved_tensors_hooks`` that feed it, on CPU.

The CPU tier keeps a separate storage: a tensor put in it can be dropped by its owner and comes
back as a new tensor with the same values; the accounting follows every copy.
"""
import pytest
import torch

from infinipipe_hf.runtime.offload.activation_hooks import offload_saved
from infinipipe_hf.runtime.offload.host_tier import HostTier


def test_put_get_moves_bytes_and_frees_host_copy():
    tier = HostTier()
    t = torch.randn(4, 8, dtype=torch.float64)
    h = tier.put(t, tag=3)
    assert h.host.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    assert tier.current_bytes == tier.peak_bytes == 4 * 8 * 8 and tier.live_tags() == {3}
    back = tier.get(h)
    assert torch.equal(back, t) and back.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    s = tier.stats
    assert (s.bytes_out, s.bytes_in, s.copies_out, s.copies_in, s.current_bytes) == (256, 256, 1, 1, 0)
    assert s.peak_bytes == 256 and h.released
    with pytest.raises(RuntimeError, match="after it was released"):
        tier.get(h)


def test_keep_release_tags_and_resident_bytes():
    tier = HostTier()
    a, b = tier.put(torch.ones(10), tag="u"), tier.put(torch.zeros(5), tag="v")
    assert torch.equal(tier.get(a, keep=True), torch.ones(10)) and not a.released
    assert tier.current_bytes == 60
    tier.prefetch_tag("u")  # on the CPU a no-op: get copies synchronously
    tier.release_tag("u")
    assert a.released and not b.released and tier.current_bytes == 20
    tier.set_resident("optimizer", 100)
    tier.set_resident("optimizer", 40)
    assert tier.current_bytes == 60 and tier.peak_bytes == 120
    tier.clear()
    assert b.released and tier.current_bytes == 40  # resident bytes stay
    tier.reset_stats()
    assert tier.peak_bytes == 40 and tier.stats.bytes_out == 0


def test_saved_tensors_leave_and_come_back_with_the_same_gradients():
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8).double()
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)

    def f(inp):
        h = inp * 1.5
        return torch.tanh(lin(h)).pow(2).sum()

    f(x).backward()
    want = x.grad.clone(), lin.weight.grad.clone()
    x.grad = None
    lin.zero_grad()
    tier = HostTier()
    with offload_saved(tier, tag=0):
        loss = f(x)
    assert tier.current_bytes > 0 and tier.stats.copies_out >= 2  # h, lin(h), tanh(...), not the weight
    held = tier.current_bytes
    loss.backward()
    # The copies come back at other addresses, where BLAS may take another vectorised path (a
    # last-bit difference on some CPUs): equal to float64 rounding, not necessarily bit for bit.
    torch.testing.assert_close(x.grad, want[0], rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(lin.weight.grad, want[1], rtol=1e-13, atol=1e-15)
    s = tier.stats
    assert s.bytes_out == s.bytes_in == s.peak_bytes == held and s.current_bytes == 0


def test_graph_dropped_without_backward_releases_its_host_copies():
    tier = HostTier()
    x = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    with offload_saved(tier, tag=0):
        y = (x * x).sum()
    assert tier.current_bytes > 0
    del y
    assert tier.current_bytes == 0


def test_a_checkpoint_input_put_in_the_tier_is_freed_on_the_device():
    import gc
    import weakref

    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(1)
    lin = torch.nn.Linear(8, 8).double()
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    tier = HostTier()
    h = x * 2  # a layer's input: no one else keeps it
    with offload_saved(tier, tag=0):
        out = checkpoint(lambda a: torch.tanh(lin(a)), h, use_reentrant=False)
    gone = weakref.ref(h)
    del h
    gc.collect()
    assert gone() is None and tier.current_bytes == 5 * 8 * 8  # only the host copy remains
    out.sum().backward()
    want = torch.autograd.grad(torch.tanh(lin(x * 2)).sum(), x)[0]
    assert torch.equal(x.grad, want) and tier.current_bytes == 0
