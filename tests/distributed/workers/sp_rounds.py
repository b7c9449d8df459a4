"""Elastic SP rounds, exact-gradient worker (4 ranks, gloo, float64): many cases in one launch.

Hand-made plans with SP sub-groups and rounds (``tests/distributed/round_plans.py``): pp 2 x sp 2,
pp 1 x sp 4 and dp 2 x sp 2, rounds mixing a 4-rank or 2-rank unit with single-rank units; slices
carrying K/V on every group size (a single rank included), packs, hybrids; whole-layer
checkpointing and the finer levels (keep_attn, mlp, mlp_act), one mix per round; shard "none" and
"sp"; GQA with fewer K/V heads than the sub-group (2 K/V heads on 4 ranks, 1 on 2); odd units and
units with fewer tokens than their sub-group.  Every rank compares its loss and every gradient it
holds with the unsplit single-process HF model (1e-10 relative), and checks that it ran
all-to-alls on exactly the sub-group sizes >= 2 of its units (a unit on one rank runs none).
Then bad input refused on every rank before anything runs, and the fall-back construction of
the sub-groups' process groups.  Prints ``CASE <name> OK`` per case and ``ALL OK``.
"""
from __future__ import annotations

import time
from collections import Counter

from common import (
    CKPT,
    InfiniPipeConfig,
    PipelineEngine,
    check_grads,
    dist,
    expect_value_error,
    init,
    levels_after_whole,
    log,
    torch,
)
from sharded_grads import check_full_grads, close

from infinipipe_hf.runtime.engine.sp_rounds import rank_actions
from infinipipe_hf.runtime.parallel.sequence_parallel import SequenceParallel
from tests.distributed.round_plans import rounds_plan
from tests.helpers.reference import random_batch, reference_loss_and_grads, tiny_model

SHAPES = {"gqa2": dict(heads=4, kv_heads=2), "mqa": dict(heads=4, kv_heads=1), "mha4": dict(heads=4, kv_heads=4)}
CKPT_ROUND = {"none": None, "all": CKPT["all"], "mixed": lambda stage, r, layers: (stage + r) % (layers + 1)}

LENGTHS = [37, 11, 8, 5, 23, 6]
# sp 2: seq 0 in three slices on both ranks (its tail packed with seq 1), seq 4 in two slices on
# rank 0 alone (its tail packed with seq 5), packs on rank 1.
SP2 = [[(0, 2, [(0, 0, 13)])], [(0, 2, [(0, 13, 25)])], [(0, 2, [(0, 25, 37), (1, 0, 11)])],
       [(0, 1, [(4, 0, 15)]), (1, 1, [(2, 0, 8)])],
       [(0, 1, [(4, 15, 23), (5, 0, 6)]), (1, 1, [(3, 0, 5)])]]
ODD = [21, 1, 3, 9, 2, 5, 1]
SP2_ODD = [[(0, 2, [(0, 0, 7)])], [(0, 2, [(0, 7, 12)])], [(0, 2, [(0, 12, 21), (1, 0, 1)])],
           [(0, 1, [(3, 0, 1)]), (1, 1, [(2, 0, 3)])], [(0, 1, [(3, 1, 6)]), (1, 1, [(4, 0, 2)])],
           [(0, 1, [(3, 6, 9)]), (1, 1, [(5, 0, 5)])], [(0, 2, [(6, 0, 1)])]]
LENGTHS4 = [37, 11, 8, 5, 23, 6, 17, 3, 4, 2, 7, 5, 9]
# sp 4: seq 0 sliced on all four ranks; seq 4 sliced on ranks 0-1 (tail hybrid), seq 6 on ranks
# 2-3, seq 12 on rank 1 alone (tail hybrid with seq 8); single-rank packs; a round of four.
SP4 = [[(0, 4, [(0, 0, 13)])], [(0, 4, [(0, 13, 25)])], [(0, 4, [(0, 25, 37), (1, 0, 11)])],
       [(0, 2, [(4, 0, 15)]), (2, 1, [(2, 0, 8)]), (3, 1, [(3, 0, 5)])],
       [(0, 2, [(4, 15, 23), (5, 0, 6)]), (2, 2, [(6, 0, 9)])],
       [(0, 1, [(7, 0, 3)]), (1, 1, [(12, 0, 4)]), (2, 2, [(6, 9, 17)])],
       [(0, 1, [(9, 0, 2)]), (1, 1, [(12, 4, 9), (8, 0, 4)]), (2, 1, [(10, 0, 7)]), (3, 1, [(11, 0, 5)])]]
