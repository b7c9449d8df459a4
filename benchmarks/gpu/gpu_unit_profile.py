"""Fit a GPU cost profile on units of every kind timed through the runtime, beside the whole-layer one.

    python -m benchmarks.gpu.gpu_unit_profile --model llama3.2-1b [--base-profile DIR/llama3.2-1b.profile.json] \
        --profile-out OUT/llama3.2-1b.units.profile.json --out OUT/gpu_unit_profile.json
    python -m benchmarks.gpu.gpu_unit_profile --tiny --device cpu --dtype fp32 --profile-out P.json --out R.json

The whole-layer profile (``profiling/run.py``: one HF decoder layer on whole causal sequences,
SDPA) cannot see what the pipeline runs: packs and slices go through the runtime's varlen kernel,
and whole sequences alone cannot tell the per-token from the per-pair cost.  Here every row is
one *unit* run through ``StageRunner`` on a one-layer middle stage (``benchmarks/lib/runtime_rows.py``,
wall seconds between device synchronisations on CUDA): whole sequences, slices carrying K/V
context, packs of many equal short sequences and hybrids (a slice plus short sequences), then the
chunked loss and the embedding.  Shapes are multiples of ``--block`` tokens (1024: units of 1K to
32K tokens).  ``runtime_fit.fit_runtime_profile`` fits the layer, head and embedding times on the
*fit* rows; every other field (activation and working bytes, elementwise bandwidth, links) comes
from the base profile: ``--base-profile`` (e.g. what ``gpu_profile.py`` saved), or else the
whole-layer profile measured here first on the same model.

Written: the fitted profile (``--profile-out``) and a report (``--out``) with every row, its
measured / predicted under the fitted profile (fit and held-out rows) and under the base profile,
the worst of each, and per unit kind (whole, slice, pack, hybrid, loss, embedding) the median
measured / predicted under both profiles: a median above 1 under the base is a kind it under-prices.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import benchmarks.gpu.gpu_common as gc_

# Shapes in blocks: (start, end) segments of distinct sequences; start > 0 carries start of context.
FIT_UNITS = ([((0, n),) for n in (1, 2, 4, 8, 16, 32)]
             + [((c, e),) for c, e in ((2, 4), (4, 8), (8, 16), (16, 24), (24, 32), (28, 32))]
             + [((0, n),) * k for n, k in ((1, 4), (1, 16), (2, 8), (4, 4), (1, 32), (8, 2))]
             + [((8, 16),) + ((0, 1),) * 8, ((4, 8),) + ((0, 2),) * 2])
HELD_OUT_UNITS = ([((0, n),) for n in (12, 24)]
                  + [((c, e),) for c, e in ((12, 20), (20, 32), (6, 8))]
                  + [((0, n),) * k for n, k in ((1, 8), (2, 12), (4, 2))]
                  + [((16, 24),) + ((0, 1),) * 8, ((2, 4),) + ((0, 1),) * 4])
FIT_LOSS, HELD_OUT_LOSS = (1, 4, 8, 16), (2, 12)
FIT_EMB, HELD_OUT_EMB = (1, 8, 32), (4,)
LOSS_CHUNK_BLOCKS = 4  # the GPU benchmarks' loss_chunk_tokens (4096) at --block 1024
BASE_LENGTHS, BASE_HEAD = (1, 2, 4, 8, 16, 32), (1, 4)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def unit_kind(segments) -> str:
    """``whole`` (one sequence from 0), ``slice`` (one with context), ``pack`` (several whole
    sequences) or ``hybrid`` (a slice plus whole sequences)."""
    sliced = any(a > 0 for a, _ in segments)
    if len(segments) == 1:
        return "slice" if sliced else "whole"
    return "hybrid" if sliced else "pack"


def _tokens(shapes, block: int) -> list:
    return [tuple((a * block, b * block) for a, b in segs) for segs in shapes]


def model_config(args) -> dict:
    config = gc_.load_config(None, True) if args.tiny else _named_config(args.model)
    return {**config, "num_hidden_layers": args.layers}


def _named_config(name: str) -> dict:
    from infinipipe_hf.models.model_configs import config_path

    with open(config_path(name)) as f:
        return json.load(f)


def base_profile(args, config: dict, spec, log):
    """The whole-layer profile: loaded, or measured here on ``config`` (``profiling/run.py``)."""
    from benchmarks.lib.runtime_fit import reference_of
    from benchmarks.lib.shared_cores import device_profile

    if args.base_profile:
        prof, source = device_profile(args.base_profile), args.base_profile
    else:
        from infinipipe_hf.profiling.run import run_profile

        prof, _ = run_profile(config, device=args.device, dtype=args.dtype,
                              lengths=[n * args.block for n in BASE_LENGTHS],
                              head_tokens=[n * args.block for n in BASE_HEAD], warmup=1, repeat=3,
                              name=f"{args.model}-{args.dtype}-whole-layer", log=log)
        source = "measured here: profiling/run.py, whole causal sequences through one HF layer"
    want = reference_of(spec)
    got = {k: prof.reference.get(k) for k in want}
    if got != want:
        raise SystemExit(f"error: --base-profile {args.base_profile} was measured on layer shape {got}, "
                         f"not the model's {want}; its memory figures would not apply")
    return prof, source


def measure(args, config: dict, device: torch.device, log) -> dict[str, list[dict]]:
    """Fit and held-out rows of every kind (each kind's fit and held-out shapes interleaved)."""
    from benchmarks.lib.runtime_rows import (
        UnitCase,
        measure_embedding_rows,
        measure_loss_rows,
        measure_unit_rows,
    )

    b, kw = args.block, dict(repeat=args.repeat, warmup=args.warmup)
    model = gc_.make_model(config, device, DTYPES[args.dtype])
    fit_units, held_units = _tokens(FIT_UNITS, b), _tokens(HELD_OUT_UNITS, b)
    t0 = time.perf_counter()
    units = measure_unit_rows(copy.deepcopy(model), [UnitCase(s) for s in fit_units + held_units], **kw)
    log(f"  {len(units)} unit rows in {time.perf_counter() - t0:.1f} s")
    loss = measure_loss_rows(copy.deepcopy(model), [n * b for n in FIT_LOSS + HELD_OUT_LOSS],
                             loss_chunk_tokens=LOSS_CHUNK_BLOCKS * b, **kw)
    emb = measure_embedding_rows(model, [n * b for n in FIT_EMB + HELD_OUT_EMB], **kw)
    log(f"  loss and embedding rows after {time.perf_counter() - t0:.1f} s")
    nu, nl, ne = len(fit_units), len(FIT_LOSS), len(FIT_EMB)
    return {"fit": units[:nu] + loss[:nl] + emb[:ne], "held_out": units[nu:] + loss[nl:] + emb[ne:]}


def _kind_of(entry: dict) -> str:
    if entry["kind"] == "unit_layer":
        return unit_kind(entry["segments"])
    return {"unit_loss": "loss"}.get(entry["kind"], entry["kind"])


def _worst(errors: list[dict]) -> dict:
    miss, e, k = max(((abs(e[f"{k}_ratio"] - 1), e, k) for e in errors for k in ("fwd", "bwd")),
                     key=lambda t: t[0])
    return {"relative_error": miss, "row": e.get("segments", e.get("tokens")), "kind": _kind_of(e),
            "direction": k, "measured_s": e[f"{k}_measured_s"], "ratio": e[f"{k}_ratio"]}


def per_kind(fitted: list[dict], base: list[dict]) -> dict:
    """Per unit kind: rows and the median measured / predicted under each profile."""
    out: dict[str, dict] = {}
    for name, errors in (("fitted", fitted), ("base", base)):
        for e in errors:
            kind = out.setdefault(_kind_of(e), {"rows": 0})
            for k in ("fwd", "bwd"):
                kind.setdefault(f"{name}_{k}", []).append(e[f"{k}_ratio"])
    for kind in out.values():
        kind["rows"] = len(kind["fitted_fwd"])
        for key in [k for k in kind if k != "rows"]:
            kind[key] = float(statistics.median(kind[key]))
    return out


def fit_and_report(args, config: dict, rows: dict, base, base_source: str, env: dict) -> tuple:
    from benchmarks.lib.runtime_fit import fit_runtime_profile, row_errors
    from infinipipe_hf.ir.model_spec import ModelSpec

    spec = ModelSpec.from_config_dict(config)
    profile = fit_runtime_profile(
        rows["fit"], spec, name=f"{args.model}-{args.dtype}-runtime-units", base=base,
        bytes_per_element=torch.empty((), dtype=DTYPES[args.dtype]).element_size(),
        meta={"env": env, "source": "benchmarks/gpu/gpu_unit_profile.py", "base_profile": base_source,
              "clock": "wall seconds between device synchronisations" if env["device"].startswith("cuda")
              else "per-thread CPU seconds"})
    fit_err, held_err = row_errors(profile, spec, rows["fit"]), row_errors(profile, spec, rows["held_out"])
    base_err = row_errors(base, spec, rows["fit"] + rows["held_out"])
    for errors, split in ((fit_err, "fit"), (held_err, "held_out"), (base_err, "fit+held_out")):
        for e in errors:
            e["split"], e["unit_kind"] = split, _kind_of(e)
    report = {"env": env, "args": vars(args), "model": config, "base_profile_source": base_source,
              "fit_rows": rows["fit"], "held_out_rows": rows["held_out"], "fit_errors": fit_err,
              "held_out_errors": held_err, "base_errors": base_err,
              "fit_worst": _worst(fit_err), "held_out_worst": _worst(held_err),
              "fit_worst_unit": _worst([e for e in fit_err if e["kind"] == "unit_layer"]),
              "held_out_worst_unit": _worst([e for e in held_err if e["kind"] == "unit_layer"]),
              "per_kind": per_kind(fit_err + held_err, base_err),
              "profile": profile.to_dict(), "base_profile": base.to_dict()}
    report["fit_worst_relative_error"] = report["fit_worst"]["relative_error"]
    report["held_out_worst_relative_error"] = report["held_out_worst"]["relative_error"]
    return profile, report


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3.2-1b", help="shipped model config name")
    p.add_argument("--tiny", action="store_true", help="the tiny test shape with --block 8 (dry run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--layers", type=int, default=3, help="decoder layers built (one middle layer is timed)")
    p.add_argument("--block", type=int, default=None, help="tokens per shape block (default 1024; --tiny 8)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--base-profile", default=None, help="whole-layer profile of this model (default: measure it)")
    p.add_argument("--profile-out", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    for flag, value, least in (("--repeat", args.repeat, 1), ("--warmup", args.warmup, 0),
                               ("--layers", args.layers, 3), ("--block", args.block, 1)):
        if value is not None and value < least:
            p.error(f"{flag} must be >= {least}, got {value}")
    args.block = args.block or (8 if args.tiny else 1024)
    if args.tiny:
        args.model = "tiny"
    return args


def main(argv=None) -> int:
    from infinipipe_hf.ir.model_spec import ModelSpec

    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA device is visible; use --tiny --device cpu")
    t0 = time.perf_counter()

    def log(s):
        print(f"[{time.perf_counter() - t0:6.1f} s] {s}", file=sys.stderr, flush=True)

    config = model_config(args)
    base, source = base_profile(args, config, ModelSpec.from_config_dict(config), log)
    log(f"base profile: {source}")
    rows = measure(args, config, device, log)
    profile, report = fit_and_report(args, config, rows, base, source, gc_.environment(device))
    report["elapsed_s"] = time.perf_counter() - t0
    for path in (args.profile_out, args.out):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    profile.save(args.profile_out)
    Path(args.out).write_text(json.dumps(report, indent=1))
    summary = {k: report[k] for k in ("fit_worst_relative_error", "held_out_worst_relative_error", "elapsed_s")}
    print(json.dumps({**summary, "per_kind": {k: {n: round(v, 3) for n, v in d.items()}
                                              for k, d in report["per_kind"].items()}}))
    print(f"wrote {args.profile_out} and {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
