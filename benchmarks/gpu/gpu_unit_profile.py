"""Fit a GPU cost profile on units of every kind timed through the runtime, beside the whole-layer one.

    python -m benchmarks.gpu.gpu_unit_profile --model llama3.2-1b [--base-profile DIR/llama3.2-1b.profile.json] \
        [--depths 1,3] [--backends auto,sdpa] [--max-blocks 16] \
        --profile-out OUT/llama3.2-1b.units.profile.json --out OUT/gpu_unit_profile.json [--out-key KEY]
    python -m benchmarks.gpu.gpu_unit_profile --tiny --device cpu --dtype fp32 --profile-out P.json --out R.json

With ``--depths 1,3`` (the default) every unit runs on middle stages of one and of three layers
(``benchmarks/lib/stage_depth.py``): the difference is one layer's time, the rest the stage's
per-unit cost, which the profile carries as ``stage_unit_s`` (charged once per action by the cost
model) instead of folding it into every layer; the report gives it per unit kind and backend and
also scores the one-layer fit of the same rows (what ``--depths none`` fits) on both depths.

The whole-layer profile (``profiling/run.py``: one HF decoder layer on whole causal sequences,
SDPA) cannot see what the pipeline runs: packs and slices go through the runtime's varlen kernel,
and whole sequences alone cannot tell the per-token from the per-pair cost.  Here every row is
one *unit* run through ``StageRunner`` on a middle stage (``benchmarks/lib/runtime_rows.py``,
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
``--out-key`` adds the report under that key of an existing ``--out`` JSON (the GPU suite keeps
its files few).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import benchmarks.gpu.gpu_common as gc_
from benchmarks.lib.stage_depth import unit_kind

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


def _tokens(shapes, block: int) -> list:
    return [tuple((a * block, b * block) for a, b in segs) for segs in shapes]


def model_config(args) -> dict:
    """The model's config with ``--layers`` decoder layers (at least the deeper stage + 2)."""
    config = gc_.load_config(None, True) if args.tiny else _named_config(args.model)
    return {**config, "num_hidden_layers": max(args.layers, max(args.depths or (1,)) + 2)}


def shapes(args) -> tuple[list, list]:
    """Fit and held-out unit shapes in tokens, without those longer than ``--max-blocks``."""
    def keep(segs) -> bool:
        return args.max_blocks is None or max(b for _, b in segs) <= args.max_blocks

    return ([s for s in FIT_UNITS if keep(s)], [s for s in HELD_OUT_UNITS if keep(s)])


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
    """Fit and held-out rows of every kind: unit rows on a one-layer stage, or (``--depths``) on
    stages of both depths for each of ``--backends``; then the loss and embedding rows."""
    from benchmarks.lib.runtime_rows import (
        UnitCase,
        measure_embedding_rows,
        measure_loss_rows,
        measure_unit_rows,
    )
    from benchmarks.lib.stage_depth import measure_depth_rows

    b, kw = args.block, dict(repeat=args.repeat, warmup=args.warmup)
    model = gc_.make_model(config, device, DTYPES[args.dtype])
    fit_units, held_units = (_tokens(x, b) for x in shapes(args))
    cases = [UnitCase(s) for s in fit_units + held_units]
    t0 = time.perf_counter()
    if args.depths is None:
        units = measure_unit_rows(copy.deepcopy(model), cases, **kw)
    else:
        units = [r for be in args.backends for r in measure_depth_rows(model, cases, args.depths, backend=be, **kw)]
    fit_keys = {tuple(segs) for segs in fit_units}
    fit_u = [r for r in units if tuple(tuple(x) for x in r["segments"]) in fit_keys]
    held_u = [r for r in units if tuple(tuple(x) for x in r["segments"]) not in fit_keys]
    log(f"  {len(units)} unit rows in {time.perf_counter() - t0:.1f} s")
    loss = measure_loss_rows(copy.deepcopy(model), [n * b for n in FIT_LOSS + HELD_OUT_LOSS],
                             loss_chunk_tokens=LOSS_CHUNK_BLOCKS * b, **kw)
    emb = measure_embedding_rows(model, [n * b for n in FIT_EMB + HELD_OUT_EMB], **kw)
    log(f"  loss and embedding rows after {time.perf_counter() - t0:.1f} s")
    nl, ne = len(FIT_LOSS), len(FIT_EMB)
    return {"fit": fit_u + loss[:nl] + emb[:ne], "held_out": held_u + loss[nl:] + emb[ne:]}


def _kind_of(entry: dict) -> str:
    if entry["kind"] in ("unit_layer", "unit_stage"):
        return unit_kind(entry["segments"])
    return {"unit_loss": "loss"}.get(entry["kind"], entry["kind"])


