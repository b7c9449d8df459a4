"""Fit the CPU cost profile of the benchmark model on this machine, from separate measurements.

    python -m benchmarks.cpu.cpu_profile [--out benchmarks/results/cpu_profile.json] [--quick]

Every piece of a pipeline action is timed on its own, through the runtime's code
(``benchmarks/lib/runtime_rows.py``, one thread, per-thread CPU seconds, medians of
interleaved repeats): a decoder layer's forward and backward on whole sequences, on slices that
carry K/V context and on packs of several sequences; the same with each checkpoint level (whole
layer, ``keep_attn``, ``mlp``, ``mlp_act``); the chunked loss; the embedding; the elementwise product the
``mlp_act`` level redoes; gloo point-to-point messages between two processes, their wall time and the CPU they cost
both ends (``benchmarks/workers/p2p_worker.py``); the allocator peaks of a one-layer unit at each level (the
working memory of ``planner/working_memory.py``).  ``benchmarks/lib/runtime_fit.py`` fits the cost model's coefficients to
the *fit* shapes, and the profile is then checked on *held-out* shapes it never saw (other
lengths, contexts and packs, every checkpoint level: recompute is derived, never fitted), giving
measured / predicted per row.  Memory fields come from the cost model's formulas in float32
(checked against ``saved_tensors_hooks`` in ``tests/runtime/test_memory_model_vs_runtime.py``) and
``state_bytes_per_param = 8`` (float32 weights and gradients; the benchmarks run no optimizer).
The ranks of a run share the cores this process may use (:func:`machine_sharing`, saved beside
the profile's fields as ``shared_cores``; ``sim_vs_real.py`` pins each rank to one of them and
sets ``pinned_ranks``).

Imported by ``sim_vs_real.py`` and ``runtime_cpu_bench.py`` (``fit_cpu_profile``).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.launch import torchrun
from benchmarks.lib.paths import RESULTS

MODEL = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192,
             tie_word_embeddings=False)
LOSS_CHUNK_TOKENS = 1024
P2P_BYTES = [65536, 262144, 1048576, 2097152, 4194304]

# (segments, level): whole sequences and packs up to the benchmark batches' longest unit (3072
# tokens), slices with context; level None.
FIT_SHAPES = ([((0, n),) for n in (64, 128, 256, 512, 768, 1024, 1536, 2048, 3072)]
              + [((c, c + s),) for s, c in ((256, 256), (512, 512), (256, 768), (512, 1024), (128, 1024),
                                            (1024, 1024), (384, 1664))]
              + [tuple((0, n) for n in p) for p in ((64,) * 8, (128,) * 4, (256, 128, 128), (300, 100, 60, 40),
                                                     (512, 256, 128, 64),
                                                     (1024, 768, 512, 256, 192, 128, 64, 64, 32, 16, 8, 8))])
HELD_OUT_SHAPES = ([((0, n),) for n in (384, 1280)]
                   + [((c, c + s),) for s, c in ((640, 640), (192, 1344), (768, 1280))]
                   + [tuple((0, n) for n in p) for p in ((32,) * 16, (200, 150, 100, 62), (700, 300))])
LEVEL_SHAPES = [((0, 512),), ((0, 1024),), ((512, 1024),), ((1024, 1536),)]
# Timed by every rank before and after each schedule of sim_vs_real (runtime_worker.speed_probe): fit
# shapes of each kind (whole, with context, pack, a checkpointed layer), ~0.3 s a repeat.
SPEED_PROBE_SHAPES = [(((0, 512),), None), (((512, 1024),), None), (((0, 128),) * 4, None),
                      (((0, 1024),), "full")]
FIT_LOSS, HELD_OUT_LOSS = (128, 512, 1024, 2048), (768, 1536)
FIT_EMB, HELD_OUT_EMB = (128, 512, 2048), (1024,)


def spec_of(model_cfg: dict):
    from infinipipe_hf.ir.model_spec import ModelSpec

    return ModelSpec.from_config_dict({"model_type": "llama", **model_cfg})


def measure_p2p(timeout_s: float = 300) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "p2p.json"
        p = torchrun(["-m", "benchmarks.workers.p2p_worker", out, *P2P_BYTES], 2, timeout_s)
        if p.returncode != 0:
            raise RuntimeError(f"p2p_worker failed (exit {p.returncode}):\n{p.stdout[-3000:]}")
        return json.loads(out.read_text())


def measure_rows(model_cfg: dict, *, repeat: int, held_out: bool, log=print) -> list[dict]:
    """Rows of the fit shapes (``held_out=False``) or of the held-out ones (module docstring)."""
    import torch
    import transformers

    from benchmarks.lib.runtime_rows import (
        UnitCase,
        measure_elementwise_rows,
        measure_embedding_rows,
        measure_loss_rows,
        measure_memory_rows,
        measure_unit_rows,
    )

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**model_cfg)).float()
    if held_out:
        cases = [UnitCase(s) for s in HELD_OUT_SHAPES] + [
            UnitCase(s, lv) for s in LEVEL_SHAPES for lv in ("full", "keep_attn", "mlp", "mlp_act")]
        loss, emb = HELD_OUT_LOSS, HELD_OUT_EMB
    else:
        cases, loss, emb = [UnitCase(s) for s in FIT_SHAPES], FIT_LOSS, FIT_EMB
    t0 = time.time()
    rows = measure_unit_rows(copy.deepcopy(model), cases, repeat=repeat)
    rows += measure_loss_rows(copy.deepcopy(model), loss, loss_chunk_tokens=LOSS_CHUNK_TOKENS, repeat=repeat)
    rows += measure_embedding_rows(copy.deepcopy(model), emb, repeat=repeat)
    if not held_out:
        rows += measure_elementwise_rows(copy.deepcopy(model), (512, 2048), repeat=repeat)
        rows += measure_memory_rows(copy.deepcopy(model), 512)
    log(f"  {'held-out' if held_out else 'fit'} rows: {len(rows)} in {time.time() - t0:.0f} s")
    return rows


def fit_cpu_profile(quick: bool = False, log=print, model_cfg: dict | None = None):
    """``(profile, report)``: the fitted profile and a JSON-able report (rows, held-out errors, load)."""
    from benchmarks.lib.runtime_fit import fit_runtime_profile, row_errors, worst_error, worst_row
    from benchmarks.lib.shared_cores import profile_dict
    from infinipipe_hf.planner.cost.activations import act_elements
    from infinipipe_hf.runtime.attention.select import context_pairs

    model_cfg = model_cfg or MODEL
    spec = spec_of(model_cfg)
    repeat = 3 if quick else 9
    load_before = os.getloadavg()
    t0 = time.time()
    fit_rows = measure_rows(model_cfg, repeat=repeat, held_out=False, log=log)
    p2p = measure_p2p()
    held = measure_rows(model_cfg, repeat=repeat, held_out=True, log=log)
    profile = fit_runtime_profile(
        fit_rows + p2p, spec, name="cpu-fp32-1thread-runtime-rows", bytes_per_element=4,
        activation_bytes_per_token_per_layer=act_elements(spec.hidden_size, spec.intermediate_size,
                                                          spec.kv_dim, 4) * 4.0,
        attention_mask_bytes_per_element=4.0, state_bytes_per_param=8.0,
        memory_gib=64.0, device="cpu", gpus_per_node=64, context_pairs=context_pairs("cpu"),
        meta={"note": "per-thread CPU seconds through the runtime; benchmarks/cpu/cpu_profile.py"})
    # SP all-to-alls go over the same gloo loopback as the pipeline's messages; every rank is on
    # this one machine (gpus_per_node = 64: no group crosses "nodes").
    profile = dataclasses.replace(profile, intra_node_bandwidth_bytes_per_s=profile.p2p_bandwidth_bytes_per_s,
                                  inter_node_bandwidth_bytes_per_s=profile.p2p_bandwidth_bytes_per_s,
                                  collective_latency_s=profile.p2p_latency_s)
    fit_err, held_err = row_errors(profile, spec, fit_rows), row_errors(profile, spec, held)
    report = {
        "machine": machine(), "load_before": load_before, "load_after": os.getloadavg(),
        "elapsed_s": time.time() - t0, "repeat": repeat, "model": model_cfg,
        "loss_chunk_tokens": LOSS_CHUNK_TOKENS, "p2p_rows": p2p,
        "fit_rows": fit_rows, "held_out_rows": held,
        "fit_errors": fit_err, "held_out_errors": held_err,
        "fit_worst_relative_error": worst_error(fit_err),
        "held_out_worst_relative_error": worst_error(held_err),
        "fit_worst_row": worst_row(fit_err), "held_out_worst_row": worst_row(held_err),
        # Rows of at least 1 ms: what a step's time is made of (the embedding's rows are ~0.05 ms).
        "fit_worst_relative_error_over_1ms": worst_error(fit_err, 1e-3),
        "held_out_worst_relative_error_over_1ms": worst_error(held_err, 1e-3),
        "profile": profile_dict(profile, machine_sharing()),
    }
    log(f"  profile fitted in {report['elapsed_s']:.0f} s: worst |measured/predicted - 1| "
        f"{report['fit_worst_relative_error']:.3f} on fit rows ({report['fit_worst_row']}), "
        f"{report['held_out_worst_relative_error']:.3f} held out; on rows of 1 ms or more "
        f"{report['fit_worst_relative_error_over_1ms']:.3f} fit, "
        f"{report['held_out_worst_relative_error_over_1ms']:.3f} held out")
    return profile, report


def wait_for_low_load(max_load: float, max_wait_s: float, log=print) -> dict:
    """Wait (up to ``max_wait_s``) until the machine's 1-minute load is below ``max_load``; the load seen."""
    t0 = time.time()
    load = os.getloadavg()
    while load[0] > max_load and time.time() - t0 < max_wait_s:
        time.sleep(10)
        load = os.getloadavg()
    waited = time.time() - t0
    if load[0] > max_load:
        log(f"  load {load[0]:.2f} still above {max_load} after {waited:.0f} s; running anyway")
    return {"load_at_start": list(load), "waited_s": waited, "low": load[0] <= max_load}


