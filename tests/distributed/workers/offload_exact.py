"""Host-tier exactness worker: offloaded layer inputs, K/V and model states against the unsplit
float64 HF model, many cases in one launch.

``offload_exact.py pp2 OUT`` (2 ranks): pp 2 with units at the ``offload`` level, then at
``offload_attn``, then at ``offload_pair`` (each mixed with whole layers and ``mlp``), and
``offload_kv`` on a sliced sequence; ``state_offload='optimizer'`` (AdamW on the host, step on the CPU) over three steps
against the reference's AdamW, with a save after step 2 and a resume into a fresh engine giving
the same step 3 as the uninterrupted run, every step at ``offload_attn`` with K/V on the host; ``state_offload='states'`` on unsharded stages (FSDP2
over each rank alone).
``offload_exact.py sp2 OUT`` (2 ranks): sp 2 with ``offload`` and ``offload_kv``, and with
``offload_attn`` and ``offload_pair`` (whose rebuild replays the context reads and all-to-alls on
both ranks); ``shard='sp'`` with ``state_offload='states'`` (FSDP2 ``CPUOffloadPolicy``).
Every case checks the host tier's accounting: inputs (and ``offload_attn``'s and
``offload_pair``'s attention outputs and log-sum-exps; a pair's second layer keeps no input) left
(bytes out) and came back (bytes in, with each pair's rebuild reading its first layer's input and
attention output once more), nothing left after the step.
Prints ``CASE <name> OK`` per case and ``ALL OK``.
"""
from __future__ import annotations

import os
import sys
import time

from common import (
    CKPT,
    LENGTHS,
    UNITS_DP1,
    InfiniPipeConfig,
    PipelineEngine,
    check_grads,
    dist,
    init,
    log,
    make_plan,
    random_batch,
    reference,
    tiny_model,
    torch,
)

from infinipipe_hf.ir.levels import CheckpointMix
from tests.helpers.reference import reference_loss_and_grads

HIDDEN, HEADS = 32, 4  # tiny_config's hidden size and attention heads
OPT = dict(lr=1e-2, weight_decay=0.1, foreach=False)


def offload_mix(plan, layers_per_stage, level: str = "offload") -> None:
    """Per (stage, unit): ``CKPT["mixed"]`` whole layers, then ``level`` (a host level) on every
    other unit's free layers (one, or all of them) and ``mlp`` on one where some remain."""
    for s, layers in enumerate(layers_per_stage):
        for u in plan.units:
            full = plan.checkpointed(s, u.id)
            free = layers - full
            off = 0 if (s + u.id) % 3 == 2 else (free if (s + u.id) % 3 == 0 else min(1, free))
            m = CheckpointMix(full=full, mlp=min(1, free - off), **{level: off})
            if m.finer:
                plan.checkpoint_levels.setdefault(s, {})[u.id] = m.finer
    assert any(per.get(level) for st in plan.checkpoint_levels.values() for per in st.values())
    if level == "offload_pair":  # a pair somewhere, not only odd last layers
        assert any(per.get(level, 0) >= 2 for st in plan.checkpoint_levels.values() for per in st.values())