def _worst(errors: list[dict]) -> dict:
    miss, e, k = max(((abs(e[f"{k}_ratio"] - 1), e, k) for e in errors for k in ("fwd", "bwd")),
                     key=lambda t: t[0])
    return {"relative_error": miss, "row": e.get("segments", e.get("tokens")), "kind": _kind_of(e),
            "direction": k, "measured_s": e[f"{k}_measured_s"], "ratio": e[f"{k}_ratio"]}


def per_kind(errors_by_profile: dict[str, list[dict]]) -> dict:
    """Per unit kind: rows and the median measured / predicted under each named profile."""
    out: dict[str, dict] = {}
    for name, errors in errors_by_profile.items():
        for e in errors:
            kind = out.setdefault(_kind_of(e), {"rows": 0})
            for k in ("fwd", "bwd"):
                kind.setdefault(f"{name}_{k}", []).append(e[f"{k}_ratio"])
    for kind in out.values():
        kind["rows"] = len(kind["fitted_fwd"])
        for key in [k for k in kind if k != "rows"]:
            kind[key] = float(statistics.median(kind[key]))
    return out


def _context_pairs(args, env: dict) -> str:
    """How the first timed backend counts a slice's context pairs (``HardwareProfile.context_pairs``)."""
    from infinipipe_hf.runtime.attention.select import context_pairs

    return context_pairs(env["device"], backend=args.backends[0])


def _fit(args, spec, rows: list[dict], base, base_source: str, env: dict, name: str):
    from benchmarks.lib.runtime_fit import fit_runtime_profile

    return fit_runtime_profile(
        rows, spec, name=f"{args.model}-{args.dtype}-{name}", base=base, context_pairs=_context_pairs(args, env),
        bytes_per_element=torch.empty((), dtype=DTYPES[args.dtype]).element_size(),
        stage_unit_s={},  # not the base's: a one-layer fit holds it in its layer terms; fit_depths sets it
        meta={"env": env, "source": "benchmarks/gpu/gpu_unit_profile.py", "base_profile": base_source,
              "depths": args.depths, "backends": args.backends,
              "clock": "wall seconds between device synchronisations" if env["device"].startswith("cuda")
              else "per-thread CPU seconds"})


def _errors(profile, spec, rows: list[dict]) -> list[dict]:
    """Measured / predicted of unit rows (at their stage depth) and loss and embedding rows."""
    from benchmarks.lib.runtime_fit import row_errors
    from benchmarks.lib.stage_depth import depth_errors

    return depth_errors(profile, spec, rows) + row_errors(profile, spec, rows)


def fit_depths(args, spec, rows: dict, base, base_source: str, env: dict) -> tuple:
    """The stage-depth profile (per-layer terms from the depth difference, ``stage_unit_s`` from
    the intercepts, of the first backend) and, for comparison, the one-layer fit of the same rows."""
    from benchmarks.lib.stage_depth import layer_rows, per_kind_split, split_depths, stage_unit_fit

    others = [r for r in rows["fit"] if r["kind"] != "unit_stage"]
    split = split_depths(rows["fit"] + rows["held_out"])
    first = [s for s in split if s["backend"] == args.backends[0]]
    fit_split = [s for s in split_depths(rows["fit"]) if s["backend"] == args.backends[0]]
    profile = _fit(args, spec, layer_rows(fit_split) + others, base, base_source, env, "stage-depth")
    profile = dataclasses.replace(profile, stage_unit_s=stage_unit_fit(fit_split))
    shallow = [{**r, "kind": "unit_layer", "level": None} for r in rows["fit"]
               if r["kind"] == "unit_stage" and r["depth"] == min(args.depths) and r["backend"] == args.backends[0]]
    one_layer = _fit(args, spec, shallow + others, base, base_source, env, "one-layer-units")
    extra = {"depths": list(args.depths), "stage_unit_s": profile.stage_unit_s, "depth_split": split,
             "per_kind_stage_unit": per_kind_split(split), "one_layer_profile": one_layer.to_dict(),
             "shapes_fitted": len(fit_split), "shapes_all": len(first)}
    return profile, one_layer, extra


