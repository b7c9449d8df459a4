"""The host tier brings offloaded inputs back one ahead of the backward, never a whole unit at once."""
import torch

from infinipipe_hf.runtime.offload.activation_hooks import offload_saved
from infinipipe_hf.runtime.offload.host_tier import HostTier


def test_reading_an_input_prefetches_only_the_next_one(monkeypatch):
    tier = HostTier()
    asked = []
    monkeypatch.setattr(tier, "prefetch", lambda h: asked.append(h))
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    h = x * 1
    with offload_saved(tier, tag=7):
        for _ in range(5):
            h = torch.exp(h * 0.1)  # exp saves its output: one host copy per step, read in reverse
    handles = [t for t in tier._live.values() if t.tag == 7]
    assert len(handles) == 5
    tier.prefetch_tag(7)  # what the executor does when the unit's backward starts
    assert asked == [handles[-1]]
    h.sum().backward()
    # every read asked for the next one in backward order: one ahead, never the whole unit
    assert [id(a) for a in asked[:5]] == [id(t) for t in handles[::-1]]
    assert tier.current_bytes == 0 and tier.stats.copies_in == tier.stats.copies_out == 5
    assert torch.allclose(x.grad, _reference_grad(x.detach()), rtol=0, atol=1e-15)


def _reference_grad(x):
    x = x.clone().requires_grad_(True)
    h = x * 1
    for _ in range(5):
        h = torch.exp(h * 0.1)
    h.sum().backward()
    return x.grad
