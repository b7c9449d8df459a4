"""Sharded-stage worker (FSDP2) on 4 ranks, many cases in one launch: dp 2 x pp 2 with shard "dp",
and dp 4 x pp 1 (the SP-group modes: ``sharded_sp_groups.py``).

Every case compares with the unsplit single-process float64 reference (``common.reference``):
the loss, every gradient gathered with ``.grad.full_tensor()`` (collective over the shard group),
or the weights after an AdamW step.  Cases: slices / packs / hybrids with checkpointed layers,
tied and untied embeddings, a replica without units, two accumulated steps with global-norm
clipping and an optimizer step, LoRA (frozen base sharded), evaluation, the default planner, the
per-unit gathering path, bf16 mixed precision, bytes of model states per rank against the
unsharded run, bad input.  Prints ``CASE <name> OK`` per case and ``ALL OK``.
"""
from __future__ import annotations

import time

from common import (
    CKPT,
    LENGTHS,
    UNITS_DP2,
    InfiniPipeConfig,
    PipelineEngine,
    dist,
    expect_value_error,
    init,
    log,
    make_plan,
    random_batch,
    reference,
    tiny_model,
    torch,
)

from infinipipe_hf.runtime.parallel.fsdp_api import full_tensor, is_dtensor, local_tensor
from tests.helpers.reference import assert_grads_close, reference_loss_and_grads

# Both replicas run one 3-slice chain and one packed unit: identical action sequences, which the
# per-unit gathering path over a DP group needs (real DP plans differ; see gather_per_step).
UNITS_SYMMETRIC = [
    [[(0, 0, 13)], [(0, 13, 25)], [(0, 25, 37), (3, 0, 5)], [(1, 0, 11)]],
    [[(4, 0, 8)], [(4, 8, 16)], [(4, 16, 23), (2, 0, 8)], [(5, 0, 6)]],
]


def sharded(pp: int = 2, shard: str = "dp", **kw) -> InfiniPipeConfig:
    return InfiniPipeConfig(pp_degree=pp, shard=shard, p2p_timeout_s=60, **kw)


def full_grads(engine, names=None) -> dict[str, torch.Tensor]:
    """Every gradient of this rank's stage, gathered (all ranks of a stage call in one order)."""
    out = {}
    for n, p in engine.named_parameters():
        if names is not None and n not in names:
            continue
        assert is_dtensor(p), f"{n} is a {type(p).__name__}, not a DTensor"
        assert p.grad is not None and is_dtensor(p.grad), f"{n}: grad {type(p.grad).__name__}"
        out[n] = full_tensor(p.grad)
    return out


def check_full_grads(engine, want: dict, names=None) -> float:
    got = full_grads(engine, names)
    worst = assert_grads_close(got, {n: want[n] for n in got})
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, sorted(got))
    missing = set(names if names is not None else want) - set().union(*map(set, seen))
    assert not missing, f"parameters on no stage: {sorted(missing)[:5]}"
    return worst


def close(got: float, want: float, what: str, rtol: float = 1e-10) -> None:
    assert abs(got - want) <= rtol * abs(want), f"{what}: {got!r} vs {want!r}"


def exact(name: str, *, family: str, tie: bool, units, ckpt: str, labels: bool = True,
          lengths=LENGTHS) -> None:
    t0 = time.time()
    batch = random_batch(lengths, seed=1, with_labels=labels)
    (want_loss,), want, _ = reference(family, tie, [batch])
    engine = PipelineEngine(tiny_model(family, tie=tie), sharded())
    plan = make_plan(lengths, units, 2, engine.layers_per_stage, checkpoint=CKPT[ckpt])
    out = engine.train_step(batch, plan=plan)
    close(out.loss, want_loss, f"{name} loss")
    worst = check_full_grads(engine, want)
    check_only_shards_held(engine)
    log(f"CASE {name} OK loss={out.loss:.12f} worst_rel={worst:.2e} {time.time() - t0:.1f}s")


