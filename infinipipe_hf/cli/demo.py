"""``python -m infinipipe_hf.demo``: fine-tune the real SmolLM2-135M with pp 4 on CPU, end to end.

What it shows, in one command and under ten minutes on a 2-core machine:
1. real long-tailed text (``data.long_tail``: Shakespeare and King James excerpts plus whole
   Python standard-library files), tokenized with SmolLM2's own tokenizer;
2. the plan of a step (elastic units: slices of the long documents, short files packed, a tail
   slice packed with short files) printed as data and drawn as a Gantt chart PNG;
3. ``EPPTrainer`` fine-tuning the real model over ``pp`` pipeline stages (4 gloo processes), the
   loss printed per step, and the loss on the training documents before and after;
4. ``save_model`` writing an ordinary HF checkpoint that ``from_pretrained`` loads in one
   process, checked tensor by tensor against this stage, and a greedy sample generated from it.

Launching: without ``torchrun`` around it, the demo starts itself with ``torch.distributed.run``
(``--standalone``, ``pp`` processes, one thread each: the machine has few cores and four
processes share them).  Under ``torchrun`` it just runs.  Rank 0 prints and writes
``OUT/summary.json`` (what the test checks), ``OUT/plan_stepN.png`` and ``OUT/model``.

Trade-offs: fp32 on CPU is slow (about 50 tokens/s per core for this model, forward plus
backward), so the data is small and each document is seen several times (``steps`` spans a few
epochs of ``batches_per_epoch`` global batches): that is what makes the loss fall visibly within
minutes; it measures fitting, not generalisation.  The plan is made with the shipped H100 cost
profile (there is no CPU profile), so its predicted times describe an H100, not this run; the
times printed per step are measured here.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PRESETS = {
    # tokens_per_step, steps, batches_per_epoch, long_tokens, num_long, max_tokens_per_unit, lr
    "full": dict(tokens_per_step=2048, steps=8, batches_per_epoch=2, long_tokens=1024, num_long=2,
                 max_tokens_per_unit=512, lr=2e-4),
    "quick": dict(tokens_per_step=512, steps=3, batches_per_epoch=1, long_tokens=256, num_long=1,
                  max_tokens_per_unit=128, lr=3e-4),
}
PROMPT_TOKENS = 16


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infinipipe_hf.demo", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="CI preset: 3 steps of 512 tokens (~1-2 min)")
    p.add_argument("--pp", type=int, default=4, help="pipeline stages = processes (default 4)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps")
    p.add_argument("--tokens-per-step", type=int, default=None, help="token budget of one global batch")
    p.add_argument("--batches-per-epoch", type=int, default=None,
                   help="global batches of distinct documents; steps beyond them repeat the data")
    p.add_argument("--max-tokens-per-unit", type=int, default=None, help="planner cap on a unit")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (AdamW, linear decay)")
    p.add_argument("--sample-tokens", type=int, default=32, help="tokens generated at the end")
    p.add_argument("--out", default="out/demo", help="output folder (default out/demo)")
    return p


def settings(args: argparse.Namespace) -> dict:
    s = dict(PRESETS["quick" if args.quick else "full"])
    for key in ("steps", "tokens_per_step", "batches_per_epoch", "max_tokens_per_unit", "lr"):
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    if args.tokens_per_step is not None and args.tokens_per_step != PRESETS["full"]["tokens_per_step"]:
        s["long_tokens"] = max(32, s["tokens_per_step"] // 2)
    if s["steps"] < 1 or s["tokens_per_step"] < 64 or s["batches_per_epoch"] < 1 or args.pp < 1:
        raise ValueError(f"need steps >= 1, tokens_per_step >= 64, batches_per_epoch >= 1, pp >= 1; got {s}, "
                         f"pp={args.pp}")
    s["num_long"] = min(s["num_long"], s["batches_per_epoch"] * 2)
    return s


# --- launching -------------------------------------------------------------------------------
def launch(argv: list[str], nproc: int) -> int:
    """Re-run this module under ``torch.distributed.run`` with ``nproc`` gloo processes."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # four processes share a few cores: no oversubscription
    env.setdefault("PYTHONUNBUFFERED", "1")
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "infinipipe_hf.demo", *argv]
    print(f"launching {nproc} processes: torchrun --standalone --nproc_per_node={nproc} "
          f"-m infinipipe_hf.demo {' '.join(argv)}", flush=True)
    return subprocess.call(cmd, env=env)


def _quiet() -> None:
    import warnings

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


# --- the run on every rank ---------------------------------------------------------------------
def train(args: argparse.Namespace, s: dict) -> None:
    t_start = time.perf_counter()
    _quiet()
    import datasets
    import torch
    from transformers.trainer_callback import PrinterCallback

    from infinipipe_hf import EPPTrainer, EPPTrainingArguments
    from infinipipe_hf.data.long_tail import describe_lengths, long_tailed_mix
    from infinipipe_hf.models.smollm2 import load_smollm2

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    main = rank == 0
    out = Path(args.out)
    say = (lambda *a: print(*a, flush=True)) if main else (lambda *a: None)
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
    t_loaded = time.perf_counter()

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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        s = settings(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if "LOCAL_RANK" not in os.environ and args.pp > 1:
        t0 = time.perf_counter()
        rc = launch(argv, args.pp)
        print(f"demo {'finished' if rc == 0 else f'FAILED (exit {rc})'} in {time.perf_counter() - t0:.0f} s "
              f"wall clock", flush=True)
        return rc
    Path(args.out).mkdir(parents=True, exist_ok=True)
    train(args, s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