def load_or_fit(profile: str | None, report: str | None, *, quick: bool, pinned: bool, max_load: float,
                max_wait_s: float, log=print) -> tuple:
    """``(profile, shared cores, report)``: a saved benchmark profile (``profile``), the one of a
    report of this module (``report``), or one fitted now once the load is low; the ranks pinned
    to cores when ``pinned``."""
    from benchmarks.lib.shared_cores import load_profile, split_profile

    if profile:
        (prof, shared), rep = load_profile(profile), {"reused_profile": profile}
    elif report:
        rep = json.loads(Path(report).read_text())
        prof, shared = split_profile(rep["profile"])
    else:
        # The fit times isolated shapes: on a machine still busy (another benchmark ending) its
        # coefficients would carry that load into every later comparison.
        wait_for_low_load(max_load, max_wait_s, log)
        (prof, rep), shared = fit_cpu_profile(quick, log=log), machine_sharing()
    if shared is None and pinned:
        raise ValueError("pinning ranks to cores needs the cores they share: the profile has no shared_cores; "
                         "fit one here (no saved profile or report) or leave the ranks unpinned (--no-pin)")
    return prof, (dataclasses.replace(shared, pinned=pinned) if shared else None), rep


def machine_sharing(pinned: bool = False):
    """How the ranks of a run on this machine share its cores: all of :func:`usable_cores`."""
    from benchmarks.lib.shared_cores import SharedCores

    return SharedCores(float(usable_cores()), pinned)


def usable_cores() -> int:
    """Cores this process may run on (a cpuset or taskset can allow fewer than the machine has):
    the ranks of a run share these, and ``runtime_worker.pin_to_core`` pins to them."""
    return len(os.sched_getaffinity(0))


def machine() -> dict:
    import platform

    import torch
    import transformers

    return {"cpu": platform.processor() or platform.machine(), "cores": usable_cores(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "threads_per_rank": 1, "backend": "gloo",
            "note": "cores shared with other jobs (other sessions' tests); load averages recorded"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(RESULTS / "cpu_profile.json"))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    profile, report = fit_cpu_profile(args.quick, log=lambda s: print(s, file=sys.stderr))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    for e in report["held_out_errors"]:
        what = e.get("segments", e.get("tokens"))
        print(f"{e['kind']:>10} {str(what)[:40]:<40} {str(e.get('level') or ''):>8}  "
              f"measured/predicted fwd {e['fwd_ratio']:.3f} bwd {e['bwd_ratio']:.3f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
