"""``python -m infinipipe_hf.profile``: measure this machine's costs and write a cost profile.

    python -m infinipipe_hf.profile --model CONFIG.json --out PROFILE.json \
        [--lengths 512,1024,...] [--head-tokens 1024,4096] [--dtype bf16] [--slice-attention 1024:8192]
        [--attention-tokens 2048,8192 | none]

Writes the fitted ``HardwareProfile`` (loadable by ``HardwareProfile.load``, the planner CLI's
``--profile`` and ``InfiniPipeConfig.profile``) and the raw rows to ``--rows-out`` (default
``PROFILE.rows.json``) in the format of the shipped ``profiles/h100_bf16_measurements.json``,
itself loadable as a profile (fitted on load).  The measuring is :mod:`infinipipe_hf.profiling.run`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from infinipipe_hf.profiling.run import DEFAULT_HEAD_TOKENS, DEFAULT_LENGTHS, DTYPES, run_profile


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
    p.add_argument("--attention-tokens", default=None,
                   help="token counts of the attention-backend table, e.g. 2048,8192 (default: per device; "
                        "'none': not measured)")
    p.add_argument("--compile", action="store_true",
                   help="time the decoder layer compiled as compile_layers / torch_compile=True runs it")
    args = p.parse_args(argv)
    try:
        with open(args.model) as f:
            config_dict = json.load(f)
        profile, doc = run_profile(
            config_dict, device=args.device, dtype=args.dtype,
            lengths=_int_list(args.lengths, "--lengths"), head_tokens=_int_list(args.head_tokens, "--head-tokens"),
            slice_attention=_pairs(args.slice_attention), warmup=args.warmup, repeat=args.repeat,
            name=args.name, log=lambda s: print(s, file=sys.stderr), compile_layers=args.compile,
            attention_tokens=(() if args.attention_tokens == "none" else None if args.attention_tokens is None
                              else _int_list(args.attention_tokens, "--attention-tokens")))
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
