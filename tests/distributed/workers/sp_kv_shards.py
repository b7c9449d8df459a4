"""The K/V store sharded over the SP ranks sharing a K/V head: exactness and bytes (4 ranks).

``sp_kv_shards.py`` on 4 ranks, pp 1 x sp 4, a tiny float64 Llama of 4 query heads with 2 K/V
heads (K/V groups of r = 2 ranks) and with 1 K/V head (one group of r = 4): a long sequence in
five slices (one of 2 tokens, so some ranks keep no row of it; hybrids with short sequences) and
short sequences, with every checkpoint level (``full``, ``offload``, ``keep_attn``,
``offload_attn``, ``offload_pair``, ``mlp``, ``mlp_act``) and with and without ``offload_kv``.  Loss and every
gradient equal single-process HF (1e-10 relative); the replicated store (sharding turned off) too.
After each forward, the store's device bytes (host bytes with ``offload_kv``) of the ranks of one
K/V group add up to one rank's replicated store: each rank holds its 1/r.  Prints ``CASE <name> OK`` and ``ALL OK``.
"""
from __future__ import annotations

import time

from common import check_grads, dist, init, log, make_plan, random_batch, torch

from infinipipe_hf import InfiniPipeConfig
from infinipipe_hf.runtime.engine.engine import PipelineEngine
from tests.helpers.reference import reference_loss_and_grads, tiny_model

LENGTHS = [45, 7, 3, 11]
UNITS = [[[(0, 0, 10)], [(0, 10, 19)], [(0, 19, 21)], [(0, 21, 33), (1, 0, 7)], [(0, 33, 45), (2, 0, 3)],
          [(3, 0, 11)]]]
MIXES = [{"offload": 1, "keep_attn": 1, "mlp": 1}, {"offload_attn": 2, "mlp_act": 1},
         {"keep_attn": 2, "mlp_act": 1}, {"offload": 2, "offload_attn": 1},
         {"mlp": 1, "offload_attn": 1, "offload_pair": 2}, {}]
"""Finer levels per unit (by id); odd units also have one layer checkpointed whole.  Unit 4 (a
slice with context beside a short sequence) has an ``offload_pair`` pair, whose rebuild in
backward reads the context (a collective over the K/V group) on every rank again."""


def reference(kv_heads: int):
    model = tiny_model("llama", seed=0, num_layers=4, heads=4, kv_heads=kv_heads)
    batch = random_batch(LENGTHS, seed=7, with_labels=True)
    loss, _ = reference_loss_and_grads(model, batch)
    return batch, loss, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def host_kv_bytes(store) -> int:
    """Bytes of the K/V (and gradients) the store keeps in its host tier."""
    from infinipipe_hf.runtime.attention.kv_store import HostKVEntry

    n = 0
    for per_seq in store._entries.values():
        for e in per_seq.values():
            assert isinstance(e, HostKVEntry) and e.bytes() == 0, e
            for h in (e.k, e.v, e.gk, e.gv):
                n += 0 if h is None else h.host.numel() * h.host.element_size()
    return n


def step(kv_heads: int, batch, *, levels: bool, offload_kv: bool, shard: bool):
    """One train step; returns the engine, its loss and the store's bytes after each forward."""
    model = tiny_model("llama", seed=0, num_layers=4, heads=4, kv_heads=kv_heads)
    engine = PipelineEngine(model, InfiniPipeConfig(sp_degree=4, p2p_timeout_s=60))
    sp = engine.sequence_parallel
    assert sp.kv_group is not None and sp.kv_group.size == 4 // kv_heads, sp.kv_group
    assert sp.kv_group.position == engine.layout.sp_rank % (4 // kv_heads)
    if not shard:
        sp.kv_group = None
    plan = make_plan(LENGTHS, UNITS, 1, engine.layers_per_stage,
                     checkpoint=(lambda s, u, layers: u % 2) if levels else None)
    if levels:
        plan.checkpoint_levels = {0: {u.id: MIXES[u.id] for u in plan.units if MIXES[u.id]}}
    plan.offload_kv = [0] if offload_kv else []
    held, forward = [], engine.runner.forward

    def counting(unit_id, hidden_in):
        out = forward(unit_id, hidden_in)
        store = engine.runner.kv_store
        held.append(host_kv_bytes(store) if offload_kv else store.bytes())
        return out

    engine.runner.forward = counting
    out = engine.train_step(batch, plan=plan)
    return engine, out.loss, held


def case(name: str, kv_heads: int, *, levels: bool, offload_kv: bool) -> None:
    t0 = time.time()
    batch, want_loss, want = reference(kv_heads)
    r = 4 // kv_heads
    results = {}
    for shard in (True, False):
        engine, loss, held = step(kv_heads, batch, levels=levels, offload_kv=offload_kv, shard=shard)
        assert abs(loss - want_loss) <= 1e-10 * abs(want_loss), (name, shard, loss, want_loss)
        worst = check_grads(engine, want)
        results[shard] = (held, worst)
    sharded, replicated = results[True][0], results[False][0]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, sharded)
    group = every[dist.get_rank() // r * r:dist.get_rank() // r * r + r]
    summed = [sum(vals) for vals in zip(*group)]
    assert max(replicated) > 0 and summed == replicated, (name, summed, replicated)
    ratio = max(sharded) / max(replicated) if max(replicated) else 0.0
    log(f"CASE {name} OK worst_rel={max(results[True][1], results[False][1]):.2e} r={r} "
        f"peak_store_ratio={ratio:.3f} {'host' if offload_kv else 'device'} {time.time() - t0:.2f}s")


def main() -> None:
    init()
    torch.set_num_threads(1)
    for kv_heads in (2, 1):
        tag = f"sp4_kv{kv_heads}"
        case(f"{tag}_plain", kv_heads, levels=False, offload_kv=False)
        case(f"{tag}_levels", kv_heads, levels=True, offload_kv=False)
        case(f"{tag}_levels_offload_kv", kv_heads, levels=True, offload_kv=True)
    dist.barrier()
    log("ALL OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