# Units of 7, 5, 10 tokens on 4 ranks; 1 token on 2 ranks (a pad token), 3 on 2.
SP4_ODD = [[(0, 4, [(0, 0, 7)])], [(0, 4, [(0, 7, 12)])], [(0, 4, [(0, 12, 21), (1, 0, 1)])],
           [(0, 2, [(3, 0, 1)]), (2, 2, [(2, 0, 3)])],
           [(0, 2, [(3, 1, 6)]), (2, 1, [(4, 0, 2)]), (3, 1, [(5, 0, 5)])],
           [(0, 2, [(3, 6, 9)]), (2, 2, [(6, 0, 1)])]]
DP2_SP2 = [[[(0, 2, [(0, 0, 13)])], [(0, 2, [(0, 13, 25)])], [(0, 2, [(0, 25, 37), (3, 0, 5)])]],
           [[(0, 1, [(4, 0, 15)]), (1, 1, [(2, 0, 8)])], [(0, 1, [(4, 15, 23)]), (1, 1, [(1, 0, 11), (5, 0, 6)])]]]


def reference(family, tie, batch, shape, pp):
    """Loss and gradients of the unsplit model (a tied weight listed once at pp 1, as the stage does)."""
    model = tiny_model(family, seed=0, num_layers=4, tie=tie, **SHAPES[shape])
    loss, _ = reference_loss_and_grads(model, batch)
    return loss, {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=pp == 1)}


def engine_for(family, tie, *, pp, sp, shape, shard="none", **config):
    model = tiny_model(family, seed=0, num_layers=4, tie=tie, **SHAPES[shape])
    return PipelineEngine(model, InfiniPipeConfig(pp_degree=pp, sp_degree=sp, shard=shard, p2p_timeout_s=60,
                                                  **config))


def count_exchanges():
    """Patch ``SequenceParallel.exchange`` to count all-to-alls by group size; returns the counter."""
    counts: Counter = Counter()
    real = SequenceParallel.exchange

    def counting(self, *args, **kwargs):
        counts[self.sp_degree] += 1
        return real(self, *args, **kwargs)

    SequenceParallel.exchange = counting
    return counts, lambda: setattr(SequenceParallel, "exchange", real)


def levels_per_round(stage, r, layers, whole):
    return levels_after_whole(stage, r, layers, whole)


def case(name, rounds_per_dp, *, lengths, pp, sp, family="llama", tie=False, shape="gqa2", ckpt="mixed",
         levels=False, shard="none", check_eval=False):
    t0 = time.time()
    batch = random_batch(lengths, seed=5, with_labels=True)
    want_loss, want = reference(family, tie, batch, shape, pp)
    engine = engine_for(family, tie, pp=pp, sp=sp, shape=shape, shard=shard)
    plan = rounds_plan(lengths, rounds_per_dp, pp=pp, sp=sp, layers_per_stage=engine.layers_per_stage,
                       checkpoint=CKPT_ROUND[ckpt], levels=levels_per_round if levels else None, shard=shard)
    if levels:
        assert any("keep_attn" in per for st in plan.checkpoint_levels.values() for per in st.values())
    lay = engine.layout
    mine = {plan.sub_group(a.unit).size for a in rank_actions(plan, lay.dp_rank, lay.stage_index, lay.sp_rank)}
    if check_eval:
        close(engine.eval_step(batch, plan=plan), want_loss, f"{name} eval loss")
    counts, restore = count_exchanges()
    try:
        out = engine.train_step(batch, plan=plan)
    finally:
        restore()
    close(out.loss, want_loss, f"{name} loss")
    assert set(counts) == {g for g in mine if g > 1}, (name, dict(counts), mine)
    worst = check_grads(engine, want) if shard == "none" else check_full_grads(engine, want)
    log(f"CASE {name} OK loss={out.loss:.12f} worst_rel={worst:.2e} group_sizes={sorted(mine)} "
        f"all_to_alls={dict(sorted(counts.items()))} {time.time() - t0:.2f}s")