def offloaded_bytes(engine, plan, reread: bool = False) -> int:
    """Bytes this rank's host levels put out per layer and unit: the layer input (its token
    share; at ``offload_pair`` only each pair's first layer's and an odd last one's); at
    ``offload_attn`` and ``offload_pair`` also the attention output and float64 log-sum-exp of the
    whole unit's tokens for this rank's heads.  ``reread``: what the ``offload_pair`` rebuilds read
    once more instead (each pair's first layer's input and attention output)."""
    sp, s = engine.sequence_parallel, engine.layout.stage_index
    heads = HEADS if sp is None else sp.head.num_q  # attention runs on this rank's heads

    def tokens(n: int) -> int:  # this rank's share of a unit's tokens
        return n if sp is None else sp.tokens(n).local_sizes[sp.sp_rank]

    total = 0
    for u in plan.units:
        m = plan.checkpoint_mix(s, u.id)
        inputs = tokens(u.num_tokens) * HIDDEN * 8
        out = u.num_tokens * heads * (HIDDEN // HEADS) * 8  # attention output (head_dim per head)
        kept = out + u.num_tokens * heads * 8  # and the lse per head
        pairs = m.offload_pair // 2
        if reread:
            total += pairs * (inputs + out)
        else:
            total += m.offload * inputs + m.offload_attn * (inputs + kept)
            total += (m.offload_pair - pairs) * inputs + m.offload_pair * kept
    return total


def check_tier(engine, plan, kv: bool) -> str:
    """The host tier after a step: the offloaded inputs left and came back, K/V went through it
    on a stage that offloads it, and nothing is left behind."""
    s = engine.host_tier.stats
    want, reread = offloaded_bytes(engine, plan), offloaded_bytes(engine, plan, reread=True)
    assert s.current_bytes == 0, s
    if kv:
        assert s.bytes_out > want and s.bytes_in > want + reread, (s, want)  # K/V and their gradients too
    else:
        assert s.bytes_out == want and s.bytes_in == want + reread, (s, want, reread)
    assert s.peak_bytes > 0 or want == 0, s
    return f"out={s.bytes_out} in={s.bytes_in} peak={s.peak_bytes}"


def offload_case(name: str, *, pp: int, sp: int, offload_kv: list[int], family: str = "llama",
                 level: str = "offload") -> None:
    t0 = time.time()
    batch = random_batch(LENGTHS, seed=5, with_labels=True)
    (want_loss,), want, _ = reference(family, False, [batch])
    engine = PipelineEngine(tiny_model(family), InfiniPipeConfig(pp_degree=pp, sp_degree=sp, p2p_timeout_s=60))
    plan = make_plan(LENGTHS, UNITS_DP1, pp, engine.layers_per_stage, checkpoint=CKPT["mixed"])
    offload_mix(plan, engine.layers_per_stage, level)
    plan.offload_kv = list(offload_kv)
    prefetched, prefetch = [], engine.host_tier.prefetch_tag
    engine.host_tier.prefetch_tag = lambda tag: (prefetched.append(tag), prefetch(tag))
    out = engine.train_step(batch, plan=plan)
    backward = [a.unit for a in plan.stage_actions(0, engine.layout.stage_index) if not a.is_forward]
    # each unit's first input as its backward starts, then each read the next: in backward order
    started = [t for i, t in enumerate(prefetched) if i == 0 or prefetched[i - 1] != t]
    assert started == backward, (prefetched, backward)
    assert abs(out.loss - want_loss) <= 1e-10 * abs(want_loss), (out.loss, want_loss)
    worst = check_grads(engine, want)
    tier = check_tier(engine, plan, engine.layout.stage_index in offload_kv)
    log(f"CASE {name} OK worst_rel={worst:.2e} {tier} {time.time() - t0:.2f}s")


def _step(engine, opt, batch) -> None:
    """One step whose activations use the host tier as well: ``offload_attn`` mixed with whole
    layers and ``mlp``, the last stage's carried K/V on the host."""
    plan = make_plan(LENGTHS, UNITS_DP1, 2, engine.layers_per_stage, checkpoint=CKPT["mixed"])
    offload_mix(plan, engine.layers_per_stage, "offload_attn")
    plan.offload_kv = [1]
    stats = engine.host_tier.stats
    before = stats.bytes_out
    engine.train_step(batch, plan=plan)
    assert stats.bytes_out - before >= offloaded_bytes(engine, plan), stats
    opt.step()
    opt.zero_grad()


def _host_engine(seed: int):
    from infinipipe_hf.runtime.offload.host_optimizer import HostOptimizer, offload_optimizer

    cfg = InfiniPipeConfig(pp_degree=2, state_offload="optimizer", p2p_timeout_s=60)
    engine = PipelineEngine(tiny_model("llama", seed=seed), cfg)
    opt = offload_optimizer(torch.optim.AdamW(list(engine.parameters()), **OPT), engine.layout.dims,
                            engine.host_tier)
    assert isinstance(opt, HostOptimizer)
    return engine, opt


def optimizer_offload_resume(out_dir: str) -> None:
    """Three AdamW steps on the host = the reference's; save after two, resume, same third step.
    Every step also keeps activations in the host tier (``_step``), so resume is checked with them."""
    from infinipipe_hf.trainer.checkpoints.optimizer import load_optimizer_state, save_optimizer_state

    t0 = time.time()
    batches = [random_batch(LENGTHS, seed=60 + i, with_labels=True) for i in range(3)]
    ref = tiny_model("llama")
    ref_opt = torch.optim.AdamW(ref.parameters(), **OPT)
    for b in batches:
        reference_loss_and_grads(ref, b)
        ref_opt.step()
    engine, opt = _host_engine(0)
    for b in batches[:2]:
        _step(engine, opt, b)
    assert all(t.device.type == "cpu" for st in opt.state.values() for t in st.values())
    assert engine.host_tier.stats.resident["optimizer"] == opt.host_bytes() > 0
    folder = os.path.join(out_dir, "optimizer_offload")
    save_optimizer_state(engine, opt, None, folder)
    saved = {n: p.detach().clone() for n, p in engine.named_parameters()}
    _step(engine, opt, batches[2])
    weights = dict(ref.named_parameters(remove_duplicate=False))
    worst = 0.0
    for n, p in engine.named_parameters():
        err = (p.detach() - weights[n]).abs().max().item() / weights[n].abs().max().item()
        assert err <= 1e-10, f"{n}: weight rel err {err:.2e} after three host AdamW steps"
        worst = max(worst, err)
    resumed, opt2 = _host_engine(7)  # other initial weights: everything comes from the save
    with torch.no_grad():
        for n, p in resumed.named_parameters():
            p.copy_(saved[n])
    load_optimizer_state(resumed, opt2, None, folder, resumed.device)
    _step(resumed, opt2, batches[2])
    for (n, a), (_, b) in zip(engine.named_parameters(), resumed.named_parameters()):
        assert torch.equal(a, b), f"{n}: the resumed step differs from the uninterrupted one"
    log(f"CASE pp2_optimizer_offload_resume OK weight_rel={worst:.2e} {time.time() - t0:.2f}s")


def states_offload(name: str, **cfg_kw) -> None:
    """state_offload='states' (sharded over SP, or each pp rank's stage alone): FSDP2 keeps the
    shards in host memory; exact gradients and an AdamW step equal to the reference's, and the
    host bytes the cost model predicts."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from infinipipe_hf.runtime.parallel.fsdp_api import full_tensor

    t0 = time.time()
    batch = random_batch(LENGTHS, seed=8, with_labels=True)
    (want_loss,), want, ref = reference("llama", False, [batch])
    cfg = InfiniPipeConfig(state_offload="states", p2p_timeout_s=60, **cfg_kw)
    engine = PipelineEngine(tiny_model("llama"), cfg)
    policies = {type(fully_shard.state(m)._fsdp_param_group.offload_policy) for m in engine.sharding.modules}
    assert policies == {CPUOffloadPolicy}, policies
    pp = engine.layout.pp_degree
    out = engine.train_step(batch, plan=make_plan(LENGTHS, UNITS_DP1, pp, engine.layers_per_stage, CKPT["mixed"]))
    assert abs(out.loss - want_loss) <= 1e-10 * abs(want_loss), (out.loss, want_loss)
    got = {n: full_tensor(p.grad) for n, p in engine.named_parameters()}
    from tests.helpers.reference import assert_grads_close

    worst = assert_grads_close(got, {n: want[n] for n in got})
    torch.optim.AdamW(ref.parameters(), **OPT).step()
    opt = torch.optim.AdamW(list(engine.parameters()), **OPT)
    opt.step()
    weights = dict(ref.named_parameters())
    for n, p in engine.named_parameters():
        full = full_tensor(p.detach())
        assert (full - weights[n]).abs().max().item() <= 1e-10 * weights[n].abs().max().item(), n
    got, want = states_host_bytes(engine, opt)
    assert abs(got - want) <= 0.05 * want, f"host bytes of the states: measured {got}, predicted {want:.0f}"
    log(f"CASE {name} OK worst_rel={worst:.2e} host_bytes={got} predicted={want:.0f} "
        f"{time.time() - t0:.2f}s")


def states_host_bytes(engine, opt) -> tuple[int, float]:
    """Host bytes of this rank's shards, gradient shards and AdamW states (all on the CPU), and the
    cost model's ``state_host.host_bytes`` for the stage (float64 states: 32 bytes per parameter)."""
    from infinipipe_hf.ir.model_spec import ModelSpec
    from infinipipe_hf.planner.cost.model import CostModel
    from infinipipe_hf.planner.cost.states import StatePrecision
    from infinipipe_hf.runtime.parallel.fsdp_api import local_tensor

    def nbytes(t) -> int:
        t = local_tensor(t)
        assert t.device.type == "cpu", t.device
        return t.numel() * t.element_size() if t.dim() else 0  # step counts: not states

    got = sum(nbytes(p) + nbytes(p.grad) for p in engine.parameters())
    got += sum(nbytes(t) for st in opt.state.values() for t in st.values())
    fp64 = StatePrecision(state_bytes_per_param=32, grad_bytes_per_param=8, compute_bytes_per_param=8,
                          reduce_bytes_per_param=8, optimizer_bytes_per_param=16)
    cost = CostModel(ModelSpec.from_hf_config(engine.stage.config), None, engine.layout.dims,
                     layers_per_stage=engine.layers_per_stage, state_precision=fp64, host_budget_bytes=2.0**40)
    return got, cost.state_host.host_bytes(engine.layout.stage_index)


def pp2(out_dir: str) -> None:
    offload_case("pp2_offload_levels_kv", pp=2, sp=1, offload_kv=[1])
    offload_case("pp2_offload_levels_kv_both", pp=2, sp=1, offload_kv=[0, 1], family="qwen2")
    offload_case("pp2_offload_attn_levels", pp=2, sp=1, offload_kv=[], level="offload_attn")
    offload_case("pp2_offload_attn_levels_kv", pp=2, sp=1, offload_kv=[1], family="qwen2", level="offload_attn")
    offload_case("pp2_offload_pair_levels", pp=2, sp=1, offload_kv=[1], level="offload_pair")
    optimizer_offload_resume(out_dir)
    states_offload("pp2_states_offload_unsharded", pp_degree=2)


def sp2(out_dir: str) -> None:
    offload_case("sp2_offload_levels_kv", pp=1, sp=2, offload_kv=[0])
    offload_case("sp2_offload_attn_levels", pp=1, sp=2, offload_kv=[], level="offload_attn")
    offload_case("sp2_offload_pair_levels", pp=1, sp=2, offload_kv=[], level="offload_pair")
    states_offload("sp2_states_offload", sp_degree=2, shard="sp")


if __name__ == "__main__":
    init()
    {"pp2": pp2, "sp2": sp2}[sys.argv[1]](sys.argv[2])
    dist.barrier()
    log("ALL OK")
    dist.destroy_process_group()
