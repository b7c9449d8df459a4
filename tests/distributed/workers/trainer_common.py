"""Shared pieces of the trainer tests: scenarios, tiny data, the plain-``Trainer`` reference.

The reference is HF's own ``Trainer`` (one process) fed the *same* global batches the
``EPPTrainer`` sampler yields (same loader, same epochs), padded on the right with labels -100 on
padding, so its loss is the mean token loss of the batch.  Its loss function is HF's causal-LM
loss computed in float64 (``ForCausalLMLoss`` upcasts to float32 only, which would cap the
comparison at ~1e-7).  References are computed once in the test process and written to a folder
the distributed workers read, because a ``Trainer`` inside a torchrun process would go
distributed itself.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

from infinipipe_hf.trainer.arguments import EPPTrainingArguments
from infinipipe_hf.trainer.batches.loader import GlobalBatchCollator, build_global_batch_loader
from infinipipe_hf.trainer.trainer import EPPTrainer
from tests.helpers.reference import tiny_model

VOCAB = 97
LENGTHS = [37, 11, 8, 5, 23, 6, 40, 3, 17, 9, 29, 14, 1, 31, 12, 7, 90]
LONG_LENGTHS = [150, 130, 70, 66, 100, 20, 9, 45, 12]
"""Documents mostly longer than ``tokens_per_step`` (64): full-size pieces, each longer than a DP
replica's share, so every replica of a step gets pieces of its own."""
EVAL_LENGTHS = [13, 21, 6, 30]
LOSS_RTOL = 1e-10
# Gradient accumulation divides every batch's loss by the label count of all accumulated
# batches (HF's num_items_in_batch), exactly as the reference Trainer does: same precision.
GA_RTOL = LOSS_RTOL


@dataclass(frozen=True)
class Scenario:
    """One training configuration run by both the reference Trainer and EPPTrainer."""

    name: str
    tie: bool = False
    lora: bool = False
    max_steps: int = 4
    grad_accum: int = 1
    tokens_per_step: int = 64
    lr: float = 2e-3
    labels: bool = True
    """Dataset carries a ``labels`` column with a masked prefix (SFT-like)."""
    num_layers: int = 4
    lengths: tuple[int, ...] = tuple(LENGTHS)
    """Document lengths of the training set."""
    extra: dict = field(default_factory=dict)
    """Further ``TrainingArguments`` shared by both runs."""

    def train_kwargs(self) -> dict:
        return dict(max_steps=self.max_steps, gradient_accumulation_steps=self.grad_accum,
                    learning_rate=self.lr, max_grad_norm=0.5, lr_scheduler_type="linear",
                    weight_decay=0.01, logging_steps=1, seed=42, report_to=[],
                    disable_tqdm=True, use_cpu=True, **self.extra)


SCENARIOS = {s.name: s for s in [
    Scenario("base"),
    Scenario("tied", tie=True),
    # SGD: Adam's m/sqrt(v) turns the ~1e-7 gradient differences of near-zero entries into
    # O(lr) weight differences (see GA_RTOL); with SGD a wrong weighting still shows as O(1).
    Scenario("ga2", grad_accum=2, max_steps=3, lr=0.05, extra={"optim": "sgd"}),
    Scenario("lora", lora=True, lr=2e-2),
    Scenario("long_docs", lengths=tuple(LONG_LENGTHS)),
]}


def slicing_planner(lengths, engine, slice_tokens: int = 20):
    """A plan independent of the default planner: one unit per sequence, sequences longer than
    ``slice_tokens`` cut into slices (exercises the KV store), sequences dealt to DP replicas in
    turn, 1F1B order (``tests/distributed/plans.py``)."""
    from tests.distributed.plans import make_plan

    dp = engine.layout.dp_degree
    units = [[] for _ in range(dp)]
    for i, n in enumerate(lengths):
        cuts = list(range(0, n, slice_tokens)) + [n]
        units[i % dp].extend([[(i, a, b)] for a, b in zip(cuts[:-1], cuts[1:])])
    return make_plan(lengths, units, engine.layout.pp_degree, engine.layers_per_stage,
                     checkpoint=lambda stage, unit, layers: unit % (layers + 1))


