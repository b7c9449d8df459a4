"""Memory of single-rank units at sp 2, per rank: bytes saved for backward and KV store bytes.

``sp_rounds_memory.py [OUT.json]`` on 2 ranks (gloo, float32, the Llama shape of ``sp_memory.py``:
hidden 256, 8 heads, 4 K/V heads, 4 layers, pp 1).  Two 1024-token sequences, each cut into two
512-token slices; round 0 runs sequence 0's first slice on SP rank 0 and sequence 1's on SP rank
1 (sub-groups of one), round 1 their second slices (which attend to the first slices' K/V).  Each
rank drives its engine's SP runner through its own two units (no collective runs: every unit is on
one rank), at four checkpoint mixes (none, two whole layers, and two mixes of every level), and
records, while each forward runs, the distinct
storages autograd keeps (``saved_tensors_hooks``, parameters excluded, checkpoint inputs counted:
``common.saved_bytes``), and the KV store after the first slice.  The same slices run through a
plain single-process ``StageRunner`` (sp 1) give the baseline: a unit on one rank of an sp-2 stage
must keep exactly what the unsplit stage keeps, on that rank only (the other rank holds none of
the sequence's K/V).  Each row carries the planner's prediction for a unit on a sub-group of that
size (``CostModel.for_group``, float32 formula profile as in ``sp_memory_model.py``) so the test
can hold the memory model to 10%.  Prints ``ROUNDMEM <json>`` per row and ``ALL OK``.
"""
from __future__ import annotations

import copy
import json
import sys

from common import InfiniPipeConfig, PipelineEngine, dist, init, log, saved_bytes, torch
from sp_memory import VOCAB, T, model
from sp_memory_model import MIXES, cost_model

from infinipipe_hf.ir.levels import CheckpointMix
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.runtime.stage.module import build_stage
from infinipipe_hf.runtime.stage.runner import StageRunner
from tests.distributed.round_plans import rounds_plan

ROUNDS = [[(0, 1, [(0, 0, T)]), (1, 1, [(1, 0, T)])], [(0, 1, [(0, T, 2 * T)]), (1, 1, [(1, T, 2 * T)])]]


def run_units(runner: StageRunner, plan, batch, units: list[int]) -> dict:
    """Forward ``units`` in order (a sequence's two slices), measuring, then backward."""
    runner.begin_step(plan, batch, 4 * T - 2)
    params = list(runner.stage.parameters())
    first = saved_bytes(lambda: runner.forward(units[0], None), params)
    kv = runner.kv_store.bytes()
    kv_seqs = sorted(runner.kv_store.sequences())
    second = saved_bytes(lambda: runner.forward(units[1], None), params)
    for u in reversed(units):
        runner.backward(u, None)
    runner.end_step()
    return {"first_slice": first, "second_slice": second, "kv_store": kv, "kv_sequences": kv_seqs}


def main() -> None:
    init()
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1)
    batch = [{"input_ids": torch.randint(0, VOCAB, (2 * T,), generator=g).tolist()} for _ in range(2)]
    base = model()
    cost = cost_model(ModelSpec.from_hf_config(base.config))
    plain = StageRunner(build_stage(copy.deepcopy(base), 0, range(4)), loss_chunk_tokens=128)
    engine = PipelineEngine(copy.deepcopy(base), InfiniPipeConfig(sp_degree=2, loss_chunk_tokens=128,
                                                                  p2p_timeout_s=120))
    rows = []
    for mix in map(lambda m: CheckpointMix(*m), [MIXES[0], MIXES[1], MIXES[5], MIXES[7]]):
        plan = rounds_plan([2 * T, 2 * T], [ROUNDS], pp=1, sp=2, layers_per_stage=[4],
                           checkpoint=lambda s, r, n: mix.full, levels=lambda s, r, n, w: mix.finer)
        mine = [u.id for u in plan.units if plan.runs_on(u.id, engine.layout.sp_rank)]
        got = run_units(engine.runner, plan, batch, mine)
        want = run_units(plain, plan, batch, mine)  # the same units, unsplit stage
        group = cost.for_group(plan.sub_group(mine[0]).size)
        units = plan.unit_by_id
        row = {"rank": rank, "units": mine, "group_size": plan.sub_group(mine[0]).size,
               "mix": [mix.full, mix.mlp, mix.mlp_act, mix.keep_attn], "measured": got, "sp1": want,
               "model": {"first_slice": group.levels.unit_activation_bytes(0, units[mine[0]].segments, mix),
                         "second_slice": group.levels.unit_activation_bytes(0, units[mine[1]].segments, mix),
                         "kv_store": group.acts.kv_bytes(0, T) / 2}}  # K/V kept; their gradients come in backward
        rows.append(row)
        log("ROUNDMEM " + json.dumps(row))
    if len(sys.argv) > 1:
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, rows)
        if rank == 0:
            with open(sys.argv[1], "w") as f:
                json.dump({"what": "bytes per rank of single-rank units at sp 2 (rounds) vs the unsplit stage "
                                   "and the planner's CostModel.for_group(1) (float32, gloo)",
                           "model": "Llama hidden 256, 8 heads, 4 K/V heads, 4 layers, vocab 512, pp 1, "
                                    f"slices of {T} tokens",
                           "rows": [r for p in parts for r in p]}, f, indent=1)
    dist.barrier()
    log("ALL OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
