"""The demo's run on every rank: load, plan, fine-tune, save, reload and sample.

fp32 on CPU is slow, so the data is small and each document is seen several times (``steps``
spans a few epochs of ``batches_per_epoch`` global batches): the loss falls visibly within
minutes; it measures fitting, not generalisation.  The plan uses the shipped H100 cost profile
(there is no CPU profile), so its predicted times describe an H100; the times per step are
measured here.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

PROMPT_TOKENS = 16


def _quiet() -> None:
    import warnings

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def train(args: argparse.Namespace, s: dict) -> None:
    """Fine-tune, evaluate before and after, save; rank 0 also verifies and writes the summary."""
    t_start = time.perf_counter()
    _quiet()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    main = rank == 0
    out = Path(args.out)
    say = (lambda *a: print(*a, flush=True)) if main else (lambda *a: None)
    model, tokenizer, docs, data = _load(args, s, world, say)
    t_loaded = time.perf_counter()

    trainer, record = _build_trainer(args, s, model, tokenizer, data, out, say, main)
    before = trainer.evaluate(eval_dataset=data)["eval_loss"]
    say(f"loss on the training documents before fine-tuning: {before:.4f}")
    t_train = time.perf_counter()
    trainer.train()
    t_trained = time.perf_counter()
    after = trainer.evaluate(eval_dataset=data)["eval_loss"]
    say(f"loss on the training documents after fine-tuning:  {after:.4f} (before {before:.4f})")
    ckpt = out / "model"
    trainer.save_model(str(ckpt))
    t_saved = time.perf_counter()
    if not main:
        return
    check = verify_and_sample(ckpt, dict(trainer.engine.named_parameters()), docs[0].input_ids,
                              args.sample_tokens, say)
    t_done = time.perf_counter()
    record.update({
        "settings": {**s, "pp": args.pp, "world_size": world},
        "documents": [{"name": d.name, "tokens": len(d.input_ids), "excerpt": d.truncated} for d in docs],
        "layers_per_stage": list(trainer.engine.layers_per_stage),
        "eval_loss_before": before, "eval_loss_after": after, "checkpoint": str(ckpt), **check,
        "timings_s": {"load_model_and_data": t_loaded - t_start, "train": t_trained - t_train,
                      "save_checkpoint": t_saved - t_trained, "reload_and_generate": t_done - t_saved,
                      "rank0_total": t_done - t_start},
    })
    _write_summary(record, out, say)


def _load(args: argparse.Namespace, s: dict, world: int, say):
    """The model, its tokenizer, the long-tailed documents and their token dataset."""
    import datasets
    import torch

    from infinipipe_hf.data.long_tail import describe_lengths, long_tailed_mix
    from infinipipe_hf.models.smollm2 import load_smollm2

    torch.manual_seed(0)
    model, tokenizer = load_smollm2(dtype=torch.float32)
    docs = long_tailed_mix(tokenizer, s["tokens_per_step"] * s["batches_per_epoch"],
                           long_tokens=s["long_tokens"], num_long=s["num_long"])
    lengths = [len(d.input_ids) for d in docs]
    data = datasets.Dataset.from_dict({"input_ids": [d.input_ids for d in docs]})
    say(f"model: SmolLM2-135M-Instruct ({model.config.num_hidden_layers} decoder layers, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, fp32), pp={args.pp} "
        f"over {world} CPU processes (gloo)")
    say(f"data: {describe_lengths(lengths)}")
    say("      long: " + ", ".join(f"{d.name} ({len(d.input_ids)})" for d in docs if d.truncated)
        + f"; short: {sum(not d.truncated for d in docs)} whole stdlib files")
    return model, tokenizer, docs, data


def _build_trainer(args: argparse.Namespace, s: dict, model, tokenizer, data, out: Path, say, main: bool):
    """The ``EPPTrainer`` with the demo's reporter; returns it and the record the reporter fills."""
    from transformers.trainer_callback import PrinterCallback

    from infinipipe_hf import EPPTrainer, EPPTrainingArguments

    targs = EPPTrainingArguments(
        output_dir=str(out / "trainer"), pp_degree=args.pp, tokens_per_step=s["tokens_per_step"],
        max_tokens_per_unit=s["max_tokens_per_unit"], max_steps=s["steps"], learning_rate=s["lr"],
        lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0, use_cpu=True,
        ddp_timeout=600)
    trainer = EPPTrainer(model=model, args=targs, train_dataset=data, processing_class=tokenizer)
    trainer.remove_callback(PrinterCallback)
    record = {"losses": [], "step_times_s": [], "tokens_per_s": []}
    trainer.add_callback(_reporter(trainer, out, record, say, main))
    say(f"stages: decoder layers per stage {trainer.engine.layers_per_stage} (embeddings on stage 0, "
        f"final norm + LM head on stage {args.pp - 1})")
    return trainer, record


def _write_summary(record: dict, out: Path, say) -> None:
    (out / "summary.json").write_text(json.dumps(record, indent=1))
    tm = record["timings_s"]
    say(f"timings (rank 0): load {tm['load_model_and_data']:.0f} s, train {tm['train']:.0f} s, "
        f"save {tm['save_checkpoint']:.0f} s, reload + generate {tm['reload_and_generate']:.0f} s")
    say(f"summary: {out / 'summary.json'}")