def token_dataset(lengths=LENGTHS, seed: int = 5, with_labels: bool = True):
    import datasets

    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    cols = {"input_ids": ids}
    if with_labels:  # mask a prompt-like prefix, as SFT data does
        cols["labels"] = [[-100] * min(3, len(x)) + x[3:] for x in ids]
    return datasets.Dataset.from_dict(cols)


def make_model(scn: Scenario):
    m = tiny_model("llama", seed=0, num_layers=scn.num_layers, tie=scn.tie)
    m.config._attn_implementation = "sdpa"  # eager attention runs its softmax in float32
    if scn.lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        m = get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                         lora_dropout=0.0, init_lora_weights=False))
    return m


def float64_causal_lm_loss(outputs, labels, num_items_in_batch=None):
    logits = outputs.logits.double()
    shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1])
    shift_labels = labels[:, 1:].reshape(-1).to(logits.device)
    loss = torch.nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum")
    n = num_items_in_batch if num_items_in_batch is not None else (shift_labels != -100).sum()
    return loss / n


def pad_batch(batch: list[dict]) -> dict[str, torch.Tensor]:
    width = max(len(x["input_ids"]) for x in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for i, x in enumerate(batch):
        n = len(x["input_ids"])
        ids[i, :n] = torch.tensor(x["input_ids"])
        mask[i, :n] = 1
        labels[i, :n] = torch.tensor(x.get("labels", x["input_ids"]))
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _padded_loader(scn: Scenario, dataset, dp_degree: int = 1):
    """The global batches EPPTrainer forms for ``dp_degree`` replicas, padded for one process."""
    collate = GlobalBatchCollator()
    loader = build_global_batch_loader(dataset, tokens_per_step=scn.tokens_per_step, max_length=4096,
                                       seed=42, shuffle=True, dp_degree=dp_degree)
    loader.collate_fn = lambda items: pad_batch(collate(items))
    return loader


def trainable_state(model) -> dict[str, torch.Tensor]:
    """Trained tensors under HF names: the full state, or PEFT's adapter state dict."""
    from infinipipe_hf.trainer.model_setup import is_peft_model

    if is_peft_model(model):
        from peft.utils import get_peft_model_state_dict

        return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_name(name: str, dp_degree: int = 1) -> str:
    """File stem of a scenario's reference for the batches of ``dp_degree`` replicas."""
    return name if dp_degree == 1 else f"{name}.dp{dp_degree}"


def reference_run(scn: Scenario, out_dir: str, dp_degrees=(1,)) -> dict:
    """HF's plain Trainer on the global batches of each DP degree (the sampler feeds every
    replica, so the batches depend on it); returns the first degree's result."""
    return [_reference_run(scn, out_dir, dp) for dp in dp_degrees][0]


def _reference_run(scn: Scenario, out_dir: str, dp_degree: int) -> dict:
    """Train with HF's plain Trainer; write ``<name>[.dpN].json`` (exact losses) and weights."""
    from safetensors.torch import save_file
    from transformers import Trainer, TrainingArguments

    dataset = token_dataset(scn.lengths, with_labels=scn.labels)
    losses: list[float] = []

    class RefTrainer(Trainer):
        def get_train_dataloader(self):
            return _padded_loader(scn, dataset, dp_degree)

        def training_step(self, *a, **kw):
            loss = super().training_step(*a, **kw)
            losses.append(float(loss))
            return loss

    model = make_model(scn)
    stem = reference_name(scn.name, dp_degree)
    args = TrainingArguments(output_dir=os.path.join(out_dir, f"ref_{stem}"), save_strategy="no",
                             **scn.train_kwargs())
    trainer = RefTrainer(model=model, args=args, compute_loss_func=float64_causal_lm_loss)
    trainer.train()
    per_step = [sum(losses[i:i + scn.grad_accum]) for i in range(0, len(losses), scn.grad_accum)]
    eval_loss = _direct_eval_loss(model)
    save_file({k: v.contiguous() for k, v in trainable_state(model).items()},
              os.path.join(out_dir, f"{stem}.safetensors"))
    result = {"losses": per_step, "micro_losses": losses, "eval_loss": eval_loss,
              "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]}
    with open(os.path.join(out_dir, f"{stem}.json"), "w") as fh:
        json.dump(result, fh)
    return result


@torch.no_grad()
def _direct_eval_loss(model) -> float:
    """Mean token loss of the unsplit model over the whole eval set (float64, no batching)."""
    total, count = 0.0, 0
    for item in token_dataset(EVAL_LENGTHS, seed=9, with_labels=False):
        ids = torch.tensor(item["input_ids"]).unsqueeze(0)
        logits = model(input_ids=ids).logits[0, :-1].double()
        total += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
    return total / count


def load_reference(ref_dir: str, name: str, dp_degree: int = 1) -> tuple[dict, dict[str, torch.Tensor]]:
    """A scenario's reference for a run of ``dp_degree`` replicas (``reference_run``)."""
    from safetensors.torch import load_file

    stem = reference_name(name, dp_degree)
    with open(os.path.join(ref_dir, f"{stem}.json")) as fh:
        result = json.load(fh)
    return result, load_file(os.path.join(ref_dir, f"{stem}.safetensors"))


def dp_of(pp: int, sp: int = 1) -> int:
    """The DP degree of a ``pp x sp`` layout over this job's processes (the launcher's world:
    the trainer starts the process group later)."""
    return int(os.environ.get("WORLD_SIZE", "1")) // (pp * sp)


class RecordingEPPTrainer(EPPTrainer):
    """Records the exact (float64) loss of every micro-batch."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.micro_losses: list[float] = []

    def training_step(self, *a, **kw):
        loss = super().training_step(*a, **kw)
        self.micro_losses.append(float(loss))
        return loss


def epp_trainer(scn: Scenario, out_dir: str, pp: int, *, eval_set: bool = False, planner=None, **over):
    kw = {**scn.train_kwargs(), "save_strategy": "no", **over}
    args = EPPTrainingArguments(output_dir=out_dir, pp_degree=pp, tokens_per_step=scn.tokens_per_step,
                                **kw)
    evald = token_dataset(EVAL_LENGTHS, seed=9, with_labels=False) if eval_set else None
    return RecordingEPPTrainer(model=make_model(scn), args=args,
                               train_dataset=token_dataset(scn.lengths, with_labels=scn.labels), eval_dataset=evald,
                               planner=planner)


def per_step(trainer, scn: Scenario) -> list[float]:
    m = trainer.micro_losses
    return [sum(m[i:i + scn.grad_accum]) for i in range(0, len(m), scn.grad_accum)]


def assert_close_list(got, want, what: str, rtol: float = LOSS_RTOL) -> float:
    assert len(got) == len(want), f"{what}: {len(got)} values, want {len(want)}"
    worst = 0.0
    for i, (a, b) in enumerate(zip(got, want)):
        err = abs(a - b) / max(abs(b), 1e-30)
        assert err <= rtol, f"{what}[{i}]: got {a!r}, want {b!r} (rel err {err:.2e})"
        worst = max(worst, err)
    return worst


def stage_state(trainer) -> dict[str, torch.Tensor]:
    """This rank's trained tensors under the names ``trainable_state`` uses."""
    if trainer.is_peft:
        from peft.utils import get_peft_model_state_dict

        return dict(get_peft_model_state_dict(trainer.model))
    return dict(trainer.engine.stage.state_dict())


def assert_weights_match(got: dict, want: dict, what: str, rtol: float = LOSS_RTOL) -> float:
    assert got, f"{what}: no tensors"
    worst = 0.0
    for name, g in got.items():
        assert name in want, f"{what}: {name} not in the reference"
        w = want[name].to(g.dtype)
        err = (g.detach().cpu() - w).abs().max().item()
        scale = max(w.abs().max().item(), 1e-30)
        assert err <= rtol * scale + 1e-14, f"{what}: {name} max abs err {err:.3e} (scale {scale:.3e})"
        worst = max(worst, err / scale)
    return worst


__all__ = ["SCENARIOS", "Scenario", "reference_run", "load_reference", "dp_of", "epp_trainer",
           "per_step", "assert_close_list", "assert_weights_match", "stage_state", "token_dataset",
           "make_model", "trainable_state", "EVAL_LENGTHS"]
