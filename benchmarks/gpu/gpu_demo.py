"""The demo's training run as one single-device ``EPPTrainer`` job: bf16 on a GPU beside float32 on CPU.

    python -m benchmarks.gpu.gpu_demo --prepare                       # tokenize the demo's data (needs the GGUF)
    python -m benchmarks.gpu.gpu_demo --device cpu --dtype fp32 --out benchmarks/results/gpu_demo_cpu_fp32.json
    python -m benchmarks.gpu.gpu_demo --device cuda --out OUT.json    # bf16; the CPU run's losses beside it
    python -m benchmarks.gpu.gpu_demo --tiny --device cpu --out OUT.json   # smoke run

The model is SmolLM2-135M's architecture with weights drawn from a seeded generator (the same on
every machine: the JSON records a checksum of them), not the pretrained GGUF: the GGUF (98 MB)
does not fit what travels to a lent GPU machine, and neither does a converted checkpoint.  The
data are the demo's documents (``data.long_tail``: Shakespeare and King James excerpts plus whole
standard-library files) tokenized once with SmolLM2's tokenizer into ``benchmarks/data/
demo_tokens.json``, so both runs train on the same token ids.  The settings are the demo's
(2,048-token steps, 512-token units, linear decay) with a from-scratch learning rate.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

import benchmarks.gpu.gpu_common as gc_
from benchmarks.lib.paths import DATA, RESULTS

TOKENS = DATA / "demo_tokens.json"
SETTINGS = dict(tokens_per_step=2048, steps=8, max_tokens_per_unit=512, lr=1e-3, budget_tokens=4096,
                long_tokens=1024, num_long=2)


def prepare(path: Path) -> None:
    from infinipipe_hf.data.long_tail import long_tailed_mix
    from infinipipe_hf.models.smollm2 import load_smollm2_tokenizer

    tok = load_smollm2_tokenizer()
    docs = long_tailed_mix(tok, SETTINGS["budget_tokens"], long_tokens=SETTINGS["long_tokens"],
                           num_long=SETTINGS["num_long"])
    doc = {"source": "infinipipe_hf.data.long_tail.long_tailed_mix with the SmolLM2-135M-Instruct tokenizer",
           "python": sys.version.split()[0], "settings": SETTINGS,
           "documents": [{"name": d.name, "input_ids": d.input_ids} for d in docs]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, separators=(",", ":")))
    print(f"wrote {path}: {len(docs)} documents, {sum(len(d.input_ids) for d in docs)} tokens")


def seeded_model(config: dict, seed: int = 0):
    """The architecture with weights from a seeded CPU generator (identical on every machine)."""
    model = gc_.make_model(config, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.02 if p.dim() > 1 else torch.ones(p.shape))
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    return model, checksum


class LossRecorder:
    """Collects the logged loss, step time and tokens/s of each step."""

    def __init__(self):
        from transformers import TrainerCallback

        rec = self
        self.losses, self.step_times_s, self.tokens_per_s = [], [], []

        class _CB(TrainerCallback):
            t0 = 0.0

            def on_step_begin(self, args, state, control, **kw):
                self.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                rec.step_times_s.append(time.perf_counter() - self.t0)

            def on_log(self, args, state, control, logs=None, **kw):
                if logs and "loss" in logs:
                    rec.losses.append(float(logs["loss"]))
                    rec.tokens_per_s.append(float(logs.get("tokens_per_s", 0.0)))

        self.callback = _CB()


def train(args) -> dict:
    from transformers.trainer_callback import PrinterCallback

    from infinipipe_hf import EPPTrainer, EPPTrainingArguments

    docs = json.loads(Path(args.tokens).read_text())["documents"]
    config = gc_.load_config(args.config, args.tiny)
    vocab = config["vocab_size"]
    data = [{"input_ids": [t % vocab for t in d["input_ids"]]} for d in docs]
    model, checksum = seeded_model(config)
    s = SETTINGS
    targs = EPPTrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="gpu_demo_"), pp_degree=1, tokens_per_step=s["tokens_per_step"],
        max_tokens_per_unit=s["max_tokens_per_unit"], max_steps=args.steps or s["steps"],
        learning_rate=s["lr"], lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
        use_cpu=args.device == "cpu", bf16=args.dtype == "bf16")
    trainer = EPPTrainer(model=model, args=targs, train_dataset=data)
    trainer.remove_callback(PrinterCallback)
    rec = LossRecorder()
    trainer.add_callback(rec.callback)
    t0 = time.perf_counter()
    before = trainer.evaluate(eval_dataset=data)["eval_loss"]
    trainer.train()
    after = trainer.evaluate(eval_dataset=data)["eval_loss"]
    dev = trainer.engine.device
    return {"device": str(dev), "dtype": args.dtype, "env": gc_.environment(dev), "settings": s,
            "model": "tiny" if args.tiny else Path(args.config or "smollm2-135m").stem,
            "init_checksum": checksum, "num_documents": len(data),
            "document_tokens": [len(d["input_ids"]) for d in data],
            "losses": rec.losses, "step_times_s": rec.step_times_s, "tokens_per_s": rec.tokens_per_s,
            "eval_loss_before": before, "eval_loss_after": after, "wall_s": time.perf_counter() - t0}


def beside_reference(result: dict, reference: Path) -> dict:
    """The reference run's losses beside this run's, with their differences."""
    if not reference.is_file():
        return result
    ref = json.loads(reference.read_text())
    if ref.get("model") != result["model"]:
        return result
    n = min(len(ref["losses"]), len(result["losses"]))
    diffs = [result["losses"][i] - ref["losses"][i] for i in range(n)]
    result["reference"] = {k: ref.get(k) for k in ("device", "dtype", "env", "losses", "eval_loss_before",
                                                     "eval_loss_after", "init_checksum")}
    result["reference"]["file"] = str(reference)
    result["same_init"] = abs(ref.get("init_checksum", 0.0) - result["init_checksum"]) < 1e-6
    result["loss_minus_reference"] = diffs
    if n:
        result["max_abs_loss_diff"] = max(abs(d) for d in diffs)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prepare", action="store_true", help="tokenize the demo's documents into --tokens")
    p.add_argument("--tokens", default=str(TOKENS))
    p.add_argument("--config", default=None, help="HF config.json (default: shipped smollm2-135m)")
    p.add_argument("--tiny", action="store_true", help="tiny random model (smoke run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the demo's 8)")
    p.add_argument("--reference", default=str(RESULTS / "gpu_demo_cpu_fp32.json"))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.prepare:
        prepare(Path(args.tokens))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA device is visible; use --device cpu --dtype fp32")
    if args.config is None and not args.tiny:
        from infinipipe_hf.models.model_configs import config_path

        args.config = str(config_path("smollm2-135m"))
    result = train(args)
    if Path(args.reference).resolve() != Path(args.out or "").resolve():
        result = beside_reference(result, Path(args.reference))
    out = Path(args.out or RESULTS / "gpu_demo.json")
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result.get(k) for k in ("device", "dtype", "losses", "eval_loss_before",
                                                 "eval_loss_after", "max_abs_loss_diff", "same_init")}))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
