"""EPPSFTTrainer in one process against TRL's own SFTTrainer on every TRL dataset format.

For each format the tokens and loss masks EPPSFTTrainer trains on (what its loader hands the
pipeline) must equal what SFTTrainer's preparation produces, and, checked independently of TRL,
mask exactly the part the format says (the prompt, everything but the assistant replies...).
Training: the step losses and the trained weights equal a plain SFTTrainer run on the same batch
(float64 tiny Llama on SmolLM2's vocabulary, SGD), with and without LoRA.
"""
from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
datasets = pytest.importorskip("datasets")
import trl  # noqa: E402,F401  (part of the test install: a missing trl must fail, not skip)

from infinipipe_hf import EPPSFTConfig, EPPSFTTrainer  # noqa: E402
from tests.helpers import sft  # noqa: E402

# TRL's fused LM head returns float32 token log-probabilities even for a float64 model, so its
# losses (and the gradients they give) are float32-exact; ours are float64 (exact to ~1e-12
# against the unsplit model elsewhere).  The comparison is therefore at float32 resolution.
LOSS_RTOL = 2e-6
WEIGHT_RTOL, WEIGHT_ATOL = 1e-5, 1e-7


def _quiet():
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("ignore")
    return ctx


def _trl_prepared(kind: str, out_dir: str):
    from trl import SFTConfig, SFTTrainer

    ds, over = sft.dataset(kind)
    args = SFTConfig(output_dir=out_dir, per_device_train_batch_size=len(ds), **sft.common_args(**over))
    return SFTTrainer(model=sft.tiny_model(), args=args, train_dataset=ds, processing_class=sft.tokenizer())


def _loader_items(trainer) -> dict[tuple, list[int]]:
    """input_ids -> labels of every sequence EPPSFTTrainer's loader yields in one epoch."""
    items = {}
    for batch in trainer.get_train_dataloader():
        for item in batch:
            items[tuple(item["input_ids"])] = item["labels"]
    return items


def _trained_text(tok, ids, labels) -> str:
    return tok.decode([t for t, y in zip(ids, labels) if y != -100])


@pytest.mark.parametrize("kind", sft.KINDS)
def test_tokens_and_loss_masks_equal_trl(kind, tmp_path):
    ctx = _quiet()
    try:
        ref = _trl_prepared(kind, str(tmp_path / "ref"))
        epp = sft.epp_sft(kind, str(tmp_path / "epp"))
        got = _loader_items(epp)
    finally:
        ctx.__exit__(None, None, None)
    want = {tuple(r["input_ids"]): list(r["labels"]) for r in ref.train_dataset}
    assert len(want) == len(ref.train_dataset) == len(sft.dataset(kind)[0])
    assert got == want  # same token sequences, same label masks

    # Independently of TRL: which tokens each format trains.
    tok = sft.tokenizer()
    assert all(any(y != -100 for y in labels) for labels in got.values())
    if kind in ("text", "prompt_completion_full", "messages"):
        assert all(list(ids) == labels for ids, labels in got.items()), "every token trained"
    texts = {_trained_text(tok, ids, labels) for ids, labels in got.items()}
    if kind in ("prompt_completion", "pretokenized_completion_mask", "pretokenized_assistant_masks"):
        assert texts == {c + tok.eos_token for c in sft.COMPLETIONS}
    elif kind == "conversational_prompt_completion":
        assert texts == {c + "<|im_end|>\n" for c in sft.COMPLETIONS}
    elif kind == "messages_assistant_only":
        want_texts = set()
        for i in range(len(sft.PROMPTS)):
            replies = [m["content"] for m in sft._messages(i) if m["role"] == "assistant"]
            want_texts.add("".join(r + "<|im_end|>" for r in replies))
        assert texts == want_texts


@pytest.mark.parametrize("kind", ["prompt_completion", "messages_assistant_only", "text"])
def test_step_losses_and_weights_equal_sfttrainer(kind, tmp_path):
    ctx = _quiet()
    try:
        ref, ref_losses = sft.trl_reference(kind, str(tmp_path / "ref"))
        epp = sft.epp_sft(kind, str(tmp_path / "epp"))
        epp.train()
    finally:
        ctx.__exit__(None, None, None)
    assert len(ref_losses) == len(epp.micro_losses) == 3
    for a, b in zip(epp.micro_losses, ref_losses):
        assert a == pytest.approx(b, rel=LOSS_RTOL), (epp.micro_losses, ref_losses)
    assert epp.micro_losses[-1] < epp.micro_losses[0]
    ref_params = dict(ref.model.named_parameters())
    for name, p in epp.engine.named_parameters():
        torch.testing.assert_close(p, ref_params[name], rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL, msg=name)