def planner_case(name, *, lengths, pp, sp, shard="none", max_tokens_per_unit=128):
    """The engine's own planner with elastic SP rounds: the plan it makes (a sliced sequence on the
    whole group, short ones on smaller sub-groups) runs exactly."""
    t0 = time.time()
    batch = random_batch(lengths, seed=5, with_labels=True)
    want_loss, want = reference("llama", False, batch, "gqa2", pp)
    engine = engine_for("llama", False, pp=pp, sp=sp, shape="gqa2", shard=shard, sp_rounds=True,
                        max_tokens_per_unit=max_tokens_per_unit)
    out = engine.train_step(batch)
    sizes = sorted({out.plan.sub_group(u.id).size for u in out.plan.units})
    assert out.plan.rounds and sizes[0] < sp == sizes[-1], (name, sizes, out.plan.rounds)  # mixed sizes
    close(out.loss, want_loss, f"{name} loss")
    worst = check_grads(engine, want) if shard == "none" else check_full_grads(engine, want)
    off = engine_for("llama", False, pp=pp, sp=sp, shape="gqa2", shard=shard, sp_rounds=False,
                     max_tokens_per_unit=max_tokens_per_unit).plan_locally(lengths)[0]
    assert not off.rounds and not off.sp_groups, (name, off.rounds)  # sp_rounds=False: whole-group SP
    log(f"CASE {name} OK loss={out.loss:.12f} worst_rel={worst:.2e} rounds={out.plan.rounds} "
        f"group_sizes={sizes} {time.time() - t0:.2f}s")


def bad_input():
    """Refused on every rank before anything runs (a clear error, no hang)."""
    engine = engine_for("llama", False, pp=1, sp=4, shape="gqa2", shard="sp")
    lps = engine.layers_per_stage
    batch = random_batch(LENGTHS4, seed=5)
    split = [r[:] for r in SP4]
    split[5] = [(0, 1, [(7, 0, 3)]), (1, 1, [(6, 9, 17)]), (2, 2, [(12, 0, 4)])]  # seq 6 leaves ranks 2-3
    split[6] = [(0, 1, [(9, 0, 2)]), (1, 1, [(8, 0, 4)]), (2, 2, [(12, 4, 9), (10, 0, 7), (11, 0, 5)])]
    expect_value_error("bad_sequence_across_sub_groups", ["sequence 6 runs on SP sub-group (offset 2, size 2)",
                                                          "(offset 1, size 1)", "one sub-group"],
                       lambda: engine.train_step(batch, plan=rounds_plan(LENGTHS4, [split], pp=1, sp=4,
                                                                         layers_per_stage=lps)))
    plan = rounds_plan(LENGTHS4, [SP4], pp=1, sp=4, layers_per_stage=lps, checkpoint=CKPT_ROUND["mixed"])
    plan.checkpoint_layers[0][plan.rounds[3][1]] += 1
    expect_value_error("bad_mix_in_round_under_shard_sp", ["stage 0 checkpoints the units of round 3 differently", "one checkpoint mix"],
                       lambda: engine.train_step(batch, plan=plan))
    plan = rounds_plan(LENGTHS, [SP2], pp=1, sp=2, layers_per_stage=lps)
    expect_value_error("bad_plan_for_other_sp", ["sp_degree=2 but the engine runs sp_degree=4"],
                       lambda: engine.train_step(random_batch(LENGTHS, seed=5), plan=plan))
    ok = rounds_plan(LENGTHS4, [SP4], pp=1, sp=4, layers_per_stage=lps)
    engine.train_step(batch, plan=ok)  # the engine still runs after refusing
    log("CASE bad_input_then_a_good_step OK")


