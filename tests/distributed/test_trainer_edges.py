"""EPPTrainer (one process) in the cases where a new user could get a silently wrong result.

Each case is compared with an independent computation: the unsplit float64 model on the same
tokens (``tests/helpers/reference.py``) or HF's own ``Trainer``.
"""
from __future__ import annotations

import math
import warnings

import pytest

torch = pytest.importorskip("torch")
datasets = pytest.importorskip("datasets")

from infinipipe_hf import EPPTrainer, EPPTrainingArguments  # noqa: E402
from tests.distributed.workers.trainer_common import (  # noqa: E402
    SCENARIOS,
    RecordingEPPTrainer,
    _padded_loader,
    assert_close_list,
    assert_weights_match,
    epp_trainer,
    make_model,
    slicing_planner,
    stage_state,
    token_dataset,
    trainable_state,
)
from tests.helpers.reference import reference_loss_and_grads, tiny_model  # noqa: E402


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1, disable_tqdm=True,
                logging_steps=1, save_strategy="no", learning_rate=0.0, seed=0)
    return EPPTrainingArguments(**{**base, **kw})


def _quiet(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


def _model():
    m = tiny_model("llama", num_layers=2, seed=3)
    m.config._attn_implementation = "sdpa"
    return m


# --- loss masks from TRL's mask columns ----------------------------------------------------------
@pytest.mark.parametrize("column", ["completion_mask", "assistant_masks"])
def test_mask_column_without_labels_trains_only_the_masked_tokens(tmp_path, column):
    ids = token_dataset(with_labels=False)["input_ids"]
    masks = [[0] * min(4, len(x)) + [1] * max(len(x) - 4, 0) for x in ids]
    ds = datasets.Dataset.from_dict({"input_ids": ids, column: masks})
    tr = _quiet(lambda: RecordingEPPTrainer(model=_model(), args=_args(tmp_path, tokens_per_step=4096),
                                            train_dataset=ds, planner=slicing_planner))
    (batch,) = list(tr.get_train_dataloader())  # the whole dataset in one global batch
    for item in batch:
        ids_i = item["input_ids"]
        k = ids.index(ids_i)
        assert item["labels"] == [t if m else -100 for t, m in zip(ids_i, masks[k])]
    _quiet(tr.train)
    want, _ = reference_loss_and_grads(_model(), batch)
    everything, _ = reference_loss_and_grads(_model(), [{"input_ids": x["input_ids"]} for x in batch])
    assert tr.micro_losses[0] == pytest.approx(want, rel=1e-10)
    assert abs(want - everything) > 1e-3  # the mask matters: not the all-token loss


def test_labels_win_over_a_mask_column_with_a_warning(tmp_path):
    ds = token_dataset().add_column("completion_mask", [[1] * len(x) for x in token_dataset()["input_ids"]])
    with pytest.warns(UserWarning, match="'labels' column and completion_mask.*completion_mask is ignored"):
        EPPTrainer(model=_model(), args=_args(tmp_path), train_dataset=ds, planner=slicing_planner)


# --- label smoothing ------------------------------------------------------------------------------
def test_label_smoothing_equals_hf_trainer(tmp_path):
    """``label_smoothing_factor`` is applied, as HF's Trainer applies it (its LabelSmoother)."""
    from transformers import Trainer, TrainingArguments

    scn = SCENARIOS["base"]
    dataset = token_dataset(with_labels=scn.labels)
    ref_losses: list[float] = []

    class RefTrainer(Trainer):
        def get_train_dataloader(self):
            return _padded_loader(scn, dataset)

        def training_step(self, *a, **kw):
            loss = super().training_step(*a, **kw)
            ref_losses.append(float(loss))
            return loss

    ref_model = make_model(scn)
    args = TrainingArguments(output_dir=str(tmp_path / "ref"), save_strategy="no", label_smoothing_factor=0.1,
                             **scn.train_kwargs())
    _quiet(RefTrainer(model=ref_model, args=args).train)
    tr = _quiet(lambda: epp_trainer(scn, str(tmp_path / "epp"), 1, planner=slicing_planner,
                                    label_smoothing_factor=0.1))
    assert tr.engine.config.label_smoothing == 0.1
    _quiet(tr.train)
    # HF sums the smoothing term in float32: agreement to float32 resolution.
    assert_close_list(tr.micro_losses, ref_losses, "smoothed losses", 1e-6)
    assert_weights_match(stage_state(tr), trainable_state(ref_model), "weights", 1e-5)
    plain = _quiet(lambda: epp_trainer(scn, str(tmp_path / "plain"), 1, planner=slicing_planner))
    _quiet(plain.train)
    assert abs(plain.micro_losses[0] - tr.micro_losses[0]) > 5e-4  # 100x the tolerance above


# --- a step without label tokens ------------------------------------------------------------------
def _half_masked_dataset():
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(0, 97, (30,), generator=g).tolist() for _ in range(2))
    return datasets.Dataset.from_dict({"input_ids": [a, b], "labels": [[-100] * 30, b]}), b


