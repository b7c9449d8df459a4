"""The published rows the calibration fits and checks, the stated hardware conversions, and our
own GPU runs (EPP's measured step against the layer profile); ``calibration.py`` fits on them."""
from __future__ import annotations

import json
import math
from dataclasses import replace

from benchmarks.lib.paths import RESULTS
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.cost.model import GIB
from infinipipe_hf.planner.cost.profile import HardwareProfile

TT = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
S1 = "thunlp/Seq1F1B picture/32x7b zhihu_throughput.tex"


def spec_of(name: str) -> ModelSpec:
    return ModelSpec.from_json_file(config_path(name))


FACTORS = {
    "h100_500w_compute": {
        "value": (989 + 835) / 2 / 989,
        "source": "torchtitan's note: their 500 W HBM2e H100's peak lies between SXM (989 dense bf16 TFLOP/s) "
                  "and NVL (835); the midpoint over the SXM peak our profile was measured on (NVIDIA datasheets)",
        "applies_to": "layer, head and embedding times (divided by it)"},
    "h100_hbm2e_bandwidth": {
        "value": 2.4 / 3.35,
        "source": "2.4 TB/s HBM2e (torchtitan's hardware note) over 3.35 TB/s HBM3 (SXM datasheet)",
        "applies_to": "elementwise bandwidth (ring merges, mlp_act recompute)"},
    "a100_compute": {
        "value": 312 / 989,
        "source": "A100 312 vs H100 SXM 989 dense bf16 TFLOP/s (NVIDIA datasheets); assumes the same share "
                  "of peak on both cards",
        "applies_to": "layer, head and embedding times"},
    "a100_attention": {
        "value": 312 * 0.73 / 460,
        "source": "FlashAttention-2 (Dao, 2023) reaches up to 73% of the A100's 312 TFLOP/s in attention; the "
                  "shipped H100 profile's causal attention runs at about 460 TFLOP/s (403 forward, 513 backward)",
        "applies_to": "the layers' attention-pair term on A100 (instead of a100_compute)"},
    "a100_nvlink": {
        "value": 300 / 450, "source": "NVLink 3 300 GB/s vs NVLink 4 450 GB/s per direction (datasheets)",
        "applies_to": "intra-node collective bandwidth"},
}
"""Hardware conversions, each with its source; fitted conversions (compile, Float8) are parameters."""


def hardware(profile: HardwareProfile, kind: str) -> HardwareProfile:
    """The profile converted to the measured card by the stated ``FACTORS``."""
    if kind == "h100_sxm":
        return profile
    if kind == "h100_500w":
        k, bw = 1 / FACTORS["h100_500w_compute"]["value"], FACTORS["h100_hbm2e_bandwidth"]["value"]
        extra = {"memory_gib": 96 * 1e9 / GIB}
    elif kind == "a100":
        k, bw = 1 / FACTORS["a100_compute"]["value"], 2039 / 3350  # A100 80GB SXM: 2.04 TB/s HBM2e
        a = 1 / FACTORS["a100_attention"]["value"]
        extra = {"memory_gib": 80.0, "intra_node_bandwidth_bytes_per_s":
                 profile.intra_node_bandwidth_bytes_per_s * FACTORS["a100_nvlink"]["value"],
                 "inter_node_bandwidth_bytes_per_s": 25e9 * 0.8}
    else:
        raise ValueError(f"unknown hardware {kind!r}")
    a = a if kind == "a100" else k
    return replace(profile, name=f"{profile.name}@{kind}", layer_forward=profile.layer_forward.scaled(a, k),
                   layer_backward=profile.layer_backward.scaled(a, k), head_forward=profile.head_forward.scaled(k, k),
                   head_backward=profile.head_backward.scaled(k, k), embedding_token_s=profile.embedding_token_s * k,
                   elementwise_bytes_per_s=profile.elementwise_bytes_per_s * bw, **extra)


