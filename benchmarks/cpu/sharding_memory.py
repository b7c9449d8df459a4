"""Model-state bytes per rank with and without FSDP2 sharding of the stages (CPU, gloo).

    python -m benchmarks.cpu.sharding_memory [--model infinipipe_hf/models/configs/smollm2-135m.json]
        [--out benchmarks/results/sharding_memory.json]

Launches 4 gloo processes (dp 2 x pp 2).  For ``shard="none"`` and ``shard="dp"`` each rank
builds the model (random weights, float32) from the config, runs one training step of a small
sliced batch and one AdamW step, then counts what it holds: parameter, gradient and optimizer-state
bytes summed over its local tensors (shards when sharded).  Sharded over 2 replicas, each rank
should hold half (ZeRO-3 at rest; the uneven last shard of a row count makes it slightly more or
less).  Figures are bytes of tensors, not process memory (no timing: a CPU says nothing about GPU
step times).  The loss of the step must be the same with and without sharding.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from benchmarks.lib.launch import torchrun
from benchmarks.lib.paths import REPO, RESULTS

LENGTHS = [160, 48, 40, 24]


def worker(model_path: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    from infinipipe_hf import InfiniPipeConfig, PipelineEngine
    from infinipipe_hf.runtime.parallel.fsdp_api import local_tensor
    from tests.distributed.plans import make_plan

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cfg = transformers.AutoConfig.for_model(**json.loads(Path(model_path).read_text()))
    g = torch.Generator().manual_seed(0)
    batch = [{"input_ids": torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()} for n in LENGTHS]
    units = [[[(0, 0, 80)], [(0, 80, 160), (3, 0, 24)]], [[(1, 0, 48)], [(2, 0, 40)]]]
    rows = {}
    for shard in ("none", "dp"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        engine = PipelineEngine(model, InfiniPipeConfig(pp_degree=2, shard=shard, p2p_timeout_s=600))
        plan = make_plan(LENGTHS, units, 2, engine.layers_per_stage)
        out_step = engine.train_step(batch, plan=plan)
        opt = torch.optim.AdamW(list(engine.parameters()), lr=1e-4)
        opt.step()

        def nbytes(t):
            t = local_tensor(t)
            return t.numel() * t.element_size()

        params = list(engine.parameters())
        mine = {"params": sum(nbytes(p) for p in params),
                "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
                "optimizer": sum(nbytes(v) for st in opt.state.values() for v in st.values()
                                 if torch.is_tensor(v)),
                "loss": out_step.loss, "layers_per_stage": list(engine.layers_per_stage)}
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        rows[shard] = gathered
        del engine, model, opt
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "infinipipe_hf/models/configs/smollm2-135m.json"))
    ap.add_argument("--out", default=str(RESULTS / "sharding_memory.json"))
    args = ap.parse_args(argv)
    raw = Path(args.out).with_suffix(".ranks.tmp.json")
    t0 = time.time()
    torchrun(["-m", "benchmarks.cpu.sharding_memory", "--worker", args.model, raw], 4, 1800, check=True, capture=False)
    rows = json.loads(raw.read_text())
    raw.unlink()
    from infinipipe_hf.ir.model_spec import ModelSpec
    from infinipipe_hf.planner.cost.states import FP32_ADAM, stage_state_bytes_per_rank

    spec = ModelSpec.from_json_file(args.model)
    table = []
    for rank, (none, dp) in enumerate(zip(rows["none"], rows["dp"])):
        tot_none = none["params"] + none["grads"] + none["optimizer"]
        tot_dp = dp["params"] + dp["grads"] + dp["optimizer"]
        stage = rank % 2
        # The planner's model of the same states (planner/model_states.py): fp32 weights,
        # gradients and AdamW moments, FSDP2's dim-0 shards; the last stage holds its own copy of
        # a tied head (the pipeline's tied pair).
        predicted = {d: stage_state_bytes_per_rank(spec, none["layers_per_stage"][stage], embedding=stage == 0,
                                                   head=stage == 1, shard_degree=d, precision=FP32_ADAM)
                     for d in (1, 2)}
        table.append({"rank": rank, "stage": stage, "dp_rank": rank // 2,
                      "unsharded_bytes": tot_none, "sharded_bytes": tot_dp,
                      "ratio": tot_dp / tot_none,
                      "planner_unsharded_bytes": predicted[1], "planner_sharded_bytes": predicted[2],
                      "planner_over_measured": {"unsharded": predicted[1] / tot_none, "sharded": predicted[2] / tot_dp},
                      "sharded_detail": {k: dp[k] for k in ("params", "grads", "optimizer")},
                      "unsharded_detail": {k: none[k] for k in ("params", "grads", "optimizer")}})
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} CPU cores (shared), no GPU; "
                         f"{platform.python_version()}",
              "note": "4 gloo processes, dp 2 x pp 2, float32 weights, AdamW; bytes of local tensors "
                      "after one step (params + grads + optimizer state)",
              "model": Path(args.model).name, "lengths": LENGTHS,
              "loss_difference_none_vs_dp": abs(rows["none"][1]["loss"] - rows["dp"][1]["loss"]),
              "rows": table, "max_ratio_deviation_from_half": max(abs(r["ratio"] - 0.5) for r in table),
              "planner_worst_relative_error": max(abs(v - 1) for r in table for v in r["planner_over_measured"].values()),
              "elapsed_s": round(time.time() - t0, 1)}
    Path(args.out).write_text(json.dumps(result, indent=2))
    for r in table:
        print(f"rank {r['rank']}: unsharded {r['unsharded_bytes'] / 2**20:.1f} MiB, sharded "
              f"{r['sharded_bytes'] / 2**20:.1f} MiB, ratio {r['ratio']:.4f}; planner/measured "
              f"{r['planner_over_measured']['unsharded']:.4f} unsharded, {r['planner_over_measured']['sharded']:.4f} sharded")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
