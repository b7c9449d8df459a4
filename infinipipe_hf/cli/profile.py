"""``python -m infinipipe_hf.profile``: measure this machine's costs and write a cost profile.

    python -m infinipipe_hf.profile --model CONFIG.json --out PROFILE.json \
        [--lengths 512,1024,...] [--head-tokens 1024,4096] [--dtype bf16] [--slice-attention 1024:8192]

Times one decoder layer of the model (transformers' own layer class, random weights) forward and
forward+backward at several sequence lengths, its saved activation bytes and forward peak per
token, and the final norm + LM head + loss at several token counts; fits them with
``planner.hardware.fit_profile`` and writes the fitted ``HardwareProfile`` (loadable by
``HardwareProfile.load``, the planner CLI's ``--profile`` and ``InfiniPipeConfig.profile``).  The
raw rows go to ``--rows-out`` (default ``PROFILE.rows.json``) in the format of the shipped
``profiles/h100_bf16_measurements.json``; that file is itself loadable as a profile (it is fitted on load).

Design: profiling the *target* model's layer (not a reference layer rescaled by FLOPs) is what
makes the cost model exact for that model; the trade-off is GPU time per model (not yet measured:
no GPU has run the profiler).
Without CUDA the profiler refuses (CPU timings would mislead a GPU planner) unless asked for
``--device cpu``, a smoke mode for tests and for planning CPU runs.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}
DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
DEFAULT_HEAD_TOKENS = (1024, 2048, 4096, 8192)


def _int_list(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers like 512,1024, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"{what} must list positive integers, got {text!r}")
    return vals


def _pairs(text: str | None) -> list[tuple[int, int]]:
    if not text:
        return []
    out = []
    for item in text.split(","):
        try:
            s, c = item.split(":")
            out.append((int(s), int(c)))
        except ValueError:
            raise ValueError(f"--slice-attention takes SLICE:PREFIX pairs like 1024:8192,4096:32768, "
                             f"got {item!r}") from None
    return out


def environment(device) -> dict:
    import torch
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "device_type": device.type}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    for name in ("flash_attn", "triton"):
        try:
            env[name] = __import__(name).__version__
        except Exception as exc:  # absent or broken: record why, the fit does not need it
            env[name] = f"absent ({type(exc).__name__})"
    return env


def resolve_device(name: str):
    import torch

    if name in ("auto", "cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no CUDA device is visible (torch {torch.__version__}, "
                             f"cuda available: False). Profile on the GPU you will train on, or pass "
                             f"--device cpu for a CPU smoke profile (not valid for planning GPU runs)")
        return torch.device("cuda", torch.cuda.current_device())
    if name == "cpu":
        return torch.device("cpu")
    raise ValueError(f"--device must be auto, cuda or cpu, got {name!r}")


def run_profile(config_dict: dict, *, device: str = "auto", dtype: str = "bf16",
                lengths=DEFAULT_LENGTHS, head_tokens=DEFAULT_HEAD_TOKENS, slice_attention=(),
                warmup: int = 2, repeat: int = 5, name: str | None = None, log=print):
    """Measure and fit; returns ``(HardwareProfile, rows_document)``."""
    import torch

    from infinipipe_hf.planner.cost.profile import fit_profile
    from infinipipe_hf.profiling.measure import profile_rows
    from infinipipe_hf.profiling.modules import build_modules, reference_shape

    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    lengths = sorted(set(int(n) for n in lengths))
    head_tokens = sorted(set(int(n) for n in head_tokens))
    if len(lengths) < 3 or len(head_tokens) < 2:
        raise ValueError(f"the fit needs >= 3 --lengths and >= 2 --head-tokens, got {lengths} and "
                         f"{head_tokens}")
    dev = resolve_device(device)
    tdtype = getattr(torch, DTYPES[dtype])
    modules = build_modules(config_dict, dev, tdtype)
    env = environment(dev)
    log(f"profiling one {type(modules.layer).__name__} ({modules.spec.hidden_size} hidden) in {dtype} "
        f"on {env.get('gpu', dev.type)}")
    rows = profile_rows(modules, lengths, head_tokens, slice_attention, dev, tdtype, warmup=warmup,
                        repeat=repeat, log=log)
    memory_gib = (torch.cuda.get_device_properties(dev).total_memory / 2**30 if dev.type == "cuda"
                  else 0.0)
    reference = reference_shape(modules.spec)
    name = name or f"{env.get('gpu', 'cpu').replace(' ', '-').lower()}-{dtype}-{modules.spec.model_type}"
    doc = {"name": name, "source": "python -m infinipipe_hf.profile", "device": env.get("gpu", "cpu"),
           "dtype": DTYPES[dtype], "memory_gib": memory_gib, "env": env, "reference": reference,
           "rows": rows}
    profile = fit_profile(rows, reference, name=name, memory_gib=memory_gib or 80.0,
                          device=doc["device"], meta={"env": env, "source": doc["source"], "rows": rows})
    bpe = torch.empty((), dtype=tdtype).element_size()
    from dataclasses import replace
    profile = replace(profile, bytes_per_element=bpe)
    return profile, doc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m infinipipe_hf.profile", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF config.json of the model to profile")
    p.add_argument("--out", required=True, help="where to write the fitted profile JSON")
    p.add_argument("--rows-out", help="where to write the raw rows (default: OUT with .rows.json)")
    p.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)))
    p.add_argument("--head-tokens", default=",".join(map(str, DEFAULT_HEAD_TOKENS)))
    p.add_argument("--slice-attention", default=None, help="SLICE:PREFIX pairs, e.g. 1024:8192")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--device", default="auto", help="auto (CUDA), cuda or cpu (smoke mode)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    try:
        with open(args.model) as f:
            config_dict = json.load(f)
        profile, doc = run_profile(
            config_dict, device=args.device, dtype=args.dtype,
            lengths=_int_list(args.lengths, "--lengths"), head_tokens=_int_list(args.head_tokens, "--head-tokens"),
            slice_attention=_pairs(args.slice_attention), warmup=args.warmup, repeat=args.repeat,
            name=args.name, log=lambda s: print(s, file=sys.stderr))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    rows_out = Path(args.rows_out) if args.rows_out else out.with_suffix(".rows.json")
    profile.save(out)
    rows_out.write_text(json.dumps(doc, indent=1))
    print(json.dumps({"profile": str(out), "rows": str(rows_out), "name": profile.name,
                      "activation_bytes_per_token_per_layer": profile.activation_bytes_per_token_per_layer,
                      "layer_forward": profile.layer_forward.__dict__,
                      "layer_backward": profile.layer_backward.__dict__}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
