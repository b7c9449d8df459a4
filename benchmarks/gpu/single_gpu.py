"""Single-GPU benchmark: plain HF training vs the EPP engine (pp 1), side by side in one run.

    python -m benchmarks.gpu.single_gpu [--lengths 8192,32768,65536,131072] [--steps 3]
    python -m benchmarks.gpu.single_gpu --tiny --device cpu   # smoke run of every code path

A Llama-3.2-1B-shaped model (random weights, bf16, ``sdpa``), one optimizer step (fused AdamW) per
step.  Sections:
- ``single``: one sequence of N tokens per step: HF without / with HF gradient checkpointing, and
  the engine (elastic slicing, chunked loss, adaptive checkpointing chosen by the planner).
- ``longtail``: a long-tailed batch (``slimpajama_like`` lengths cut to a token budget): HF one
  sequence at a time with gradient accumulation, HF padding-free packing
  (``DataCollatorWithFlattening`` + position ids; checked against per-sequence losses, because
  with sdpa it is only correct when ``use_cache=False``), and the engine on the whole batch.
- ``epp_same`` / ``epp_compiled`` (methods, run last at the shortest length): the engine at HF's
  work (one unit, nothing recomputed), eager and with ``compile_layers``; ``first_step_s`` holds
  the compile.
Every row has tokens/s and peak ``max_memory_allocated``; an OOM is a row, not a crash.  Engine rows
also carry the plan (slices, checkpointed layers), the simulator's predicted step time and peak
memory (the memory-model check), and a per-action device timeline (CUDA events).  Results go to
``--out`` (JSON) and a PNG beside it.

The engine plans each batch once before the timed steps (the trainer plans one step ahead in the
background); the planning time is reported separately.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import benchmarks.gpu.gpu_common as gc_
from benchmarks.lib.paths import RESULTS
from infinipipe_hf import InfiniPipeConfig, PipelineEngine


def hf_rows(config, seqs, device, dtype, args, *, ckpt: bool):
    model = gc_.make_model(config, device, dtype)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = gc_.make_optimizer(model.parameters(), device)
    seqs = [s.to(device) for s in seqs]
    total = sum(len(s) - 1 for s in seqs)

    def step():
        for ids in seqs:
            out = model(input_ids=ids[None], labels=ids[None])
            # HF's loss is the mean over this sequence; weight it to the batch's mean token loss.
            (out.loss * ((len(ids) - 1) / total)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    row, _ = gc_.timed_steps(step, device, sum(len(s) for s in seqs), warmup=args.warmup, steps=args.steps)
    return row


def packs_of(seqs, pack_tokens: int):
    """Greedy in-order packs of at most ``pack_tokens`` tokens (a longer sequence is its own pack)."""
    packs, cur, n = [], [], 0
    for s in seqs:
        if cur and n + len(s) > pack_tokens:
            packs.append(cur)
            cur, n = [], 0
        cur.append(s)
        n += len(s)
    if cur:
        packs.append(cur)
    return packs


def hf_packed_rows(config, seqs, device, dtype, args, *, ckpt: bool):
    from transformers import DataCollatorWithFlattening

    model = gc_.make_model(config, device, dtype)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = gc_.make_optimizer(model.parameters(), device)
    collate = DataCollatorWithFlattening(return_position_ids=True)
    batches = []
    for pack in packs_of(seqs, args.pack_tokens):
        b = collate([{"input_ids": s.tolist()} for s in pack])
        batches.append({k: v.to(device) for k, v in b.items() if k in ("input_ids", "labels", "position_ids")})
    total = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    # Packed vs separate: the same pack's summed token loss both ways (no grad).
    with torch.no_grad():
        first = batches[0]
        n_lab = int((first["labels"][:, 1:] != -100).sum())
        packed = float(model(**first).loss) * n_lab
        sep = sum(float(model(input_ids=s.to(device)[None], labels=s.to(device)[None]).loss) * (len(s) - 1)
                  for s in packs_of(seqs, args.pack_tokens)[0])
    check = abs(packed - sep) / abs(sep)

    def step():
        for b in batches:
            n = int((b["labels"][:, 1:] != -100).sum())
            (model(**b).loss * (n / total)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    row, _ = gc_.timed_steps(step, device, sum(len(s) for s in seqs), warmup=args.warmup, steps=args.steps)
    row.update(num_packs=len(batches), packed_vs_separate_loss_rel_diff=check)
    return row


def backend_name(backend) -> str:
    """The attention backend's registered name (``sdpa``, ``varlen``, ``flash``) for the row."""
    from infinipipe_hf.runtime.attention import select as attention

    names = [n for n, (fn, _) in attention._BACKENDS.items() if fn is backend]
    return names[0] if names else getattr(backend, "__name__", str(backend))


SAME_WORK = {"epp_same": dict(num_slices=[1], checkpointing="none"),
             "epp_compiled": dict(num_slices=[1], checkpointing="none", compile_layers=True)}
