"""Evaluation through the pipeline: the loss, TRL's token metrics, and what ``predict`` returns.

Design: logits never leave the last stage (its chunked loss builds them a chunk of label tokens at
a time), so evaluation returns metrics, not predictions.  Besides the mean token loss, with
``token_metrics`` (``EPPSFTTrainer``) it reports TRL's ``mean_token_accuracy`` (top-1 prediction,
first maximum, equal to the label) and ``entropy`` (of the predicted distribution), both over
label tokens and in float32 as TRL's fused LM head computes them: one value per global batch,
averaged over the batches as TRL averages its per-batch values.  They come from the chunks the
loss computes anyway: a forward hook on the last stage's LM head sees each chunk's logits, and the
runner's ``forward_only`` is wrapped so the hook knows whose labels (in order) a chunk holds.
The last-stage ranks' sums are added up with one all-reduce per batch.

``predict`` cannot return logits; it refuses unless ``prediction_loss_only=True`` and then
returns the loss and metrics with ``predictions=None``.
"""
from __future__ import annotations

import torch
from transformers.trainer_utils import EvalLoopOutput

from infinipipe_hf.trainer.batches.loader import label_token_count

PREDICT_REFUSAL = (
    "EPPTrainer.predict() cannot return predictions: the logits of a pipelined model exist only "
    "inside the last stage's chunked loss, a chunk at a time, and are never gathered; set "
    "prediction_loss_only=True (EPPTrainingArguments) to get the loss and metrics "
    "(PredictionOutput.predictions is then None), or run the saved model with from_pretrained "
    "for logits")


class TokenStatistics:
    """Entropy and top-1 hits of every label token the last stage evaluates (context manager)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.sums = torch.zeros(3, dtype=torch.float64)  # entropy, top-1 hits, label tokens
        self._labels: torch.Tensor | None = None
        self._offset = 0
        self._handle = None

    def __enter__(self) -> "TokenStatistics":
        stage, runner = self.engine.stage, self.engine.runner
        if stage.is_last:
            original = runner.forward_only

            def forward_only(unit_id, hidden_in):
                labels = runner.unit_tensors(unit_id).labels.reshape(-1)
                self._labels, self._offset = labels[labels != -100], 0
                try:
                    return original(unit_id, hidden_in)
                finally:
                    self._labels = None

            runner.forward_only = forward_only
            self._handle = stage.lm_head.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
            del self.engine.runner.forward_only  # back to the class's method

    def _hook(self, module, inputs, output) -> None:
        if self._labels is None or torch.is_grad_enabled():
            return
        logits = output.reshape(-1, output.shape[-1]).float()
        y = self._labels[self._offset:self._offset + logits.shape[0]].to(logits.device)
        self._offset += logits.shape[0]
        logp = torch.log_softmax(logits, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        hits = (logits.argmax(dim=-1) == y).sum()
        self.sums += torch.stack([entropy.sum().double().cpu(), hits.double().cpu(),
                                  torch.tensor(float(y.numel()), dtype=torch.float64)])

    def take(self, step: int) -> tuple[float, float]:
        """``(entropy, mean_token_accuracy)`` of the batch since the last call, over all ranks."""
        sums = [self.engine.grad_sync.global_sum(float(v), "token metrics", step) for v in self.sums]
        self.sums.zero_()
        n = sums[2]
        return (sums[0] / n, sums[1] / n) if n > 0 else (0.0, 0.0)


def evaluate_loop(trainer, dataloader, description: str, metric_key_prefix: str,
                  token_metrics: bool) -> EvalLoopOutput:
    """Mean token loss over every label token of the dataset (and TRL's token metrics)."""
    engine = trainer.engine
    loss_sum, labels, samples = 0.0, 0, 0
    entropies, accuracies = [], []
    with TokenStatistics(engine) if token_metrics else _nothing() as stats:
        for batch in dataloader:
            samples += len(batch)
            n = label_token_count(batch)
            if not n:
                continue
            loss_sum += engine.eval_step(batch) * n
            labels += n
            if stats is not None:
                entropy, accuracy = stats.take(engine.step_count)
                entropies.append(entropy)
                accuracies.append(accuracy)
    if labels == 0:
        raise ValueError(f"{description}: the dataset has no label tokens; nothing to evaluate")
    metrics = {f"{metric_key_prefix}_loss": loss_sum / labels}
    if token_metrics:
        metrics[f"{metric_key_prefix}_entropy"] = sum(entropies) / len(entropies)
        metrics[f"{metric_key_prefix}_mean_token_accuracy"] = sum(accuracies) / len(accuracies)
        metrics[f"{metric_key_prefix}_num_tokens"] = float(trainer.num_tokens_trained)
    return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=samples)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc) -> None:
        return None
