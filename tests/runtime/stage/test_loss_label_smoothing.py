"""Label smoothing in the chunked loss equals HF's ``LabelSmoother`` (what ``Trainer`` applies for
``label_smoothing_factor``), for every chunk size, values and gradients."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.trainer_pt_utils import LabelSmoother  # noqa: E402

from infinipipe_hf.runtime.stage.loss import chunked_lm_loss  # noqa: E402

V, H, T = 23, 8, 19


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(H, V, bias=False, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g, dtype=torch.float64))
    hidden = torch.randn(1, T, H, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (1, T), generator=g)
    labels[0, torch.rand(T, generator=g) < 0.3] = -100
    return head, hidden, labels


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.5])
@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_chunked_label_smoothing_equals_hf_label_smoother(eps, chunk):
    head, hidden, labels = _problem()
    count = int((labels != -100).sum()) + 5  # a global count larger than this unit's (other units)
    got = chunked_lm_loss(head, hidden, labels, count, chunk, label_smoothing=eps)
    (g_got,) = torch.autograd.grad(got, hidden)
    # HF: labels are not shifted here (ours come shifted), num_items_in_batch = the global count.
    want = LabelSmoother(epsilon=eps)({"logits": head(hidden)}, labels, num_items_in_batch=count)
    (g_want,) = torch.autograd.grad(want, hidden)
    # LabelSmoother sums the smoothing term in float32: agreement to float32 resolution.
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-8)


def test_smoothing_changes_the_loss_and_bad_values_are_refused():
    head, hidden, labels = _problem(1)
    plain = chunked_lm_loss(head, hidden, labels, 10)
    smooth = chunked_lm_loss(head, hidden, labels, 10, label_smoothing=0.2)
    assert abs(plain.item() - smooth.item()) > 1e-3
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        chunked_lm_loss(head, hidden, labels, 10, label_smoothing=1.0)