def workload(profile: HardwareProfile, compile_speedup: float, fp8_linear: float, compiled: bool,
             fp8: bool) -> HardwareProfile:
    """Framework and precision variants: ``torch.compile`` speeds every compute term up by
    ``compile_speedup``; Float8 linears speed the layers' per-token (linear) term by ``fp8_linear``."""
    c = compile_speedup if compiled else 1.0
    f = fp8_linear if fp8 else 1.0
    lf, lb = profile.layer_forward, profile.layer_backward
    return replace(profile, layer_forward=replace(lf.scaled(1 / c, 1 / c), token_s=lf.token_s / c / f),
                   layer_backward=replace(lb.scaled(1 / c, 1 / c), token_s=lb.token_s / c / f),
                   head_forward=profile.head_forward.scaled(1 / c, 1 / c),
                   head_backward=profile.head_backward.scaled(1 / c, 1 / c),
                   embedding_token_s=profile.embedding_token_s / c)


def _tt(rid, role, gpus, schedule, seq, per_gpu, ckpt, compiled, fp8, published, table, note=""):
    return {"id": rid, "role": role, "source": f"{TT}, {table}", "system": "torchtitan", "model": "llama3-8b",
            "schedule": schedule, "gpus": gpus, "seq": seq, "per_group": per_gpu, "checkpoint": ckpt,
            "hardware": "h100_500w", "compiled": compiled, "fp8": fp8, "published": published,
            "metric": "tokens/s/GPU", "note": note}


SAC = ("selective (op) AC mapped to 16 of 32 layers checkpointed: op-SAC recomputes about half the "
       "linear forward, the recompute of half the layers")
ROWS = [
    _tt("tt_fsdp8_eager", "fit", 8, "ulysses-zero3", 8192, 2, 16, False, False, 5762, "Table 1", SAC),
    _tt("tt_fsdp8_compile", "fit", 8, "ulysses-zero3", 8192, 2, 16, True, False, 6667, "Table 1", SAC),
    _tt("tt_fsdp8_compile_fp8", "fit", 8, "ulysses-zero3", 8192, 2, 16, True, True, 8532, "Table 1", SAC),
    _tt("tt_fsdp128_eager", "fit", 128, "ulysses-zero3", 8192, 2, 16, False, False, 5605, "Table 3", SAC),
    _tt("tt_fsdp128_compile", "held_out", 128, "ulysses-zero3", 8192, 2, 16, True, False, 6514, "Table 3", SAC),
    _tt("tt_fsdp128_compile_fp8", "held_out", 128, "ulysses-zero3", 8192, 2, 16, True, True, 8380, "Table 3", SAC),
    _tt("tt_cp1_32k", "held_out", 1, "ring-cp", 32768, 1, "full", True, True, 3890, "Table 2 (FSDP 8, CP 1)"),
    _tt("tt_cp2_64k", "fit", 2, "ring-cp", 65536, 1, "full", True, True, 2540, "Table 2 (FSDP 4, CP 2)"),
    _tt("tt_cp4_128k", "fit", 4, "ring-cp", 131072, 1, "full", True, True, 1071, "Table 2 (FSDP 2, CP 4)"),
    _tt("tt_cp8_256k", "held_out", 8, "ring-cp", 262144, 1, "full", True, True, 548, "Table 2 (FSDP 1, CP 8)"),
] + [{"id": f"seq1f1b_32x7b_{k}k", "role": "fit" if k == 64 else "held_out", "source": f"{S1}, Seq1F1B column, 16 micro-batches",
      "system": "Seq1F1B (Megatron)", "model": "llama2-7b", "schedule": "seq1f1b", "gpus": 32, "seq": k * 1024,
      "hardware": "a100", "compiled": True, "fp8": False, "published": tf, "metric": "TFLOP/s/GPU",
      "note": "layout not in the table: TP 4 x PP 8 assumed (the repository's run script uses TP 8 x PP 8 for "
              "30B on 64 GPUs), TP mapped to Ulysses SP 4 (same per-GPU compute share); GPT-7B (h 4096, 32 "
              "layers, 4h MLP, vocab 50257) planned as llama2-7b (same hidden, layers and parameter count); "
              "4 sequence slices, the faster of Seq1F1B's computation-wise split (uniform_comp, the one its "
              "experiment script runs) and its equal-token split (average), one sequence per micro-batch "
              "(max_tokens_per_unit = seq / 2 - 1, which two sequences in 4 slices exceed); Megatron's fused kernels priced as torch.compile; TFLOP/s counted with Megatron's formula with causal attention, which "
              "reproduces the table's own TFLOP/s-to-throughput ratio within 1.2%"}
     for k, tf in ((32, 115.34), (64, 123.05), (128, 142.08))]
