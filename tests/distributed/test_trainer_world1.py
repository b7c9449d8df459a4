"""EPPTrainer in one process (world 1, pp 1) against HF's plain ``Trainer``, plus user errors.

Same scenarios as the multi-process tests (``workers/trainer_common.py``): losses, gradient norms
and trained weights must equal the plain Trainer's on the same global batches (float64, ~1e-12),
resume must reproduce the uninterrupted run, saved checkpoints must load with ``from_pretrained``.
"""
from __future__ import annotations

import os
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("datasets")

from infinipipe_hf import EPPTrainer, EPPTrainingArguments  # noqa: E402
from tests.distributed.workers.trainer_common import (  # noqa: E402
    GA_RTOL,
    LOSS_RTOL,
    SCENARIOS,
    assert_close_list,
    assert_weights_match,
    epp_trainer,
    load_reference,
    per_step,
    reference_run,
    slicing_planner,
    stage_state,
    token_dataset,
)

PLANNERS = {"slicing": slicing_planner, "default": None}


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("trainer_refs")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for scn in SCENARIOS.values():
            reference_run(scn, str(d))
    return str(d)


def _planner(kind):
    return PLANNERS[kind]


@pytest.mark.parametrize("kind", ["slicing", "default"])
@pytest.mark.parametrize("name", ["base", "tied", "ga2", "lora"])
def test_world1_matches_plain_trainer(ref_dir, tmp_path, name, kind):
    scn = SCENARIOS[name]
    ref, ref_w = load_reference(ref_dir, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = epp_trainer(scn, str(tmp_path), 1, eval_set=True, planner=_planner(kind))
        tr.train()
        ev = tr.evaluate()["eval_loss"]
    rtol = GA_RTOL if scn.grad_accum > 1 else LOSS_RTOL
    assert_close_list(per_step(tr, scn), ref["losses"], "losses", rtol)
    norms = [h["grad_norm"] for h in tr.state.log_history if "grad_norm" in h]
    assert_close_list(norms, ref["grad_norms"], "grad norms", max(rtol, 1e-9))
    assert_weights_match(stage_state(tr), ref_w, "weights", rtol)
    assert ev == pytest.approx(ref["eval_loss"], rel=rtol)
    logged = [h for h in tr.state.log_history if "loss" in h]
    assert len(logged) == scn.max_steps and all(h["tokens_per_s"] > 0 for h in logged)
    assert tr.plan_ahead.hits == scn.max_steps * scn.grad_accum  # every plan computed ahead
    assert tr.plan_ahead.in_process == (kind == "default")  # the default planner in its own process
    if kind == "default":
        assert all("bubble_fraction" in h and "planned_peak_memory_gib_stage0" in h for h in logged)


def test_world1_resume_is_exact_and_checkpoint_loads(ref_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    scn = SCENARIOS["tied"]
    ref, ref_w = load_reference(ref_dir, "tied")
    out = str(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = epp_trainer(scn, out, 1, planner=slicing_planner, save_strategy="steps", save_steps=2)
        a.train()
        b = epp_trainer(scn, out, 1, planner=slicing_planner)
        b.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    assert_close_list(per_step(b, scn), per_step(a, scn)[2:], "resumed losses", 1e-12)
    assert_close_list(per_step(a, scn), ref["losses"], "uninterrupted losses")
    ckpt = os.path.join(out, "checkpoint-2")
    assert {"model.safetensors", "config.json", "optimizer.stage0.pt", "scheduler.pt", "rng_state.pth",
            "trainer_state.json", "epp_layout.json"} <= set(os.listdir(ckpt))
    b.save_model(os.path.join(out, "final"))
    loaded = AutoModelForCausalLM.from_pretrained(os.path.join(out, "final"), dtype=torch.float64)
    assert loaded.config._attn_implementation == "sdpa"
    assert_weights_match(loaded.state_dict(), ref_w, "from_pretrained weights")
    # a resume with another layer split is refused with the split to use
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = epp_trainer(scn, out, 1, planner=slicing_planner)
    c.engine.layers_per_stage = [3, 1]
    with pytest.raises(ValueError, match="resume with the same pp_degree"):
        c._load_from_checkpoint(ckpt)


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_steps=1, disable_tqdm=True)
    return EPPTrainingArguments(**{**base, **kw})


def _model(num_layers=4):
    from tests.helpers.reference import tiny_model

    return tiny_model("llama", num_layers=num_layers)


def test_pp_degree_larger_than_layers_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"pp_degree=5 is larger than the model's 4 decoder layers.*<= 4"):
        EPPTrainer(model=_model(), args=_args(tmp_path, pp_degree=5), train_dataset=token_dataset())


def test_pp_degree_not_dividing_processes_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"pp_degree=2 does not divide world size 1 \(the processes launched\)"):
        EPPTrainer(model=_model(), args=_args(tmp_path, pp_degree=2), train_dataset=token_dataset())