def sub_group_meshes():
    """The sub-groups' process groups from ``DeviceMesh._unflatten`` and from the fall-back 4-D
    ``DeviceMesh`` hold the same ranks; time to build them at sp 4 (one size: 2)."""
    from infinipipe_hf.layout import ParallelDims
    from infinipipe_hf.runtime.parallel.mesh import ParallelLayout

    t0 = time.perf_counter()
    lay = ParallelLayout(ParallelDims(sp_degree=4), dist.get_rank(), timeout_s=60)
    t_all = time.perf_counter() - t0
    t0 = time.perf_counter()
    lay._build_sub_groups(None)
    t_unflatten = time.perf_counter() - t0
    fallback = ParallelLayout(ParallelDims(sp_degree=4), dist.get_rank(), groups_enabled=False)
    fallback.mesh = lay.mesh
    t0 = time.perf_counter()
    fallback._build_sub_groups(None, unflatten=False)
    t_mesh = time.perf_counter() - t0
    ranks = dist.get_process_group_ranks(lay.sub_group_pgs[2])
    assert ranks == dist.get_process_group_ranks(fallback.sub_group_pgs[2]) == lay.sub_group_of(
        lay.sp_rank // 2 * 2, 2)[1] == [dist.get_rank() // 2 * 2, dist.get_rank() // 2 * 2 + 1], ranks
    t = torch.tensor([t_all, t_unflatten, t_mesh], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    log(f"CASE sub_group_meshes OK ranks={ranks} layout_build_s={t[0]:.4f} unflatten_s={t[1]:.4f} "
        f"fallback_mesh_s={t[2]:.4f}")


def main():
    case("pp2sp2_llama_mixed", [SP2], lengths=LENGTHS, pp=2, sp=2, check_eval=True)
    case("pp2sp2_qwen2_tied_levels", [SP2], lengths=LENGTHS, pp=2, sp=2, family="qwen2", tie=True, levels=True)
    case("pp2sp2_shard_sp_mixed", [SP2], lengths=LENGTHS, pp=2, sp=2, tie=True, shard="sp")
    case("pp2sp2_shard_sp_levels", [SP2], lengths=LENGTHS, pp=2, sp=2, family="qwen3", shape="mha4",
         shard="sp", levels=True)
    case("pp2sp2_mistral_odd", [SP2_ODD], lengths=ODD, pp=2, sp=2, family="mistral", ckpt="none")
    case("sp4_gqa2_mixed", [SP4], lengths=LENGTHS4, pp=1, sp=4, check_eval=True)
    case("sp4_mqa_tied_levels", [SP4], lengths=LENGTHS4, pp=1, sp=4, family="qwen2", tie=True, shape="mqa",
         levels=True)
    case("sp4_shard_sp_levels", [SP4], lengths=LENGTHS4, pp=1, sp=4, family="mistral", tie=True, shard="sp",
         levels=True)
    case("sp4_odd_tiny_all", [SP4_ODD], lengths=ODD, pp=1, sp=4, ckpt="all", shape="mqa")
    case("dp2sp2_llama_tied", DP2_SP2, lengths=LENGTHS, pp=1, sp=2, tie=True)
    planner_case("pp2sp2_planner_rounds", lengths=[300, 40, 30, 20, 12, 9, 7, 5], pp=2, sp=2)
    planner_case("sp4_planner_rounds_shard_sp", lengths=[300, 40, 30, 20, 12, 9, 7, 5, 3], pp=1, sp=4, shard="sp")
    bad_input()
    sub_group_meshes()


if __name__ == "__main__":
    init()
    main()
    dist.barrier()
    log("ALL OK")
    dist.destroy_process_group()