"""EPP at HF's work (one unit per sequence, nothing recomputed), eager and with ``compile_layers``;
run last, at the shortest of ``--lengths`` (the suite's 8K), so a slow compile costs only its row."""


def epp_rows(config, seqs, device, dtype, args, profile_path, **overrides):
    model = gc_.make_model(config, device, dtype)
    cfg = InfiniPipeConfig(**{**dict(
        pp_degree=1, profile=profile_path, attention_backend=args.attention_backend, checkpointing=args.checkpointing,
        memory_budget_gib=getattr(args, "memory_budget_gib", None),
        num_slices=[int(k) for k in args.num_slices.split(",")] if args.num_slices else None,
        loss_chunk_tokens=args.loss_chunk_tokens), **overrides})
    engine = PipelineEngine(model, cfg, device=device)
    opt = gc_.make_optimizer(engine.parameters(), device)
    batch = [{"input_ids": s} for s in seqs]
    import time
    t0 = time.perf_counter()
    plan, sim = engine.make_plan([len(s) for s in seqs])
    planning_s = time.perf_counter() - t0
    timer = gc_.ActionTimer(engine, device)

    first_step_s = []  # the first step compiles when compile_layers is on

    def step():
        t = time.perf_counter()
        out = engine.train_step(batch, plan=plan)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not first_step_s:
            gc_.sync(device)
            first_step_s.append(time.perf_counter() - t)
        return out

    plan_facts = {"planning_s": planning_s, "num_units": len(plan.units), "unit_tokens": [u.num_tokens for u in plan.units],
                  "unit_kinds": [u.kind(plan.sequences).value for u in plan.units]}
    if sim is not None:
        plan_facts["predicted_peak_gib"] = sim.peak_memory_bytes[0] / 2**30
    try:
        row, out = gc_.timed_steps(step, device, sum(len(s) for s in seqs), warmup=args.warmup, steps=args.steps)
    except Exception as exc:  # an OOM row keeps what was planned, to compare with what was reached
        raise gc_.RowError(exc, {**plan_facts, **gc_.memory_at_failure(device)}) from exc
    actions = timer.take()[-2 * len(plan.units):]  # the last step's actions
    ck = plan.checkpoint_layers.get(0, {})
    row.update(
        loss=out.loss, planning_s=planning_s, num_units=len(plan.units),
        num_slices=plan.info.get("num_slices"), checkpointed_layers={str(k): v for k, v in sorted(ck.items())},
        checkpoint_levels={str(k): v for k, v in sorted(plan.checkpoint_levels.get(0, {}).items())},
        layers=engine.layers_per_stage[0], attention=backend_name(engine.runner.backend),
        compile_layers=cfg.compile_layers, first_step_s=first_step_s[0],
        unit_tokens=[u.num_tokens for u in plan.units],
        unit_kinds=[u.kind(plan.sequences).value for u in plan.units],
        timeline=actions, forward_ms=sum(a["ms"] for a in actions if a["action"][0] == "F"),
        backward_ms=sum(a["ms"] for a in actions if a["action"][0] == "B"),
    )
    if sim is not None:
        row.update(predicted_step_s=sim.step_time_s, predicted_peak_gib=sim.peak_memory_bytes[0] / 2**30,
                   predicted_timeline=[{"action": e.action, "ms": (e.end_s - e.start_s) * 1e3,
                                        "recompute_ms": e.recompute_s * 1e3} for e in sim.events])
        if "peak_gib" in row:
            row["peak_predicted_over_measured"] = row["predicted_peak_gib"] / row["peak_gib"]
    return row