def fit_and_report(args, config: dict, rows: dict, base, base_source: str, env: dict) -> tuple:
    from infinipipe_hf.ir.model_spec import ModelSpec

    spec = ModelSpec.from_config_dict(config)
    extra, compare = {}, {}
    if args.depths is None:
        profile = _fit(args, spec, rows["fit"], base, base_source, env, "runtime-units")
    else:
        profile, one_layer, extra = fit_depths(args, spec, rows, base, base_source, env)
        compare["one_layer"] = _errors(one_layer, spec, rows["fit"] + rows["held_out"])
    fit_err, held_err = _errors(profile, spec, rows["fit"]), _errors(profile, spec, rows["held_out"])
    base_err = _errors(base, spec, rows["fit"] + rows["held_out"])
    for errors, split in ((fit_err, "fit"), (held_err, "held_out"), (base_err, "fit+held_out"),
                          *((e, "fit+held_out") for e in compare.values())):
        for e in errors:
            e["split"], e["unit_kind"] = split, _kind_of(e)
    units = ("unit_layer", "unit_stage")
    report = {"env": env, "args": vars(args), "model": config, "base_profile_source": base_source,
              "fit_rows": rows["fit"], "held_out_rows": rows["held_out"], "fit_errors": fit_err,
              "held_out_errors": held_err, "base_errors": base_err,
              "fit_worst": _worst(fit_err), "held_out_worst": _worst(held_err),
              "fit_worst_unit": _worst([e for e in fit_err if e["kind"] in units]),
              "held_out_worst_unit": _worst([e for e in held_err if e["kind"] in units]),
              "per_kind": per_kind({"fitted": fit_err + held_err, "base": base_err,
                                    **{k: v for k, v in compare.items()}}),
              "profile": profile.to_dict(), "base_profile": base.to_dict(), **extra}
    report["fit_worst_relative_error"] = report["fit_worst"]["relative_error"]
    report["held_out_worst_relative_error"] = report["held_out_worst"]["relative_error"]
    return profile, report


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama3.2-1b", help="shipped model config name")
    p.add_argument("--tiny", action="store_true", help="the tiny test shape with --block 8 (dry run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--layers", type=int, default=3, help="decoder layers built (at least the deeper stage + 2)")
    p.add_argument("--block", type=int, default=None, help="tokens per shape block (default 1024; --tiny 8)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--base-profile", default=None, help="whole-layer profile of this model (default: measure it)")
    p.add_argument("--depths", default="1,3", help="two stage depths (layers) per unit; 'none': one layer")
    p.add_argument("--backends", default="auto", help="attention backends, comma-separated (the first is fitted)")
    p.add_argument("--max-blocks", type=int, default=None, help="drop unit shapes longer than this many blocks")
    p.add_argument("--profile-out", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--out-key", default=None, help="add the report under this key of an existing --out JSON")
    args = p.parse_args(argv)
    for flag, value, least in (("--repeat", args.repeat, 1), ("--warmup", args.warmup, 0),
                               ("--layers", args.layers, 3), ("--block", args.block, 1),
                               ("--max-blocks", args.max_blocks, 2)):
        if value is not None and value < least:
            p.error(f"{flag} must be >= {least}, got {value}")
    args.backends = [b for b in args.backends.split(",") if b]
    if not args.backends:
        p.error("--backends needs at least one backend name (auto, sdpa, varlen, flash...)")
    if args.depths.lower() == "none":
        args.depths = None
    else:
        from benchmarks.lib.stage_depth import check_depths

        try:
            args.depths = list(check_depths([int(x) for x in args.depths.split(",")]))
        except ValueError as exc:
            p.error(f"--depths {args.depths!r}: {exc}")
    args.block = args.block or (8 if args.tiny else 1024)
    if args.tiny:
        args.model = "tiny"
    return args


def write_report(path: Path, report: dict, key: str | None) -> None:
    """``report`` as ``path``, or under ``key`` of the JSON object already there (kept otherwise)."""
    doc = report
    if key is not None:
        doc = json.loads(path.read_text()) if path.exists() else {}
        if not isinstance(doc, dict):
            raise SystemExit(f"error: --out {path} holds a {type(doc).__name__}, not a JSON object; "
                             f"--out-key {key} needs an object (or no file)")
        doc[key] = report
    path.write_text(json.dumps(doc, indent=1))


def main(argv=None) -> int:
    from infinipipe_hf.ir.model_spec import ModelSpec

    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA device is visible; use --tiny --device cpu")
    if device.type == "cpu":
        # A CPU row's clock is the calling thread's CPU time: work on other intra-op threads would go
        # uncounted, more or less of it as the machine's load moves it (as every CPU benchmark here).
        torch.set_num_threads(1)
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
    write_report(Path(args.out), report, args.out_key)
    summary = {k: report[k] for k in ("fit_worst_relative_error", "held_out_worst_relative_error", "elapsed_s")}
    print(json.dumps({**summary, "per_kind": {k: {n: round(v, 3) for n, v in d.items()}
                                              for k, d in report["per_kind"].items()}}))
    print(f"wrote {args.profile_out} and {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