def _reporter(trainer, out: Path, record: dict, say, main: bool):
    """A callback printing one line per step (rank 0) and the plan of one step with its chart: the
    first step whose plan slices a sequence (what EPP is about), else the last step."""
    from transformers import TrainerCallback  # here, so the launching process never imports it

    class Reporter(TrainerCallback):
        t0 = 0.0

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            record["step_times_s"].append(time.perf_counter() - self.t0)
            plan = trainer.engine.last_plan
            sliced = plan is not None and any(u.kind(plan.sequences).value != "packed" for u in plan.units)
            if main and "plan" not in record and (sliced or state.global_step == state.max_steps):
                record["plan"] = show_plan(trainer.engine, out, say, state.global_step)

        def on_log(self, args, state, control, logs=None, **kw):
            if not logs or "loss" not in logs:
                return
            record["losses"].append(float(logs["loss"]))
            record["tokens_per_s"].append(float(logs.get("tokens_per_s", 0.0)))
            say(f"step {state.global_step:>2}/{state.max_steps}  loss {logs['loss']:.4f}  "
                f"lr {logs.get('learning_rate', 0):.1e}  {record['step_times_s'][-1]:5.1f} s  "
                f"{logs.get('tokens_per_s', 0):4.0f} tokens/s  grad norm {logs.get('grad_norm', 0):.2f}")

    return Reporter()


def show_plan(engine, out: Path, say, step: int) -> dict:
    """Print the plan of the step just run and draw its Gantt chart; returns facts for the summary."""
    from collections import Counter

    plan = engine.last_plan
    # Planning is deterministic: re-planning the same lengths gives the executed plan and its
    # simulation (the trainer's look-ahead kept the simulation to itself).
    # Only rank 0 reports, so this must not be the collective make_plan (it would wait forever
    # for ranks already in the trainer's next collective).
    replanned, sim = engine.plan_locally(list(plan.sequences))
    assert replanned.to_dict() == plan.to_dict(), "planning is not deterministic"
    kinds = Counter(u.kind(plan.sequences).value for u in plan.units)
    say(f"plan of step {step} ({plan.schedule}; predicted times use the shipped H100 cost profile):")
    say("\n".join("  " + line for line in str(plan).splitlines()))
    facts = {"step": step, "schedule": plan.schedule, "sequences": list(plan.sequences), "num_units": len(plan.units),
             "unit_kinds": dict(kinds), "num_pipelines": plan.num_pipelines,
             "actions": {str(s): [str(a) for a in acts] for s, acts in enumerate(plan.actions[0])}}
    if sim is not None:
        facts.update(predicted_bubble_fraction=sim.bubble_fraction, predicted_step_time_s=sim.step_time_s)
    say(f"  units: {', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}; pipelines: {plan.num_pipelines}"
        + (f"; predicted bubble fraction {sim.bubble_fraction:.2f}" if sim is not None else ""))
    try:
        from infinipipe_hf.cli.viz import plot_plan
    except ImportError as exc:  # viz is optional at runtime (matplotlib); the plan is still printed
        say(f"  (no Gantt chart: {exc})")
        return facts
    png = out / f"plan_step{step}.png"
    plot_plan(plan, sim, str(png), title=f"step {step} of the demo: SmolLM2-135M, pp={plan.pp_degree} "
                                         f"(times: H100 cost profile)")
    facts["gantt_png"] = str(png)
    say(f"  Gantt chart: {png}")
    return facts


def verify_and_sample(ckpt: Path, stage_params: dict, doc_ids: list[int], n_new: int, say) -> dict:
    """Load the checkpoint in this one process, compare this stage's tensors, generate a sample."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
    loaded = dict(model.named_parameters())
    same = sum(1 for n, p in stage_params.items() if n in loaded and torch.equal(loaded[n].detach(), p.detach()))
    say(f"reloaded {ckpt} with AutoModelForCausalLM.from_pretrained in one process: "
        f"{same}/{len(stage_params)} tensors of stage 0 identical to the trained ones")
    prompt = torch.tensor([doc_ids[:PROMPT_TOKENS]])
    model.eval()
    with torch.no_grad():
        gen = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n_new,
                             do_sample=False, pad_token_id=tokenizer.eos_token_id)
    new = gen[0, PROMPT_TOKENS:].tolist()
    reference = doc_ids[PROMPT_TOKENS:PROMPT_TOKENS + len(new)]
    matched = sum(a == b for a, b in zip(new, reference))
    say(f"sample (greedy, {len(new)} new tokens) after the prompt {tokenizer.decode(doc_ids[:PROMPT_TOKENS])!r}:")
    say("  " + repr(tokenizer.decode(new)))
    say(f"  {matched}/{len(new)} generated tokens equal the fine-tuning text at the same position")
    return {"tensors_checked": len(stage_params), "tensors_identical": same,
            "sample": tokenizer.decode(new), "sample_tokens": len(new), "sample_matches_text": matched}
