"""Sharded-stage worker (FSDP2) on 4 ranks, the shard modes over SP groups, in one launch.

Every mode's mesh (``hybrid``, ``sp``, ``sp+dp``, ``dp``) at dp 2 x sp 2, driven without the SP
runtime (each rank runs its own units; the step's gradient is still their sum), then the engine
with ``sp_degree`` 2 and the SP runtime under ``hybrid``, ``sp`` and ``sp+dp``; each against the
unsplit single-process float64 reference (``common.reference``).  Prints ``CASE <name> OK`` per
case and ``ALL OK``.
"""
from __future__ import annotations

from common import (
    CKPT,
    LENGTHS,
    UNITS_DP2,
    InfiniPipeConfig,
    PipelineEngine,
    dist,
    init,
    log,
    make_plan,
    random_batch,
    reference,
    tiny_model,
    torch,
)
from sharded_grads import check_full_grads, close

from infinipipe_hf.runtime.parallel.fsdp_api import full_tensor
from tests.helpers.reference import assert_grads_close

# Four runners of dp 2 x sp 2 used as four independent replicas (no SP runtime): SP neighbours
# (virtual replicas 0/1 and 2/3) run identical action sequences, as SP ranks do.
UNITS_FOUR = [[[(0, 0, 13)], [(0, 13, 25)], [(0, 25, 37)]], [[(4, 0, 8)], [(4, 8, 16)], [(4, 16, 23)]],
              [[(1, 0, 11)], [(3, 0, 5)]], [[(2, 0, 8)], [(5, 0, 6)]]]


def sp_meshes(shard: str) -> None:
    """The SP-group meshes (HSDP, flattened, extra sums, norm) before the SP runtime exists: every
    rank of a dp 2 x sp 2 stage runs its own units; the step's gradient is still their sum."""
    from infinipipe_hf.layout import ParallelDims
    from infinipipe_hf.runtime.parallel.fsdp import StageSharding
    from infinipipe_hf.runtime.parallel.grad_sync import GradientSync
    from infinipipe_hf.runtime.parallel.mesh import ParallelLayout
    from infinipipe_hf.runtime.stage.module import build_stage
    from infinipipe_hf.runtime.stage.runner import StageRunner
    from infinipipe_hf.runtime.stage.unit_tensors import label_token_count

    batch = random_batch(LENGTHS, seed=13, with_labels=True)
    (want_loss,), want, ref = reference("llama", True, [batch])
    want_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")))
    lay = ParallelLayout(ParallelDims(1, 2, 2, shard), dist.get_rank(), tied_embeddings=True, timeout_s=60)
    stage = build_stage(tiny_model("llama", tie=True), 0, range(4))
    sharding = StageSharding(stage, lay, torch.device("cpu"))
    runner = StageRunner(stage)
    plan = make_plan(LENGTHS, UNITS_FOUR, 1, [4], checkpoint=lambda s, u, n: [0, 2, 4, 0, 2, 4, 1, 3, 1, 3][u])
    sync = GradientSync(lay, torch.device("cpu"), 60, sharding=sharding, tied=lambda: [],
                        trainable=lambda: [p for p in stage.parameters() if p.requires_grad])
    sharding.begin_step()
    runner.begin_step(plan, batch, label_token_count(batch))
    loss = 0.0
    for action in plan.stage_actions(lay.dp_rank * 2 + lay.sp_rank, 0):
        if action.is_forward:
            loss += float(runner.forward(action.unit, None))
        else:
            runner.backward(action.unit, None)
    runner.end_step()
    sync.sync(1)
    close(sync.global_sum(loss, "loss", 1), want_loss, f"{shard} loss")
    close(sync.global_norm(1), want_norm, f"{shard} norm")
    got = {n: full_tensor(p.grad) for n, p in stage.named_parameters()}
    worst = assert_grads_close(got, {n: want[n] for n in got})
    log(f"CASE dp2sp2_meshes_{shard} OK worst_rel={worst:.2e} extra_group={sharding.extra_group is not None}")


def sp_cases() -> None:
    """Sharding over SP groups; runs once the engine accepts sp_degree > 1."""
    cases = [("hybrid_dp2_sp2", 1, "hybrid"), ("sp_pp2_sp2", 2, "sp"), ("spdp_dp2_sp2", 1, "sp+dp")]
    for name, pp, shard in cases:
        batch = random_batch(LENGTHS, seed=9, with_labels=True)
        (want_loss,), want, _ = reference("llama", True, [batch])
        engine = PipelineEngine(tiny_model("llama", tie=True),
                                InfiniPipeConfig(pp_degree=pp, sp_degree=2, shard=shard,
                                                 p2p_timeout_s=60))
        units = UNITS_DP2 if engine.layout.dp_degree == 2 else [UNITS_DP2[0] + UNITS_DP2[1]]
        out = engine.train_step(batch, plan=make_plan(LENGTHS, units, pp, engine.layers_per_stage,
                                                      checkpoint=CKPT["mixed"]))
        close(out.loss, want_loss, f"{name} loss")
        # pp 1 with tied embeddings: the head *is* the embedding (one tensor, one name)
        names = set(want) - {"lm_head.weight"} if pp == 1 else None
        worst = check_full_grads(engine, want, names=names)
        log(f"CASE {name} OK worst_rel={worst:.2e}")


def main() -> None:
    for shard in ("hybrid", "sp", "sp+dp", "dp"):
        sp_meshes(shard)
    sp_cases()


if __name__ == "__main__":
    init()
    main()
    dist.barrier()
    log("ALL OK")
    dist.destroy_process_group()
