"""``python -m infinipipe_hf.demo``: fine-tune the real SmolLM2-135M with pp 4 on CPU, end to end.

It shows real long-tailed text tokenized with SmolLM2's tokenizer, the plan of a step (printed as
data and drawn as a Gantt chart), ``EPPTrainer`` fine-tuning over ``pp`` stages with the loss per
step and before/after, and ``save_model`` writing an HF checkpoint that ``from_pretrained`` loads
in one process (checked tensor by tensor) and samples from.  The run itself is ``demo_run``.

Without ``torchrun`` around it, the demo starts itself with ``torch.distributed.run``
(``--standalone``, ``pp`` processes, one thread each); under ``torchrun`` it just runs.  Rank 0
writes ``OUT/summary.json``, ``OUT/plan_stepN.png`` and ``OUT/model``.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from infinipipe_hf.cli.demo_run import train

PRESETS = {
    # tokens_per_step, steps, batches_per_epoch, long_tokens, num_long, max_tokens_per_unit, lr
    "full": dict(tokens_per_step=2048, steps=8, batches_per_epoch=2, long_tokens=1024, num_long=2,
                 max_tokens_per_unit=512, lr=2e-4),
    "quick": dict(tokens_per_step=512, steps=3, batches_per_epoch=1, long_tokens=256, num_long=1,
                  max_tokens_per_unit=128, lr=3e-4),
}


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