def test_sp_degree_not_dividing_processes_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"pp_degree=1 x sp_degree=2 = 2 does not divide world size 1 .*"
                                         r"sp_degree in \[1\]"):
        EPPTrainer(model=_model(), args=_args(tmp_path, pp_degree=1, sp_degree=2), train_dataset=token_dataset())


def test_dataset_without_token_ids_is_a_clear_error(tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"prompt": ["hi"], "score": [1.0]})
    with pytest.raises(ValueError, match=r"train_dataset has columns \['prompt', 'score'\]"):
        EPPTrainer(model=_model(), args=_args(tmp_path), train_dataset=ds)


def test_plain_training_arguments_are_refused(tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="EPPTrainingArguments"):
        EPPTrainer(model=_model(), args=args, train_dataset=token_dataset())


def test_argument_conflicts_warn_or_raise(tmp_path):
    with pytest.warns(UserWarning, match="per_device_train_batch_size=4 is ignored.*tokens_per_step=128"):
        a = _args(tmp_path, per_device_train_batch_size=4, tokens_per_step=128)
    assert a.per_device_train_batch_size == 1 and a.tokens_per_step == 128
    with pytest.warns(UserWarning, match="gradient_checkpointing=True is ignored.*checkpointing='full'"):
        a = _args(tmp_path, gradient_checkpointing=True)
    assert a.activation_checkpointing is False and a.checkpointing == "adaptive"
    with pytest.raises(ValueError, match="fp16=True is not supported.*bf16"):
        _args(tmp_path, fp16=True)
    with pytest.raises(ValueError, match="tokens_per_step must be an integer >= 2"):
        _args(tmp_path, tokens_per_step=1)
    with pytest.raises(ValueError, match="long_document_policy='cut' is not known"):
        _args(tmp_path, long_document_policy="cut")
    with pytest.raises(ValueError, match="epp_schedule='1f1b' is not known"):
        _args(tmp_path, epp_schedule="1f1b")
    cfg = _args(tmp_path, pp_degree=2, epp_schedule="seq1f1b", checkpointing="full",
                memory_budget_gib=40.0, max_tokens_per_unit=2048).to_infinipipe_config()
    assert (cfg.pp_degree, cfg.schedule, cfg.checkpointing, cfg.memory_budget_gib,
            cfg.max_tokens_per_unit) == (2, "seq1f1b", "full", 40.0, 2048)


def test_ignored_collator_warns(tmp_path):
    from transformers import default_data_collator

    with pytest.warns(UserWarning, match="data_collator=function is ignored"):
        EPPTrainer(model=_model(), args=_args(tmp_path), train_dataset=token_dataset(),
                   data_collator=default_data_collator)


def test_bf16_on_cpu_warns_casts_the_stage_and_trains(tmp_path):
    with pytest.warns(UserWarning, match="bf16=True on CPU"):
        tr = EPPTrainer(model=_model(), args=_args(tmp_path, bf16=True, max_steps=2, logging_steps=1, tokens_per_step=64),
                        train_dataset=token_dataset(), planner=slicing_planner)
    assert tr.engine.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in tr.engine.parameters())
    tr.train()
    losses = [h["loss"] for h in tr.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(0 < x < 10 for x in losses)


def test_mfu_is_logged_from_peak_tflops(tmp_path):
    from infinipipe_hf.trainer.model_setup import count_parameters

    model = _model()
    n_params = count_parameters(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tr = EPPTrainer(model=model, args=_args(tmp_path, peak_tflops=1e-3, max_steps=2, logging_steps=1,
                                                 tokens_per_step=64),
                        train_dataset=token_dataset(), planner=slicing_planner)
        tr.train()
    for h in (h for h in tr.state.log_history if "loss" in h):
        # mfu = 6 * params * tokens/s / peak, with the same window as tokens_per_s
        assert h["mfu"] == pytest.approx(6 * n_params * h["tokens_per_s"] / 1e9, rel=1e-9)