def longtail_lengths(args) -> list[int]:
    from infinipipe_hf.data.synthetic import slimpajama_like

    out, total = [], 0
    for n in slimpajama_like(n=4096, max_len=args.longtail_max_len, seed=args.seed):
        n = min(n, args.longtail_tokens - total)
        if n >= 2:
            out.append(n)
            total += n
        if total >= args.longtail_tokens - 1:
            break
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if r["section"] == "single"]
    names = sorted({r["name"] for r in rows}, key=lambda n: ["hf", "hf_ckpt", "epp"].index(n) if n in
                   ("hf", "hf_ckpt", "epp") else 9)
    lengths = sorted({r["tokens_requested"] for r in rows})
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    tail = [r for r in results["rows"] if r["section"] == "longtail"]
    axes[2].bar(range(len(tail)), [r.get("tokens_per_s", 0.0) / 1e3 for r in tail],
                tick_label=[r["name"] + (f"\n{r['error'][:3]}" if "error" in r else "") for r in tail])
    axes[2].set_title(f"long-tailed batch ({len(results.get('longtail_lengths', []))} sequences): "
                      f"tokens/s (thousands)", fontsize=9)
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        by_len = {r["tokens_requested"]: r for r in rows if r["name"] == name}
        xs = [j + i * width for j in range(len(lengths))]
        tps = [by_len.get(n, {}).get("tokens_per_s", 0.0) / 1e3 for n in lengths]
        mem = [by_len.get(n, {}).get("peak_gib", 0.0) for n in lengths]
        axes[0].bar(xs, tps, width, label=name)
        axes[1].bar(xs, mem, width, label=name)
        for x, n in zip(xs, lengths):
            if "error" in by_len.get(n, {}):
                for ax in axes[:2]:
                    ax.text(x, 0, by_len[n]["error"][:3], rotation=90, ha="center", va="bottom", fontsize=8)
    for ax, title in zip(axes[:2], ("tokens/s (thousands)", "peak memory allocated (GiB)")):
        ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(lengths))])
        ax.set_xticklabels([f"{n // 1024}K" if n >= 1024 else str(n) for n in lengths])
        ax.set_title(title)
        ax.legend()
    env = results["env"]
    fig.suptitle(f"one sequence per step, {results['model']} on {env.get('gpu', env['device'])} "
                 f"(torch {env['torch']}, transformers {env['transformers']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=None, help="HF config.json (default: shipped llama3.2-1b)")
    p.add_argument("--tiny", action="store_true", help="tiny random model (CPU smoke test)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--lengths", default="8192,32768,65536,131072")
    p.add_argument("--sections", default="single,longtail")
    p.add_argument("--methods", default="hf,hf_ckpt,epp,hf_packed,hf_packed_ckpt")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--longtail-tokens", type=int, default=65536)
    p.add_argument("--longtail-max-len", type=int, default=32768)
    p.add_argument("--pack-tokens", type=int, default=16384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", default=None, help="cost profile for the engine (default: shipped H100)")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--checkpointing", default="adaptive")
    p.add_argument("--num-slices", default=None, help="force candidate slice counts, e.g. 4,8")
    p.add_argument("--loss-chunk-tokens", type=int, default=4096)
    p.add_argument("--out", default=str(RESULTS / "single_gpu.json"))
    p.add_argument("--no-plot", action="store_true", help="skip the PNG beside --out")
    p.add_argument("--memory-budget-gib", type=float, default=None,
                   help="the engine's planning budget (default: the device's memory less 2 GiB)")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA device is visible; use --tiny --device cpu "
                         "for a smoke run")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    config = gc_.load_config(args.config, args.tiny)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    profile_path = gc_.bench_profile_path(args.profile, dtype, device)
    methods = args.methods.split(",")
    results = {"model": "tiny" if args.tiny else Path(args.config or "llama3.2-1b").stem,
               "env": gc_.environment(device), "dtype": args.dtype, "args": vars(args), "rows": []}
    vocab = config["vocab_size"]

    def record(section, name, fn, **extra):
        row = gc_.guarded(f"{name}", fn, device, log=lambda s: print(f"[{section}] {s}", flush=True))
        results["rows"].append({"section": section, **extra, **row})
        out.write_text(json.dumps(results, indent=1))  # partial results survive a later crash

    if "single" in args.sections:
        for n in [int(x) for x in args.lengths.split(",")]:
            seqs = [gc_.random_ids(n, vocab, seed=n)]
            for name in [m for m in methods if m in ("hf", "hf_ckpt", "epp")]:
                fn = {"hf": lambda: hf_rows(config, seqs, device, dtype, args, ckpt=False),
                      "hf_ckpt": lambda: hf_rows(config, seqs, device, dtype, args, ckpt=True),
                      "epp": lambda: epp_rows(config, seqs, device, dtype, args, profile_path)}[name]
                record("single", name, fn, tokens_requested=n)
    if "longtail" in args.sections:
        lengths = longtail_lengths(args)
        results["longtail_lengths"] = lengths
        seqs = [gc_.random_ids(n, vocab, seed=i) for i, n in enumerate(lengths)]
        for name in [m for m in methods if m in ("hf_ckpt", "hf_packed", "hf_packed_ckpt", "epp")]:
            fn = {"hf_ckpt": lambda: hf_rows(config, seqs, device, dtype, args, ckpt=True),
                  "hf_packed": lambda: hf_packed_rows(config, seqs, device, dtype, args, ckpt=False),
                  "hf_packed_ckpt": lambda: hf_packed_rows(config, seqs, device, dtype, args, ckpt=True),
                  "epp": lambda: epp_rows(config, seqs, device, dtype, args, profile_path)}[name]
            record("longtail", name, fn, tokens_requested=sum(lengths), num_sequences=len(lengths))
    if "single" in args.sections:  # after the rest: a slow compile must not cost the other rows
        n = min(int(x) for x in args.lengths.split(","))
        seqs = [gc_.random_ids(n, vocab, seed=n)]
        for name in [m for m in methods if m in SAME_WORK]:
            record("single", name, lambda: epp_rows(config, seqs, device, dtype, args, profile_path, **SAME_WORK[name]),
                   tokens_requested=n, same_work=True)
    try:
        if not args.no_plot:
            plot(results, out.with_suffix(".png"))
    except Exception as exc:  # noqa: BLE001 - a missing plot must not lose the measurements
        print(f"plot failed: {exc}", file=sys.stderr)
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
