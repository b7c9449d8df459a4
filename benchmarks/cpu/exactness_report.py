"""Exactness of the pipelined model against the unsplit float64 HF model, recorded to a file.

Runs the same multi-process workers as the distributed exactness tests: ``exact_grads.py``
(test_exact_gradients.py: pp 2, pp 4 and dp 2 x pp 2; Llama, Mistral, Qwen2; tied and untied
embeddings; slices, packed and hybrid units; checkpointing none, some and all; accumulation; the
default planner), ``sp_exact.py`` (test_sequence_parallel.py: sp 2, pp 2 x sp 2, pp 1 x sp 4,
dp 2 x sp 2, GQA, uneven heads, levels) and ``sharded_grads.py`` (test_sharded_stages.py: FSDP2
shard over dp, sp, sp+dp, hybrid; LoRA; accumulation, clipping and AdamW), and collects, per case
and rank, the relative error of the loss and the worst relative error over every gradient tensor
(max |got - want| / max |want|).  The tests assert 1e-10; this script records what is observed, so
a figure quoted anywhere can be checked against benchmarks/results/exactness.json.

Usage: ``python -m benchmarks.cpu.exactness_report [--out benchmarks/results/exactness.json]``
(CPU, gloo, 2 and 4 processes; several minutes on a 2-core machine).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
from pathlib import Path

from benchmarks.lib.paths import RESULTS
from tests.distributed.launch import run_torchrun

ASSERTED = 1e-10
LINE = re.compile(r"\[rank (\d+)\] CASE (\S+) OK(.*)")
FIELD = re.compile(r"(\w+)=(\S+)")


def parse(output: str) -> dict[str, dict]:
    """``{case: {"loss_rel", "grad_rel": max over ranks, "ranks": n}}`` of cases that compared
    numbers (others, such as error-message cases, are left out)."""
    cases: dict[str, dict] = {}
    for m in LINE.finditer(output):
        fields = dict(FIELD.findall(m.group(3)))
        if "worst_rel" not in fields:
            continue
        c = cases.setdefault(m.group(2), {"loss_rel": 0.0, "grad_rel": 0.0, "ranks": 0})
        c["ranks"] += 1
        c["grad_rel"] = max(c["grad_rel"], float(fields["worst_rel"]))
        c["loss_rel"] = max(c["loss_rel"], float(fields.get("loss_rel", 0.0)))
    return cases


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(RESULTS / "exactness.json"))
    args = p.parse_args(argv)
    cases: dict[str, dict] = {}
    for worker, suite, nproc in (("exact_grads.py", "pp2", 2), ("exact_grads.py", "world4", 4),
                                 ("sp_exact.py", "sp2", 2), ("sp_exact.py", "world4", 4),
                                 ("sharded_grads.py", "dp", 4), ("sharded_grads.py", "sp", 4)):
        r = run_torchrun(worker, nproc, [suite], timeout_s=900)
        if r.timed_out or r.returncode != 0:
            print(r.output[-6000:], file=sys.stderr)
            print(f"exactness_report: the {suite} launch failed (exit {r.returncode})", file=sys.stderr)
            return 1
        cases.update({f"{worker[:-3]}:{suite}/{k}": v for k, v in parse(r.output).items()})
    record = {
        "asserted_relative_bound": ASSERTED,
        "worst_gradient_relative_error": max(v["grad_rel"] for v in cases.values()),
        "worst_loss_relative_error": max(v["loss_rel"] for v in cases.values()),
        "cases": cases,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"worst gradient error {record['worst_gradient_relative_error']:.2e}, worst loss error "
          f"{record['worst_loss_relative_error']:.2e} over {len(cases)} cases -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