def check_only_shards_held(engine) -> None:
    """Each parameter's storage holds its shard (rows ceil(n / shard size)), never the whole."""
    size = engine.sharding.mesh.size()
    for n, p in engine.named_parameters():
        rows = -(-p.shape[0] // size)
        limit = rows * (p.numel() // p.shape[0]) * p.element_size()
        held = local_tensor(p).untyped_storage().nbytes()
        assert 0 < held <= limit < p.numel() * p.element_size(), (n, held, limit)


def dp4_pp1_tied() -> None:
    """One stage with the tied embeddings and LM head: one FSDP group for both modules."""
    batch = random_batch(LENGTHS, seed=4, with_labels=True)
    (want_loss,), want, _ = reference("llama", True, [batch])
    engine = PipelineEngine(tiny_model("llama", tie=True), sharded(pp=1))
    assert engine.layout.dp_degree == 4
    units = [[[(0, 0, 13)], [(0, 13, 25)], [(0, 25, 37)]], [[(4, 0, 15)], [(4, 15, 23), (2, 0, 8)]],
             [[(1, 0, 11)]], [[(3, 0, 5), (5, 0, 6)]]]
    out = engine.train_step(batch, plan=make_plan(LENGTHS, units, 1, engine.layers_per_stage,
                                                  checkpoint=CKPT["mixed"]))
    close(out.loss, want_loss, "dp4 pp1 loss")
    params = dict(engine.stage.named_parameters(remove_duplicate=False))
    assert params["lm_head.weight"] is params["model.embed_tokens.weight"]
    worst = check_full_grads(engine, want, names=set(want) - {"lm_head.weight"})  # one tensor
    log(f"CASE dp4pp1_tied_one_group OK worst_rel={worst:.2e}")


def accumulate_clip_step() -> None:
    """Two accumulated steps, global-norm clipping, then AdamW on the shards = the reference's."""
    t0 = time.time()
    batch_a = random_batch(LENGTHS, seed=11, with_labels=True)
    batch_b = random_batch([9, 4], seed=12)
    losses, want, ref = reference("llama", True, [batch_a, batch_b])
    engine = PipelineEngine(tiny_model("llama", tie=True), sharded())
    lps = engine.layers_per_stage
    out_a = engine.train_step(batch_a, plan=make_plan(LENGTHS, UNITS_DP2, 2, lps, CKPT["mixed"]))
    out_b = engine.train_step(batch_b, plan=make_plan([9, 4], [[[(0, 0, 6)], [(0, 6, 9)]], [[(1, 0, 4)]]],
                                                      2, lps))
    close(out_a.loss, losses[0], "first loss")
    close(out_b.loss, losses[1], "second loss")
    worst = check_full_grads(engine, want)
    for n, p in ref.named_parameters():  # the reference's .grad holds the last batch only
        p.grad = want[n].clone()
    want_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
    norm = engine.clip_grad_norm_(0.05)
    assert want_norm > 0.05, want_norm
    close(norm, want_norm, "global norm")
    opt_kw = dict(lr=1e-2, weight_decay=0.1, foreach=False)
    torch.optim.AdamW(ref.parameters(), **opt_kw).step()
    opt = torch.optim.AdamW(list(engine.parameters()), **opt_kw)
    opt.step()
    for st in opt.state.values():  # optimizer state lives on the shards
        assert is_dtensor(st["exp_avg"]) and is_dtensor(st["exp_avg_sq"])
    weights = {n: p for n, p in ref.named_parameters(remove_duplicate=False)}
    wworst = 0.0
    for n, p in engine.named_parameters():
        full = full_tensor(p.detach())
        err = (full - weights[n]).abs().max().item() / weights[n].abs().max().item()
        assert err <= 1e-10, f"{n}: updated weight rel err {err:.2e}"
        wworst = max(wworst, err)
    log(f"CASE accumulate_clip_adamw OK grad_rel={worst:.2e} norm={norm:.6e} weight_rel={wworst:.2e} "
        f"{time.time() - t0:.1f}s")


def lora_model(seed: int = 0):
    from peft import LoraConfig, get_peft_model

    m = tiny_model("llama", seed=seed, tie=False)
    torch.manual_seed(1)
    return get_peft_model(m, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                        lora_dropout=0.0, init_lora_weights=False))


def lora() -> None:
    """Frozen base sharded with the adapters; only adapters get (exact) gradients."""
    t0 = time.time()
    batch = random_batch(LENGTHS, seed=3, with_labels=True)
    ref = lora_model()
    loss, grads = reference_loss_and_grads(ref, batch)
    prefix = "base_model.model."
    want = {n[len(prefix):]: g for n, g in grads.items()}
    before = {n[len(prefix):]: p.detach().clone() for n, p in ref.named_parameters()}
    engine = PipelineEngine(lora_model(), sharded())
    plan = make_plan(LENGTHS, UNITS_DP2, 2, engine.layers_per_stage, checkpoint=CKPT["mixed"])
    out = engine.train_step(batch, plan=plan)
    close(out.loss, loss, "lora loss")
    adapters = {n for n, p in engine.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters), sorted(adapters)[:4]
    worst = check_full_grads(engine, want, names=adapters)
    for n, p in engine.named_parameters():
        if n not in adapters:
            assert is_dtensor(p) and p.grad is None, f"frozen {n}: {type(p).__name__}, grad {p.grad}"
            assert torch.equal(full_tensor(p.detach()), before[n]), f"frozen {n} changed"
    log(f"CASE lora_frozen_base_sharded OK adapters={len(adapters)} worst_rel={worst:.2e} "
        f"{time.time() - t0:.1f}s")


def eval_then_train() -> None:
    """eval_step equals the reference and leaves every parameter sharded; training still exact."""
    batch = random_batch(LENGTHS, seed=21, with_labels=True)
    (want_loss,), want, _ = reference("qwen2", True, [batch])
    engine = PipelineEngine(tiny_model("qwen2", tie=True), sharded())
    plan = make_plan(LENGTHS, UNITS_DP2, 2, engine.layers_per_stage)
    close(engine.eval_step(batch, plan=plan), want_loss, "eval loss")
    assert all(is_dtensor(p) and p.grad is None for p in engine.parameters())
    out = engine.train_step(batch, plan=plan)
    close(out.loss, want_loss, "train loss after eval")
    worst = check_full_grads(engine, want)
    log(f"CASE eval_then_train OK worst_rel={worst:.2e}")


def count_all_gathers():
    """Patch FSDP's all-gather to count calls; returns (counter, undo)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

    original = pg.foreach_all_gather
    calls = [0]

    def counting(*a, **kw):
        calls[0] += 1
        return original(*a, **kw)

    pg.foreach_all_gather = counting
    return calls, lambda: setattr(pg, "foreach_all_gather", original)


def gathering_paths() -> None:
    """Gather once per step (the default over DP) vs per unit (what SP groups use), both exact."""
    lengths = LENGTHS
    batch = random_batch(lengths, seed=7, with_labels=True)
    (want_loss,), want, _ = reference("mistral", True, [batch])
    ckpt = lambda stage, unit, layers: (stage + unit % 4) % (layers + 1)  # noqa: E731
    counts = {}
    for per_step in (True, False):
        engine = PipelineEngine(tiny_model("mistral", tie=True), sharded())
        engine.sharding.gather_per_step = per_step
        plan = make_plan(lengths, UNITS_SYMMETRIC, 2, engine.layers_per_stage, checkpoint=ckpt)
        calls, undo = count_all_gathers()
        try:
            out = engine.train_step(batch, plan=plan)
        finally:
            undo()
        close(out.loss, want_loss, f"loss (gather_per_step={per_step})")
        check_full_grads(engine, want)
        counts[per_step] = calls[0]
        modules = len(engine.sharding.modules)
        if per_step:
            assert calls[0] == modules, (calls[0], modules)
        else:  # each layer twice per unit (forward, backward), plus checkpoint recomputes
            assert calls[0] > 2 * modules, (calls[0], modules)
    log(f"CASE gather_per_step_and_per_unit OK all_gathers per step={counts[True]} "
        f"per unit={counts[False]}")


def idle_replica() -> None:
    batch = random_batch([9, 4], seed=5)
    (want_loss,), want, _ = reference("qwen2", True, [batch])
    engine = PipelineEngine(tiny_model("qwen2", tie=True), sharded())
    plan = make_plan([9, 4], [[[(0, 0, 5)], [(0, 5, 9), (1, 0, 4)]], []], 2, engine.layers_per_stage,
                     checkpoint=CKPT["mixed"])
    out = engine.train_step(batch, plan=plan)
    close(out.loss, want_loss, "idle replica loss")
    worst = check_full_grads(engine, want)
    log(f"CASE dp2pp2_idle_replica OK worst_rel={worst:.2e}")


def default_planner() -> None:
    from infinipipe_hf.ir.units import UnitKind

    lengths = [700, 130, 90, 60, 300, 20]
    batch = random_batch(lengths, seed=41, with_labels=True)
    (want_loss,), want, _ = reference("llama", False, [batch])
    engine = PipelineEngine(tiny_model("llama"), sharded(max_tokens_per_unit=256))
    out = engine.train_step(batch)
    kinds = {u.kind(lengths) for u in out.plan.units}
    assert UnitKind.SLICE in kinds or UnitKind.HYBRID in kinds, kinds
    close(out.loss, want_loss, "default planner loss")
    worst = check_full_grads(engine, want)
    log(f"CASE default_planner OK units={len(out.plan.units)} worst_rel={worst:.2e}")


def state_bytes(engine, opt) -> dict[str, int]:
    """Parameter, gradient and optimizer-state bytes this rank holds (local shards)."""
    def nbytes(t):
        t = local_tensor(t)
        return t.numel() * t.element_size()

    params = list(engine.parameters())
    return {"params": sum(nbytes(p) for p in params),
            "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(nbytes(v) for st in opt.state.values() for v in st.values()
                             if torch.is_tensor(v))}


def memory_per_rank() -> None:
    """Model-state bytes per rank at shard 2 are half the unsharded run's (within 5%)."""
    batch = random_batch(LENGTHS, seed=2)
    out = {}
    for shard in ("none", "dp"):
        engine = PipelineEngine(tiny_model("llama", num_layers=4, hidden=64, heads=4, kv_heads=2,
                                           vocab=256), InfiniPipeConfig(pp_degree=2, shard=shard,
                                                                        p2p_timeout_s=60))
        engine.train_step(batch, plan=make_plan(LENGTHS, UNITS_DP2, 2, engine.layers_per_stage))
        opt = torch.optim.AdamW(list(engine.parameters()), lr=1e-3)
        opt.step()
        out[shard] = state_bytes(engine, opt)
    total = {k: sum(v.values()) for k, v in out.items()}
    ratio = total["dp"] / total["none"]
    assert abs(ratio - 0.5) <= 0.025, (ratio, out)
    for k in ("params", "grads", "optimizer"):
        assert abs(out["dp"][k] / out["none"][k] - 0.5) <= 0.05, (k, out)
    log(f"CASE memory_per_rank OK unsharded={total['none']} sharded={total['dp']} ratio={ratio:.4f} "
        f"detail={out['dp']}")


def mixed_precision() -> None:
    """compute_dtype=bf16: bf16 compute and transfers, float32 shards and reduced gradients."""
    batch = random_batch(LENGTHS, seed=8, with_labels=True)
    model = tiny_model("llama", tie=True, dtype=torch.float32)
    ref = tiny_model("llama", tie=True, dtype=torch.float32)
    want_loss, _ = reference_loss_and_grads(ref, batch)
    want = {n: p.grad for n, p in ref.named_parameters(remove_duplicate=False)}  # tied head too
    engine = PipelineEngine(model, sharded(), compute_dtype=torch.bfloat16)
    assert engine.dtype == torch.bfloat16
    out = engine.train_step(batch, plan=make_plan(LENGTHS, UNITS_DP2, 2, engine.layers_per_stage))
    close(out.loss, want_loss, "bf16 loss", rtol=3e-2)
    assert out.loss != want_loss  # it did compute in bf16
    worst = 0.0
    for n, p in engine.named_parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, (n, p.dtype, p.grad.dtype)
        g, w = full_tensor(p.grad), want[n]
        cos = float(torch.nn.functional.cosine_similarity(g.flatten(), w.flatten(), dim=0))
        assert cos > 0.99, (n, cos)
        worst = max(worst, 1 - cos)
    log(f"CASE bf16_mixed_precision OK loss={out.loss:.6f} ref={want_loss:.6f} "
        f"worst_1-cos={worst:.1e}")


def bad_input() -> None:
    m = lambda: tiny_model("llama")  # noqa: E731
    expect_value_error("dp_shard_without_dp_group", ["shard='dp'", "dp_degree=1", "no DP group"],
                       lambda: PipelineEngine(m(), InfiniPipeConfig(pp_degree=4, shard="dp")))
    expect_value_error("sp_shard_without_sp_group", ["shard='sp'", "sp_degree=1", "shard='dp'"],
                       lambda: PipelineEngine(m(), InfiniPipeConfig(pp_degree=2, shard="sp")))
    expect_value_error("hybrid_without_sp_group", ["shard='hybrid'", "sp_degree >= 2"],
                       lambda: PipelineEngine(m(), InfiniPipeConfig(pp_degree=2, shard="hybrid")))
    expect_value_error("shard_group_not_dividing", ["sp_degree=3", "does not divide world size 4"],
                       lambda: PipelineEngine(m(), InfiniPipeConfig(pp_degree=1, sp_degree=3,
                                                                    shard="sp")))
    expect_value_error("compute_dtype_without_shard", ["compute_dtype", "shard != 'none'"],
                       lambda: PipelineEngine(m(), InfiniPipeConfig(pp_degree=2),
                                              compute_dtype=torch.bfloat16))


def main() -> None:
    exact("dp2pp2_llama_tied_ckpt_mixed", family="llama", tie=True, units=UNITS_DP2, ckpt="mixed")
    exact("dp2pp2_mistral_untied_ckpt_all", family="mistral", tie=False, units=UNITS_DP2, ckpt="all",
          labels=False)
    idle_replica()
    dp4_pp1_tied()
    accumulate_clip_step()
    lora()
    eval_then_train()
    gathering_paths()
    default_planner()
    memory_per_rank()
    mixed_precision()
    bad_input()


if __name__ == "__main__":

    init()
    main()
    dist.barrier()
    log("ALL OK")
    dist.destroy_process_group()
