"""Shared pieces of the distributed test workers: process-group start-up and one exact-gradient case.

A case builds the same tiny random model twice from one seed: one copy is the unsplit float64
reference (plain HF forward/backward in this process), the other is cut into this rank's stage by
``PipelineEngine``.  Every gradient this rank holds must equal the reference's, and the union of all
ranks' parameter names must cover the whole model, so a parameter that silently gets no gradient
or is dropped from every stage fails the case.
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from infinipipe_hf import InfiniPipeConfig
from infinipipe_hf.runtime.engine.engine import PipelineEngine
from tests.distributed.plans import make_plan
from tests.helpers.reference import assert_grads_close, random_batch, reference_loss_and_grads, tiny_model

CKPT = {
    "none": None,
    "all": lambda stage, unit, layers: layers,
    "mixed": lambda stage, unit, layers: (stage + unit) % (layers + 1),
}


def init() -> None:
    """Start this rank's gloo group (once: the workers of a merged launch share it, ``suites.py``)."""
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")


def exit_now(code: int) -> None:
    """Leave with ``code`` at once.  After a collective timed out, gloo's timed-out work still
    holds a thread; tearing the groups down at interpreter exit can then abort the process
    ("terminate called without an active exception", SIGABRT) and hide the exit code under test."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def report_done(done_dir: str | None) -> None:
    """Write ``done_dir/done.<rank>`` (when given): this rank has reported its failure, so a
    stuck peer waiting in ``stay_until_reported`` may go."""
    if done_dir:
        open(os.path.join(done_dir, f"done.{dist.get_rank()}"), "w").close()


def stay_until_reported(done_dir: str | None, others: int, at_most_s: float) -> None:
    """Hang, alive and silent, until ``others`` ranks wrote ``done.<rank>`` into ``done_dir``
    (then 1 s more, so they have surely exited first) or ``at_most_s`` passed.  Without a folder,
    hang the whole ``at_most_s``."""
    end = time.time() + at_most_s
    while done_dir and time.time() < end:
        if sum(name.startswith("done.") for name in os.listdir(done_dir)) >= others:
            time.sleep(1.0)
            return
        time.sleep(0.2)
    time.sleep(max(0.0, end - time.time()))


def fail_at_forward(engine: PipelineEngine, mode: str, call: int, timeout_s: float,
                    done_dir: str | None = None) -> None:
    """Make this rank die (``die``: exit 17) or hang past its peers' deadlines and then leave
    (``stuck``: until every other rank reported into ``done_dir``, at most well past the
    deadlines) at its ``call``-th unit forward."""
    calls = {"n": 0}
    fwd = engine.runner.forward

    def forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            print(f"[rank {dist.get_rank()}] sabotage: {mode}", flush=True)
            if mode == "die":
                os._exit(17)
            stay_until_reported(done_dir, dist.get_world_size() - 1, timeout_s * 4 + 10)
            os._exit(0)
        return fwd(*args, **kwargs)

    engine.runner.forward = forward


def log(msg: str) -> None:
    print(f"[rank {dist.get_rank()}] {msg}", flush=True)


def expect_value_error(name: str, fragments, fn) -> None:
    """Log ``CASE <name> OK`` if ``fn()`` raises a ValueError whose message holds every fragment
    (one string or several); fail otherwise."""
    fragments = [fragments] if isinstance(fragments, str) else list(fragments)
    try:
        fn()
    except ValueError as exc:
        for f in fragments:
            assert f in str(exc), f"{name}: message {str(exc)!r} lacks {f!r}"
        log(f"CASE {name} OK error={str(exc)[:120]!r}")
        return
    raise AssertionError(f"{name}: no ValueError raised")


def storage_key(t):
    st = t.untyped_storage()
    return st.data_ptr(), st.nbytes()


def saved_bytes(fn, params) -> int:
    """Bytes of the distinct storages autograd saves while ``fn`` runs (parameters excluded), plus
    the inputs every checkpoint region keeps (whole layers and the levels inside a layer) and
    what keep_attn layers keep in their unit's store (outside autograd's saved tensors)."""
    from infinipipe_hf.runtime.recompute import layers as checkpointing
    from infinipipe_hf.runtime.recompute import mlp_levels

    skip = {storage_key(p) for p in params}
    seen = {}

    def add(t):
        if isinstance(t, torch.Tensor) and storage_key(t) not in skip:
            seen[storage_key(t)] = storage_key(t)[1]

    real = checkpointing.checkpoint
    stores = []

    def counting(f, *args, **kwargs):  # a checkpoint region keeps its inputs
        for a in list(args) + list(kwargs.values()):
            for t in (a if isinstance(a, tuple) else (a,)):
                add(t)
        store = getattr(kwargs.get("epp_unit"), "kept_attention", None)
        if store is not None and all(store is not s for s in stores):
            stores.append(store)
        return real(f, *args, **kwargs)

    checkpointing.checkpoint = mlp_levels.checkpoint = counting
    try:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (add(t), t)[1], lambda t: t):
            fn()
        for store in stores:
            for t in store.tensors():
                add(t)
    finally:
        checkpointing.checkpoint = mlp_levels.checkpoint = real
    return int(sum(seen.values()))


def reference(family: str, tie: bool, batches: list[list[dict]], num_layers: int = 4, seed: int = 0):
    """Reference loss per batch and the summed gradients of all batches (names incl. tied alias)."""
    model = tiny_model(family, seed=seed, num_layers=num_layers, tie=tie)
    # HF's eager attention runs its softmax in float32 (~1e-7 relative error); SDPA stays in
    # float64, which the 1e-10 comparison needs.
    model.config._attn_implementation = "sdpa"
    losses, total = [], {}
    for batch in batches:
        loss, _ = reference_loss_and_grads(model, batch)
        losses.append(loss)
        for n, p in model.named_parameters(remove_duplicate=False):
            total[n] = total.get(n, 0) + p.grad.detach().clone()
    return losses, total, model


def check_grads(engine: PipelineEngine, want: dict) -> float:
    got = {}
    for n, p in engine.named_parameters():
        assert p.grad is not None, f"{n} has no gradient on rank {dist.get_rank()}"
        got[n] = p.grad
    worst = assert_grads_close(got, {n: want[n] for n in got})
    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(got))
    covered = set().union(*map(set, names))
    missing = set(want) - covered
    assert not missing, f"parameters on no stage: {sorted(missing)[:5]}"
    return worst


def levels_after_whole(stage: int, unit: int, layers: int, whole: int) -> dict[str, int]:
    """Finer checkpoint levels for the layers ``whole`` leaves: cycle mlp / mlp_act / both /
    keep_attn / keep_attn and mlp / none."""
    free = layers - whole
    if free < 1:
        return {}
    pick = (stage + unit) % 6
    want = [{"mlp": free}, {"mlp_act": free}, {"mlp": 1, "mlp_act": free - 1}, {"keep_attn": free},
            {"keep_attn": 1, "mlp": free - 1}, {}][pick]
    return {lv: n for lv, n in want.items() if n > 0}


def add_levels(plan, layers_per_stage) -> None:
    """Give ``plan`` finer checkpoint levels on the layers its whole-layer counts leave."""
    for s, layers in enumerate(layers_per_stage):
        for u in plan.units:
            per = levels_after_whole(s, u.id, layers, plan.checkpointed(s, u.id))
            if per:
                plan.checkpoint_levels.setdefault(s, {})[u.id] = per
    assert any("keep_attn" in per for st in plan.checkpoint_levels.values() for per in st.values())


def run_case(name: str, *, family: str, tie: bool, pp: int, lengths: list[int], units_per_dp,
             ckpt: str = "none", labels: bool = False, layer_split=None, num_layers: int = 4,
             seed: int = 0, levels: bool = False) -> None:
    t0 = time.time()
    batch = random_batch(lengths, seed=seed + 1, with_labels=labels)
    (want_loss,), want, _ = reference(family, tie, [batch], num_layers, seed)
    model = tiny_model(family, seed=seed, num_layers=num_layers, tie=tie)
    engine = PipelineEngine(model, InfiniPipeConfig(pp_degree=pp, layer_split=layer_split,
                                                    p2p_timeout_s=60))
    plan = make_plan(lengths, units_per_dp, pp, engine.layers_per_stage, checkpoint=CKPT[ckpt])
    if levels:  # finer checkpoint levels on the layers not checkpointed whole
        add_levels(plan, engine.layers_per_stage)
    out = engine.train_step(batch, plan=plan)
    loss_rel = abs(out.loss - want_loss) / abs(want_loss)
    assert loss_rel <= 1e-10, (out.loss, want_loss)
    worst = check_grads(engine, want)
    log(f"CASE {name} OK loss={out.loss:.12f} loss_rel={loss_rel:.2e} worst_rel={worst:.2e} "
        f"{time.time() - t0:.2f}s")


# Batches producing slice, hybrid and packed units.  Seq 0 (37 tokens) is cut in three slices,
# the tail packed with seq 1 (hybrid); seq 4 in two, its tail packed with seq 2; seqs 3 and 5 packed.
LENGTHS = [37, 11, 8, 5, 23, 6]
UNITS_DP1 = [[
    [(0, 0, 13)], [(0, 13, 25)], [(0, 25, 37), (1, 0, 11)],
    [(4, 0, 15)], [(4, 15, 23), (2, 0, 8)], [(3, 0, 5), (5, 0, 6)],
]]
UNITS_DP2 = [
    [[(0, 0, 13)], [(0, 13, 25)], [(0, 25, 37), (3, 0, 5)]],
    [[(4, 0, 15)], [(4, 15, 23), (2, 0, 8)], [(1, 0, 11), (5, 0, 6)]],
]
