"""The fused cross-entropy of a loss chunk (``LogitsCrossEntropySum``) against autograd's
``cross_entropy``: loss and gradients in float64 to rounding, over several row blocks, with and
without label smoothing; in bfloat16 to its resolution."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from infinipipe_hf.runtime.stage import loss as loss_module  # noqa: E402
from infinipipe_hf.runtime.stage.loss import chunked_lm_loss  # noqa: E402

V, H, T = 37, 6, 50


def _problem(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=False).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g, dtype=torch.float64) * 3)
    hidden = torch.randn(1, T, H, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (1, T), generator=g)
    labels[0, torch.rand(T, generator=g) < 0.2] = -100
    return head, hidden, labels


def _reference(head, hidden, labels, count, eps):
    logits = head(hidden)[0]
    logits = logits.float() if logits.dtype == torch.bfloat16 else logits
    return F.cross_entropy(logits, labels[0], ignore_index=-100, reduction="sum", label_smoothing=eps) / count


@pytest.mark.parametrize("eps", [0.0, 0.2])
@pytest.mark.parametrize("block_rows, chunk", [(4, 64), (7, 9), (1024, 64)])
def test_float64_equals_autograd_cross_entropy(monkeypatch, eps, block_rows, chunk):
    monkeypatch.setattr(loss_module, "LOSS_BLOCK_ROWS", block_rows)
    head, hidden, labels = _problem(torch.float64)
    count = int((labels != -100).sum()) + 3
    got = chunked_lm_loss(head, hidden, labels, count, chunk, label_smoothing=eps)
    g_got = torch.autograd.grad(got, (hidden, head.weight))
    want = _reference(head, hidden, labels, count, eps)
    g_want = torch.autograd.grad(want, (hidden, head.weight))
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_bfloat16_matches_to_its_resolution(monkeypatch, eps):
    monkeypatch.setattr(loss_module, "LOSS_BLOCK_ROWS", 8)
    head, hidden, labels = _problem(torch.bfloat16, seed=1)
    count = int((labels != -100).sum())
    got = chunked_lm_loss(head, hidden, labels, count, 16, label_smoothing=eps)
    g_got = torch.autograd.grad(got, (hidden, head.weight))
    want = _reference(head, hidden, labels, count, eps)
    g_want = torch.autograd.grad(want, (hidden, head.weight))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for a, b in zip(g_got, g_want):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * b.float().abs().max().item())


def test_without_gradients_the_loss_is_the_same():
    head, hidden, labels = _problem(torch.float64, seed=2)
    with torch.no_grad():
        got = chunked_lm_loss(head, hidden, labels, 40, 8)
    torch.testing.assert_close(got, _reference(head, hidden, labels, 40, 0.0).detach(), rtol=1e-13, atol=0)