def test_lora_peft_config_equals_sfttrainer(tmp_path):
    from peft import LoraConfig

    lora = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                init_lora_weights=False)
    ctx = _quiet()
    try:
        _, ref_losses = sft.trl_reference("prompt_completion", str(tmp_path / "ref"),
                                          peft_config=LoraConfig(**lora))
        epp = sft.epp_sft("prompt_completion", str(tmp_path / "epp"), peft_config=LoraConfig(**lora))
        epp.train()
    finally:
        ctx.__exit__(None, None, None)
    assert epp.is_peft
    assert epp.micro_losses == pytest.approx(ref_losses, rel=LOSS_RTOL)
    trainable = [n for n, p in epp.engine.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_model_id_or_path_loads_like_trl(tmp_path):
    """``model`` as a path: loaded in float32 (TRL's default), tokenizer loaded from the same path."""
    path = tmp_path / "model"
    sft.tiny_model().save_pretrained(path)
    sft.tokenizer().save_pretrained(path)
    ds, _ = sft.dataset("prompt_completion")
    args = EPPSFTConfig(output_dir=str(tmp_path / "out"), tokens_per_step=4096, **sft.common_args(1))
    ctx = _quiet()
    try:
        tr = EPPSFTTrainer(model=str(path), args=args, train_dataset=ds)
        tr.train()
    finally:
        ctx.__exit__(None, None, None)
    assert tr.engine.dtype == torch.float32
    assert tr.processing_class.eos_token == "<|im_end|>"
    assert [h["loss"] for h in tr.state.log_history if "loss" in h][0] > 0


def test_completion_mask_unused_without_completion_only_loss_warns_like_trl(tmp_path):
    """TRL applies a pre-tokenized completion_mask only with completion_only_loss=True: same here,
    but said out loud."""
    ds, _ = sft.dataset("pretokenized_completion_mask")
    args = EPPSFTConfig(output_dir=str(tmp_path), tokens_per_step=4096, **sft.common_args(1))
    with pytest.warns(UserWarning, match="completion_mask that is not applied.*completion_only_loss=True"):
        tr = EPPSFTTrainer(model=sft.tiny_model(), args=args, train_dataset=ds, processing_class=sft.tokenizer())
    assert all(list(r["input_ids"]) == list(r["labels"]) for r in tr.train_dataset)


def test_unsupported_settings_are_refused_or_warned(tmp_path):
    ds, _ = sft.dataset("prompt_completion")
    tok, model = sft.tokenizer(), sft.tiny_model()

    def args(**kw):
        return EPPSFTConfig(output_dir=str(tmp_path), tokens_per_step=4096, **{**sft.common_args(1), **kw})

    with pytest.raises(ValueError, match="loss_type='dft' is not supported"):
        EPPSFTTrainer(model=model, args=args(loss_type="dft"), train_dataset=ds, processing_class=tok)
    with pytest.raises(ValueError, match="compute_loss_func is not supported"):
        EPPSFTTrainer(model=model, args=args(), train_dataset=ds, processing_class=tok,
                      compute_loss_func=lambda *a, **k: 0)
    with pytest.raises(ValueError, match="assistant_only_loss=True needs a conversational dataset"):
        EPPSFTTrainer(model=model, args=args(assistant_only_loss=True), train_dataset=ds, processing_class=tok)
    with pytest.raises(ValueError, match="IterableDataset"):
        EPPSFTTrainer(model=model, args=args(), train_dataset=ds.to_iterable_dataset(), processing_class=tok)
    from trl import SFTConfig

    with pytest.raises(ValueError, match="needs EPPSFTConfig"):
        EPPSFTTrainer(model=model, args=SFTConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True),
                      train_dataset=ds, processing_class=tok)
    with pytest.warns(UserWarning, match="packing=True is ignored by EPPSFTTrainer"):
        EPPSFTTrainer(model=sft.tiny_model(), args=args(packing=True), train_dataset=ds,
                      processing_class=sft.tokenizer())


def test_config_keeps_trl_defaults_and_parses_both_sets_of_flags(tmp_path):
    from transformers import HfArgumentParser
    from trl import SFTConfig

    trl_default = SFTConfig(output_dir=str(tmp_path), use_cpu=True)
    ours = EPPSFTConfig(output_dir=str(tmp_path), use_cpu=True)
    for name in ("learning_rate", "logging_steps", "bf16", "max_length", "completion_only_loss",
                 "assistant_only_loss", "dataset_text_field", "loss_type"):
        assert getattr(ours, name) == getattr(trl_default, name), name
    assert not ours.gradient_checkpointing and not ours.activation_checkpointing  # the planner decides
    (parsed,) = HfArgumentParser(EPPSFTConfig).parse_args_into_dataclasses([
        "--output_dir", str(tmp_path), "--pp_degree", "2", "--tokens_per_step", "8192",
        "--assistant_only_loss", "--max_length", "2048", "--epp_schedule", "seq1f1b", "--bf16", "False"])
    assert (parsed.pp_degree, parsed.tokens_per_step, parsed.assistant_only_loss, parsed.max_length,
            parsed.to_infinipipe_config().schedule) == (2, 8192, True, 2048, "seq1f1b")
