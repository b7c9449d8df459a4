"""EPPSFTTrainer's evaluation reports TRL's metrics, equal to SFTTrainer's on the same data, and
``predict`` returns the loss or refuses naming ``prediction_loss_only``.

The reference is TRL's own ``SFTTrainer`` trained and evaluated on the same single batch (the
whole dataset: ``per_device_*_batch_size = len(dataset)`` there, a token budget above the
dataset here), so TRL's per-batch means and ours are over the same tokens.
"""
from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

from tests.helpers import sft  # noqa: E402

# TRL computes its loss and metrics in float32 (fused LM head); ours are float64 losses and
# float32 metrics: agreement at float32 resolution.
RTOL = 2e-6


def _trl(kind: str, out_dir: str):
    from trl import SFTConfig, SFTTrainer

    ds, over = sft.dataset(kind)
    args = SFTConfig(output_dir=out_dir, per_device_train_batch_size=len(ds),
                     per_device_eval_batch_size=len(ds), **sft.common_args(max_steps=2, **over))
    tr = SFTTrainer(model=sft.tiny_model(), args=args, train_dataset=ds, eval_dataset=ds,
                    processing_class=sft.tokenizer())
    tr.train()
    return tr.evaluate()


def _epp(kind: str, out_dir: str):
    ds, _ = sft.dataset(kind)
    tr = sft.epp_sft(kind, out_dir, max_steps=2)
    tr.train()
    return tr.evaluate(ds)


@pytest.mark.parametrize("kind", ["prompt_completion", "messages_assistant_only"])
def test_eval_metrics_equal_trl(kind, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = _trl(kind, str(tmp_path / "trl"))
        got = _epp(kind, str(tmp_path / "epp"))
    for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"):
        assert key in got, sorted(got)
        assert got[key] == pytest.approx(want[key], rel=RTOL, abs=1e-9), (key, got[key], want[key])
    assert got["eval_num_tokens"] == want["eval_num_tokens"] > 0
    assert 0.0 < got["eval_entropy"] and 0.0 <= got["eval_mean_token_accuracy"] <= 1.0


def test_predict_refuses_naming_prediction_loss_only_or_returns_the_loss(tmp_path):
    ds, _ = sft.dataset("text")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = sft.epp_sft("text", str(tmp_path / "a"), max_steps=1)
        with pytest.raises(ValueError, match=r"cannot return predictions.*prediction_loss_only=True"):
            tr.predict(ds)
        tr = sft.epp_sft("text", str(tmp_path / "b"), max_steps=1, prediction_loss_only=True)
        out = tr.predict(ds)
    assert out.predictions is None and out.label_ids is None
    assert out.metrics["test_loss"] > 0 and "test_mean_token_accuracy" in out.metrics
    assert out.metrics["test_loss"] == pytest.approx(tr.evaluate(ds)["eval_loss"], rel=1e-12)


def test_training_chat_template_is_named_when_trl_has_none(tmp_path):
    """SmolLM2's own template has no generation markers and TRL cannot patch it: the error names
    the training template this project ships."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"not training-compatible.*TRAINING_CHAT_TEMPLATE.*smollm2_training\.jinja"):
            sft.epp_sft("messages", str(tmp_path), max_steps=1, assistant_only_loss=True)