"""Published rows mapped onto the planner (``world`` is 8 GPUs per torchtitan table-2 row)."""

NOT_COMPARABLE = [
    {"id": "deepspeed_ulysses_blog", "source": "DeepSpeed-Ulysses blog (microsoft/DeepSpeed blogs/deepspeed-ulysses)",
     "published": "over 175 TFLOP/s per A100 at 30B", "reason": "a lower bound without the sequence length, GPU "
     "count, checkpointing and ZeRO stage of the run it bounds; no single setting to plan"},
    {"id": "nemo_long_sequence", "source": "NVIDIA NeMo long-sequence performance page (Llama 2 7B, FP8)",
     "published": "not quoted in the issue", "reason": "its layouts use tensor parallelism with CP inside a "
     "node, which the planner does not model, and its figures are not in the issue text to cite exactly"},
]

def megatron_flops_per_token(spec: ModelSpec, seq: int, vocab: int = 50257) -> float:
    """Megatron's FLOPs per token (forward + backward, no recompute) with causal attention."""
    h, n = spec.hidden_size, spec.num_layers
    return 72 * n * h * h * (1 + seq / (12 * h) + vocab / (16 * n * h))


OWN_RUNS = [RESULTS / "gpu_h100_2026-11-26" / "summary.json", RESULTS / "gpu_h100_2026-11-26_lease2" / "summary.json"]
"""The GPU suite's simulator-vs-real step (step 5) on two H100 leases: EPP's own whole-step efficiency."""


def own_runs() -> list[dict]:
    """Each lease's simulated / measured step of EPP's plan, with a profile fitted on that machine."""
    out = []
    for path in OWN_RUNS:
        if path.is_file():
            sim = json.loads(path.read_text())["sim_vs_real"]
            out.append({"path": path, "case": sim["case"], "ratio": sim["step_predicted_over_measured"]})
    return out


def epp_efficiency() -> float:
    """EPP's whole-step efficiency: the geometric mean over the leases of simulated / measured step
    (the simulated step divided by it matches the measured one)."""
    runs = own_runs()
    if not runs:
        raise ValueError(f"no GPU run summary at {[str(p) for p in OWN_RUNS]}; EPP's efficiency comes from them")
    return math.exp(sum(math.log(r["ratio"]) for r in runs) / len(runs))


def own_run_rows(params: dict) -> list[dict]:
    """Our own H100 EPP steps (one H100, 4 stages, profile fitted on that machine): only the whole-step
    efficiency applies (one GPU, no collectives, no ring).  Fit rows of ``epp_efficiency``."""
    rows = []
    for i, run in enumerate(own_runs()):
        before = 1 / run["ratio"]  # predicted over measured tokens/s
        rows.append({"id": f"own_h100_epp_pp4_lease{i + 1}", "role": "fit",
                     "system": "this project (EPP, 4 stages on 1 H100)",
                     "source": f"{run['path'].relative_to(run['path'].parents[2])} sim_vs_real ({run['case']})",
                     "metric": "tokens/s ratio", "published": 1.0, "hardware": "h100_sxm", "ratio_before": before,
                     "ratio_after": before * params["epp_efficiency"],
                     "note": "measured step time over the simulated one with a profile fitted on the same machine; "
                             "the calibrated model divides EPP's compute by epp_efficiency"})
    return rows
