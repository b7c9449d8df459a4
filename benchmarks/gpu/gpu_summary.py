"""Summarise one GPU lease's results (the folders gpu_suite.sh and single_gpu.py wrote) as JSON
and markdown tables for docs/gpu.md.

    python -m benchmarks.gpu.gpu_summary [benchmarks/results/gpu_h100_2026-11-26]

Reads every JSON under the lease folder's run folders; writes ``summary.json`` beside them and
prints the tables.  Nothing here is measured: every figure is read from a file a run wrote.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.lib.paths import RESULTS

DEFAULT = RESULTS / "gpu_h100_2026-11-26"


def _rows(folder: Path, name: str) -> list[dict]:
    f = folder / name
    return json.loads(f.read_text())["rows"] if f.is_file() else []


def single_gpu_table(lease: Path) -> list[dict]:
    """tokens/s and peak memory per (run, section, method, length), OOMs included."""
    out = []
    for run in sorted(p for p in lease.iterdir() if p.is_dir()):
        for f in sorted(run.glob("*.json")):
            if not (f.name.startswith("single_gpu") or f.name.startswith("diag_")):
                continue
            for r in _rows(run, f.name):
                out.append({"run": run.name, "file": f.name, "section": r.get("section"), "method": r["name"],
                            "tokens": r.get("tokens_requested"), "attention": r.get("attention"),
                            "tokens_per_s": r.get("tokens_per_s"), "peak_gib": r.get("peak_gib"),
                            "predicted_peak_gib": r.get("predicted_peak_gib"), "error": r.get("error"),
                            "alloc_conf": r.get("alloc_conf")})
    return out


def _first(lease: Path, name: str, last: bool = False) -> Path | None:
    """The run folder's ``name`` file, from the first run that wrote it (or the last)."""
    found = [r / name for r in sorted(p for p in lease.iterdir() if p.is_dir()) if (r / name).is_file()]
    return (found[-1] if last else found[0]) if found else None


def _load(path: Path | None) -> dict:
    return json.loads(path.read_text()) if path else {}


def unit_kind_runs(lease: Path) -> list[dict]:
    """``sim_*.json`` files: gpu_sim_vs_real.py on plans of one unit kind each."""
    out = []
    for run in sorted(p for p in lease.iterdir() if p.is_dir()):
        for f in sorted(run.glob("sim_*.json")):
            d = json.loads(f.read_text())
            row = d.get("row", {})
            out.append({"run": run.name, "case": d.get("case"), "profile": Path(str(d.get("profile"))).name,
                        "unit_kinds": row.get("unit_kinds"),
                        "error": row.get("error"), "measured_step_s": row.get("step_s"),
                        **{k: d.get(k) for k in ("step_predicted_over_measured", "F_predicted_over_measured",
                                                 "B_predicted_over_measured")}})
    return out


def gpu_test_counts(run: Path) -> dict | None:
    """The GPU tests' counts of a run: ``gpu_suite.json``'s ``gpu_tests``, or (earlier runs) ``gpu_tests.json``."""
    suite = _load(run / "gpu_suite.json" if (run / "gpu_suite.json").is_file() else None)
    if "gpu_tests" in suite:
        return suite["gpu_tests"]["counts"]
    old = run / "gpu_tests.json"
    return json.loads(old.read_text())["counts"] if old.is_file() else None


def summarise(lease: Path) -> dict:
    suite = _load(_first(lease, "gpu_suite.json"))
    tests = {r.name: gpu_test_counts(r) for r in sorted(p for p in lease.iterdir() if p.is_dir())
             if gpu_test_counts(r)}
    prof = _load(_first(lease, "gpu_profile.json")).get("models", [])
    mem_file = _first(lease, "memory_model_check.json")
    mem = _rows(mem_file.parent, mem_file.name) if mem_file else []
    sim = _load(_first(lease, "gpu_sim_vs_real.json"))
    demo = _load(_first(lease, "gpu_demo.json", last=True))
    reach = _load(_first(lease, "offload_reach_gpu.json", last=True))
    return {
        "device": suite.get("nvidia_smi"), "versions": suite.get("versions"), "python": suite.get("python"),
        "tests": tests,
        "profile": [{"model": m["model"], "fitted_over_measured": m["fitted_over_measured_all"],
                     "shipped_over_measured_layer": m["shipped_over_measured_layer"],
                     "layer_tflops": {r["tokens"]: r["tflops_fwd_bwd"] for r in m["rows"] if r["kind"] == "layer_causal"}}
                    for m in prof],
        "memory": [{"case": r["case"], "unit_kinds": r.get("unit_kinds"), "measured_gib": r.get("peak_gib"),
                    "predicted_gib": r.get("predicted_peak_gib"), "peak_ratio": r.get("peak_predicted_over_measured"),
                    "step_ratio": r.get("step_predicted_over_measured")} for r in mem],
        "sim_vs_real": {k: sim.get(k) for k in ("case", "step_predicted_over_measured", "F_predicted_over_measured",
                                                "B_predicted_over_measured", "action_ratio_min", "action_ratio_max")},
        "unit_kind_runs": unit_kind_runs(lease),
        "demo": {"losses_gpu_bf16": demo.get("losses"), "losses_cpu_fp32": demo.get("reference", {}).get("losses"),
                 "max_abs_loss_diff": demo.get("max_abs_loss_diff"), "same_init": demo.get("same_init")},
        "single_gpu": single_gpu_table(lease),
        "offload_reach": [{k: r.get(k) for k in ("name", "length", "tokens_per_s", "error", "peak_gib",
                                                 "predicted_device_peak_gib", "host_peak_gib", "predicted_host_peak_gib",
                                                 "measured_step_s", "predicted_step_s")} for r in reach.get("rows", [])],
    }


def markdown(s: dict) -> str:
    lines = ["| run | method | tokens | attention | tokens/s | peak GiB (predicted) |", "|---|---|---|---|---|---|"]
    for r in s["single_gpu"]:
        if r["section"] != "single":
            continue
        tps = "OOM" if r["error"] == "OOM" else (f"{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else r["error"])
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] else "-"
        pred = f" ({r['predicted_peak_gib']:.1f})" if r["predicted_peak_gib"] else ""
        lines.append(f"| {r['run'].split('_')[0]}/{r['file']} | {r['method']} | {r['tokens'] // 1024}K | "
                     f"{r['attention'] or '-'} | {tps} | {peak}{pred} |")
    lines += ["", "| memory case | units | measured GiB | predicted GiB | peak ratio | step-time ratio |",
              "|---|---|---|---|---|---|"]
    for r in s["memory"]:
        lines.append(f"| {r['case']} | {', '.join(sorted(set(r['unit_kinds'])))} | {r['measured_gib']:.1f} | "
                     f"{r['predicted_gib']:.1f} | {r['peak_ratio']:.3f} | {r['step_ratio']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    lease = Path(argv[0]) if argv else DEFAULT
    s = summarise(lease)
    (lease / "summary.json").write_text(json.dumps(s, indent=1))
    print(markdown(s))
    print(f"\nwrote {lease / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