@pytest.mark.parametrize("logging_steps", [1, 2])
def test_a_label_free_step_is_left_out_of_the_logged_loss(tmp_path, logging_steps):
    ds, b = _half_masked_dataset()
    args = _args(tmp_path, tokens_per_step=32, max_steps=2, logging_steps=logging_steps)
    tr = RecordingEPPTrainer(model=_model(), args=args, train_dataset=ds, planner=slicing_planner)
    with pytest.warns(UserWarning, match="no label tokens.*left out of the logged loss"):
        out = tr.train()
    want, _ = reference_loss_and_grads(_model(), [{"input_ids": b}])  # lr 0: weights never change
    logs = [h for h in tr.state.log_history if "loss" in h]
    if logging_steps == 1:
        assert sorted(h.get("skipped_steps", 0) for h in logs) == [0, 1]
        assert any(math.isnan(h["loss"]) for h in logs)  # nothing trained: no loss, not 0.0
        trained = [h["loss"] for h in logs if not math.isnan(h["loss"])]
    else:
        assert len(logs) == 1 and logs[0]["skipped_steps"] == 1
        trained = [logs[0]["loss"]]
    assert trained == [pytest.approx(want, rel=1e-6)]  # not want / 2
    assert out.training_loss == pytest.approx(want, rel=1e-6)
    assert tr.state.log_history[-1]["train_loss"] == pytest.approx(want, rel=1e-6)


# --- documents over the length limit ----------------------------------------------------------------
def test_long_documents_are_reported_and_the_reject_message_names_the_binding_limit(tmp_path):
    model = _model()
    model.config.max_position_embeddings = 32
    ds = token_dataset()  # longest document: 90 tokens
    tr = _quiet(lambda: EPPTrainer(model=model, args=_args(tmp_path, tokens_per_step=64),
                                   train_dataset=ds, planner=slicing_planner))
    with pytest.warns(UserWarning, match=r"3 of 17 documents \(167 of 343 tokens\) are longer than "
                                         r"max_position_embeddings=32 and are trained as 7 independent pieces"):
        tr.get_train_dataloader()
    for tokens, name in ((64, "max_position_embeddings=32"), (16, "tokens_per_step=16")):
        m = _model()
        m.config.max_position_embeddings = 32
        tr = _quiet(lambda: EPPTrainer(model=m, args=_args(tmp_path, tokens_per_step=tokens,
                                                           long_document_policy="reject"),
                                       train_dataset=ds, planner=slicing_planner))
        with pytest.raises(ValueError, match=rf"more than {name} \(the binding length limit\)"):
            _quiet(tr.get_train_dataloader)


# --- throughput of the global batch ----------------------------------------------------------------
def test_train_samples_per_second_counts_the_global_batches(tmp_path):
    tr = _quiet(lambda: EPPTrainer(model=_model(), args=_args(tmp_path, tokens_per_step=64, max_steps=3),
                                   train_dataset=token_dataset(), planner=slicing_planner))
    batches = _quiet(lambda: list(tr.get_train_dataloader()))
    out = _quiet(tr.train)
    trained = batches[:3]  # the loader is deterministic per epoch: the same first three batches
    seqs, tokens = sum(len(b) for b in trained), sum(len(x["input_ids"]) for b in trained for x in b)
    m = out.metrics
    assert m["train_samples_per_second"] * m["train_runtime"] == pytest.approx(seqs, rel=2e-2)
    assert m["train_tokens_per_second"] * m["train_runtime"] == pytest.approx(tokens, rel=2e-2)
    assert seqs > 3  # HF's own figure would be one sample per step


# --- every pipeline setting reaches the engine ---------------------------------------------------
def test_pipeline_settings_reach_the_engine(tmp_path):
    args = _args(tmp_path, attention_backend="sdpa", num_slices=[3], loss_chunk_tokens=7,
                 memory_reserve_gib=1.5, seed_plan_on_rank0=True, ddp_timeout=321)
    tr = EPPTrainer(model=_model(), args=args, train_dataset=token_dataset())
    cfg = tr.engine.config
    assert (cfg.attention_backend, cfg.num_slices, cfg.loss_chunk_tokens, cfg.memory_reserve_gib,
            cfg.seed_plan_on_rank0, cfg.p2p_timeout_s) == ("sdpa", [3], 7, 1.5, True, 321.0)
    assert tr.engine.runner.loss_chunk_tokens == 7 and tr.plan_ahead.enabled is False
    assert tr.engine.layout.timeout_setting.startswith("ddp_timeout")  # what timeout errors name


# --- datasets with nothing to train on fail at construction ----------------------------------------
def test_empty_or_trivial_text_dataset_fails_at_construction(tmp_path):
    from tests.helpers.char_tokenizer import char_tokenizer

    tok = char_tokenizer()
    with pytest.raises(ValueError, match=r"train_dataset is empty \(0 examples\)"):
        EPPTrainer(model=_model(), args=_args(tmp_path), processing_class=tok,
                   train_dataset=datasets.Dataset.from_dict({"text": []}))
    with pytest.raises(ValueError, match="no document of 2 or more tokens"):
        EPPTrainer(model=_model(), args=_args(tmp_path), processing_class=tok,
                   train_dataset=datasets.Dataset.from_dict({"text": ["", ""]}))
