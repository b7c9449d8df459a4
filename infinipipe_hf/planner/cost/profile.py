"""Hardware profiles: measured costs of one decoder layer, the LM head and the links, as coefficients.

A profile is fitted from *measurement rows* (the format of the shipped ``profiles/h100_bf16_measurements.json`` and of what
``python -m infinipipe_hf.profile`` writes): per-layer forward/backward times of causal sequences
at several lengths, LM head + loss times, activation bytes per token.  The fit is the cost model's
form (docs/algorithms.md), per layer and direction::

    time = attn_pair_s * sum(s_i^2 + 2 C_i s_i) + token_s * sum(s_i) + fixed_s

fitted by non-negative least squares on relative error (small units matter as much as big ones:
the fixed term is what makes tiny slices run the GPU badly).  Rows are measured on a *reference*
layer shape; the cost model rescales to other shapes by FLOPs (:mod:`.compute`), which is the trade-off: exact on the
profiled shape, a FLOP-proportional estimate elsewhere.  Re-profile on the target model for
accurate times.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from scipy.optimize import nnls

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.planner.cost.calibration import Calibration, apply_calibration

PROFILE_FORMAT_VERSION = 1

CONTEXT_PAIRS = ("band", "rectangle")
"""How an attention kernel counts the pairs of a slice with K/V context (``HardwareProfile.context_pairs``)."""

KEYS = ("backward", "forward_full", "forward_mlp", "forward_mlp_act")
"""The keys of ``HardwareProfile.working_bytes_per_token`` (bytes per token, reference shape)."""


def check_working_fields(fields: dict) -> None:
    """``ValueError`` unless ``fields`` is empty or has exactly :data:`KEYS` with values >= 0."""
    if not fields:
        return
    if set(fields) != set(KEYS) or any(not float(v) >= 0 for v in fields.values()):
        raise ValueError(f"profile field working_bytes_per_token must be empty (linear bound) or give "
                         f"bytes >= 0 for exactly {', '.join(KEYS)}; got {dict(fields)!r}")


@dataclass(frozen=True)
class TimeCoefficients:
    """``time = attn_pair_s * pairs + token_s * tokens + fixed_s`` (seconds)."""

    attn_pair_s: float = 0.0
    token_s: float = 0.0
    fixed_s: float = 0.0

    def __call__(self, pairs: float, tokens: float) -> float:
        return self.attn_pair_s * pairs + self.token_s * tokens + self.fixed_s

    def scaled(self, attn: float, linear: float) -> "TimeCoefficients":
        return TimeCoefficients(self.attn_pair_s * attn, self.token_s * linear, self.fixed_s * linear)


@dataclass(frozen=True)
class HardwareProfile:
    """Fitted costs of one device type for a reference layer shape (see module docstring)."""

    name: str
    """Human-readable origin, e.g. ``h100-bf16-default``."""
    reference: dict[str, int]
    """Layer shape the measurements were taken on (hidden_size, intermediate_size, heads...)."""
    layer_forward: TimeCoefficients
    layer_backward: TimeCoefficients
    """Backward of one layer, excluding any recompute."""
    head_forward: TimeCoefficients
    """Final norm + LM head + cross-entropy forward (attn_pair_s unused)."""
    head_backward: TimeCoefficients
    activation_bytes_per_token_per_layer: float
    """Bytes a non-checkpointed layer keeps for backward, per token (reference shape)."""
    layer_working_bytes_per_token: float
    """Extra bytes alive while one layer runs forward (its peak minus what it keeps)."""
    bytes_per_element: int = 2
    """Activation dtype size (2 for bf16)."""
    attention_mask_bytes_per_element: float = 0.0
    """Bytes per (query, key) pair of an explicit mask the attention saves for backward on slices
    with context: 0 for kernels with native lower-right causality (flash-attn, torch varlen),
    4 for the SDPA fallback, which turns the boolean mask into a float one and keeps it."""
    attention_segment_outputs_kept: bool = False
    """Whether a unit of several segments keeps one more hidden state per token in each
    non-checkpointed layer: the SDPA fallback (one call per segment) keeps each segment's output
    for its backward beside the concatenation ``o_proj`` keeps.  False for the varlen kernels
    (one call per unit, whose output ``o_proj`` reads in place)."""
    state_bytes_per_param: float = 16.0
    """Weights + gradients + optimizer states per parameter (bf16 mixed precision + AdamW: 16)."""
    embedding_token_s: float = 2e-8
    """Embedding lookup per token (forward; backward is a scatter of the same size)."""
    elementwise_bytes_per_s: float = 2.0e12
    """Bandwidth elementwise kernels reach (the ``mlp_act`` checkpoint level's recompute of
    ``act(g) * u``).  The default is an assumption, not a measurement: about 60% of an H100's
    3.35 TB/s HBM3; ``python -m infinipipe_hf.profile`` measures it (``mlp_act_recompute`` rows)."""
    p2p_bandwidth_bytes_per_s: float = 100e9
    """Point-to-point bandwidth between adjacent stages (NVLink-class by default)."""
    p2p_latency_s: float = 20e-6
    p2p_cpu_s: float = 0.0
    """CPU seconds one point-to-point message costs its two ends together, whatever its size
    (runs whose transport copies on the cores the stages compute on: gloo on CPU).  A replica
    replay on shared cores charges half of it to the sending action and half to the receiving one
    (``ActionCosts.shared_work``).  0 (default): the transfer takes no compute from the stages, as
    with NCCL between GPUs."""
    p2p_cpu_s_per_byte: float = 0.0
    """CPU seconds per byte of a point-to-point message, both ends together (see ``p2p_cpu_s``)."""
    intra_node_bandwidth_bytes_per_s: float = 360e9
    """Bus bandwidth per GPU, per direction, of collectives inside one node (SP all-to-all,
    sharded-state all-gather / reduce-scatter, gradient all-reduce).  H100 SXM NVLink 4 is 900 GB/s
    bidirectional, 450 GB/s per direction; NCCL's measured bus bandwidth on a DGX H100 is commonly
    360-480 GB/s, the top of that range only for all-reduce with NVLink SHARP.  Default 360 GB/s:
    80% of the per-direction peak, the low end of the measured range, because all-to-all and
    all-gather get no in-switch reduction."""
    inter_node_bandwidth_bytes_per_s: float = 40e9
    """Bandwidth per GPU, per direction, of collectives and stage transfers that cross nodes.
    ConnectX-7 NDR InfiniBand is 400 Gb/s = 50 GB/s per NIC, one NIC per GPU on a DGX/HGX H100;
    default 40 GB/s, 80% of that (the same achievable fraction as the intra-node figure)."""
    collective_latency_s: float = 5e-6
    """Fixed cost per algorithm step of a collective (a ring of g ranks has g - 1 steps).  An
    order-of-magnitude figure (NCCL's small-message latency on one node is tens of microseconds
    over a ring's steps); it matters only for small messages."""
    gpus_per_node: int = 8
    """GPUs per node (8 on DGX/HGX H100): decides which groups of the rank layout cross nodes."""
    host_bandwidth_bytes_per_s: float = 40e9
    """Copies between pinned host memory and the device, per direction, per GPU (activation and
    K/V offload, offloaded model states).  PCIe 5.0 x16 peaks at about 64 GB/s per direction;
    default 40 GB/s, an assumption of the achievable share with every GPU of a node copying at
    once (``python -m infinipipe_hf.profile`` measures it on CUDA: ``host_copy`` rows)."""
    host_optimizer_params_per_s: float = 1.0e9
    """Parameters per second one GPU's share of the host cores updates with AdamW (the step of
    offloaded optimizer states).  An assumption: DeepSpeed's CPU-Adam reports about 1-2 billion
    parameters per second per 8-16 cores; ``python -m infinipipe_hf.profile`` measures it, with the
    host's cores over its local ranks (``host_adamw`` rows)."""
    memory_gib: float = 80.0
    """Device memory the profile was taken on; the default per-stage budget derives from it."""
    working_bytes_per_token: dict[str, float] = field(default_factory=dict)
    """Measured working memory of a running action, bytes per token on the reference shape:
    ``backward`` (one layer's gradient temporaries), ``forward_full`` / ``forward_mlp`` /
    ``forward_mlp_act`` (what a layer at that checkpoint level holds while it runs beyond what it
    keeps).  Set: the memory model takes a running action's peak phase by phase
    (``planner/cost/working.py``); empty (default): the linear bound of ``StageActivations.working_bytes``."""
    device: str = ""
    calibration: Calibration = field(default_factory=Calibration)
    """Whole-step mechanisms beyond the layer fit (collective overlap, per-group costs, ring steps;
    :mod:`.calibration`); the default is the ideal machine."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Versions and notes recorded by the profiler (torch, transformers, GPU...)."""
    stage_unit_s: dict[str, float] = field(default_factory=dict)
    """Seconds a stage pays once per unit, whatever its depth (unit tensors, rotary tables, launch
    gaps), ``{"forward": s, "backward": s}``, fitted from stages of two depths; empty: 0 (docs/gpu.md)."""
    attention_backends: dict[str, Any] = field(default_factory=dict)
    """Attention kernels timed per unit kind (``profiling/attention_backends.py``); empty: not measured."""
    context_pairs: str = "band"
    """How the kernel running slices with K/V context counts their pairs: ``"band"`` (flash, varlen:
    the causal band) or ``"rectangle"`` (SDPA's explicit mask, the only backend training on CPU: every
    query against every key, masked blocks too); the profiler writes its device backend's."""

    def __post_init__(self) -> None:
        for name in ("intra_node_bandwidth_bytes_per_s", "inter_node_bandwidth_bytes_per_s",
                     "host_bandwidth_bytes_per_s", "host_optimizer_params_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"profile field {name} must be > 0 (bytes per second), got {getattr(self, name)!r}")
        if not self.collective_latency_s >= 0:
            raise ValueError(f"profile field collective_latency_s must be >= 0, got {self.collective_latency_s!r}")
        check_working_fields(self.working_bytes_per_token)
        if self.context_pairs not in CONTEXT_PAIRS:
            raise ValueError(f"profile field context_pairs must be one of {CONTEXT_PAIRS}, got {self.context_pairs!r}")
        object.__setattr__(self, "calibration", Calibration.from_dict(self.calibration))
        if int(self.gpus_per_node) != self.gpus_per_node or self.gpus_per_node < 1:
            raise ValueError(f"profile field gpus_per_node must be a positive integer, got {self.gpus_per_node!r}")

    # --- serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d["format_version"] = PROFILE_FORMAT_VERSION
        return d

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> "HardwareProfile":
        if "rows" in d and "layer_forward" not in d:
            return fit_profile(d["rows"], d["reference"], name=d.get("name", "fitted"),
                               memory_gib=float(d.get("memory_gib", 80.0)), device=d.get("device", ""),
                               meta={k: d[k] for k in ("env", "source") if k in d})
        version = int(d.get("format_version", PROFILE_FORMAT_VERSION))
        if version != PROFILE_FORMAT_VERSION:
            raise ValueError(f"profile format_version {version} is not supported (expected "
                             f"{PROFILE_FORMAT_VERSION}); re-run python -m infinipipe_hf.profile")
        kw = dict(d)
        kw.pop("format_version", None)
        unknown = sorted(set(kw) - {f.name for f in fields(HardwareProfile)})
        if unknown:
            raise ValueError(f"profile fields {unknown} are not known; the profile was written by another "
                             f"version, or for the project's CPU benchmarks (whose shared_cores and pinned_ranks "
                             f"are their own settings); drop them or re-run python -m infinipipe_hf.profile")
        kw["calibration"] = Calibration.from_dict(kw.get("calibration"))
        for key in ("layer_forward", "layer_backward", "head_forward", "head_backward"):
            kw[key] = TimeCoefficients(**kw[key])
        return HardwareProfile(**kw)

    @staticmethod
    def load(path: str | Path) -> "HardwareProfile":
        """A profile JSON, or a shipped profile by name (:data:`PROFILE_NAMES`: ``uncalibrated``...)."""
        if str(path) in PROFILE_NAMES:
            return _shipped(str(path))
        try:
            with open(path) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ValueError(f"profile file {path} does not exist; create one with "
                             f"`python -m infinipipe_hf.profile --model CONFIG.json --out {path}` "
                             f"or omit --profile to use the shipped H100 profile") from None
        return HardwareProfile.from_dict(data)


def _fit(features: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares on relative error."""
    w = 1.0 / np.maximum(y, 1e-12)
    return nnls(features * w[:, None], y * w)[0]


def fit_time(points: Sequence[tuple[float, float, float]], *, with_attention: bool = True
             ) -> TimeCoefficients:
    """Fit ``(pairs, tokens, seconds)`` points to :class:`TimeCoefficients`."""
    arr = np.asarray(points, dtype=float)
    assert arr.ndim == 2 and arr.shape[1] == 3 and len(arr) >= 2, "need at least two points"
    cols = [arr[:, 0], arr[:, 1], np.ones(len(arr))] if with_attention else [arr[:, 1], np.ones(len(arr))]
    coef = [float(c) for c in _fit(np.stack(cols, axis=1), arr[:, 2])]
    return TimeCoefficients(*coef) if with_attention else TimeCoefficients(0.0, *coef)


def host_fields(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The host tier's fields from optional rows (absent rows keep the defaults):
    ``host_bandwidth_bytes_per_s`` from ``host_copy`` rows (the median per direction, the slower
    direction: copies run both ways in a step), ``host_optimizer_params_per_s`` from ``host_adamw``
    rows (the median of the ``fused`` rows, the HF Trainer's default AdamW, else of all)."""
    out = {}
    copies: dict[str, list[float]] = {}
    for r in rows:
        if r.get("kind") == "host_copy":
            copies.setdefault(r["direction"], []).append(r["bytes_per_s"])
    if copies:
        out["host_bandwidth_bytes_per_s"] = float(min(np.median(v) for v in copies.values()))
    adamw = [r for r in rows if r.get("kind") == "host_adamw"]
    fused = [r for r in adamw if r.get("impl") == "fused"] or adamw
    if fused:
        out["host_optimizer_params_per_s"] = float(np.median([r["params_per_s"] for r in fused]))
    return out


def fit_profile(rows: Sequence[Mapping[str, Any]], reference: Mapping[str, int], *, name: str,
                memory_gib: float = 80.0, device: str = "", meta: dict | None = None,
                calibration: Calibration | None = None) -> HardwareProfile:
    """Fit a profile from measurement rows (``kind`` = ``layer_causal`` / ``lm_head_ce``).

    ``layer_causal`` rows: ``tokens``, ``fwd_bwd_ms``, ``fwd_ms``, ``saved_bytes_per_token``,
    ``fwd_peak_bytes_per_token``; one causal sequence, so pairs = tokens^2.
    ``lm_head_ce`` rows: ``tokens``, ``fwd_bwd_ms`` and optionally ``fwd_ms`` (else 1/3 of it).
    Optional: ``mlp_act_recompute``, ``host_copy``, ``host_adamw`` rows (:func:`host_fields`).
    ``calibration``: applied to the fit (:func:`~.calibration.apply_calibration`; the profiler passes
    :func:`shipped_calibration` on a GPU, so a user's profile prices EPP's step at its measured efficiency).
    """
    layer = [r for r in rows if r.get("kind") == "layer_causal"]
    head = [r for r in rows if r.get("kind") == "lm_head_ce"]
    if len(layer) < 3 or len(head) < 2:
        raise ValueError(f"a profile needs >= 3 layer_causal rows and >= 2 lm_head_ce rows, got "
                         f"{len(layer)} and {len(head)}")
    # One causal sequence of s tokens is the cost model's band term with C = 0: s^2.
    fwd = [(r["tokens"] ** 2, r["tokens"], r["fwd_ms"] / 1e3) for r in layer]
    bwd = [(r["tokens"] ** 2, r["tokens"], (r["fwd_bwd_ms"] - r["fwd_ms"]) / 1e3) for r in layer]
    head_fwd, head_bwd = [], []
    for r in head:
        f_ms = r.get("fwd_ms", r["fwd_bwd_ms"] / 3.0)
        head_fwd.append((0.0, r["tokens"], f_ms / 1e3))
        head_bwd.append((0.0, r["tokens"], (r["fwd_bwd_ms"] - f_ms) / 1e3))
    saved = float(np.median([r["saved_bytes_per_token"] for r in layer]))
    # Optional: elementwise bandwidth (the mlp_act level's recompute); absent rows keep the default.
    act = [r["bytes_per_s"] for r in rows if r.get("kind") == "mlp_act_recompute"]
    extra = {"elementwise_bytes_per_s": float(np.median(act))} if act else {}
    extra.update(host_fields(rows))
    peak = float(np.median([r.get("fwd_peak_bytes_per_token", r["saved_bytes_per_token"]) for r in layer]))
    fitted = HardwareProfile(
        name=name, reference=dict(reference), layer_forward=fit_time(fwd), layer_backward=fit_time(bwd),
        head_forward=fit_time(head_fwd, with_attention=False), head_backward=fit_time(head_bwd, with_attention=False),
        activation_bytes_per_token_per_layer=saved, layer_working_bytes_per_token=max(peak - saved, 0.0),
        memory_gib=memory_gib, device=device, meta=dict(meta or {}), **extra)
    if calibration is None or calibration.is_ideal:
        return fitted
    return replace(apply_calibration(fitted, calibration), name=name)


PROFILE_NAMES = {"default": "h100_bf16_calibrated.json", "calibrated": "h100_bf16_calibrated.json",
                 "uncalibrated": "h100_bf16_measurements.json"}
"""Shipped profiles a ``--profile`` may name instead of a path."""


def _shipped(name: str) -> HardwareProfile:
    text = resources.files("infinipipe_hf.profiles").joinpath(PROFILE_NAMES[name]).read_text()
    data = json.loads(text)
    data.setdefault("name", "h100-bf16-uncalibrated")
    return HardwareProfile.from_dict(data)


@lru_cache(maxsize=1)
def default_profile() -> HardwareProfile:
    """The shipped H100/bf16 profile: the layer fit of ``profiles/h100_bf16_measurements.json`` with the
    calibration (``profiles/h100_bf16_calibrated.json``): EPP's whole-step efficiency measured on its
    own H100 runs, each measured alternative's from its published rows, the ring's per-step cost
    (docs/calibration.md says how each is fitted)."""
    return _shipped("default")


calibrated_profile = default_profile
"""The default profile, under the name of what it carries."""


@lru_cache(maxsize=1)
def uncalibrated_profile() -> HardwareProfile:
    """The layer fit alone, ideal machine (``--profile uncalibrated``): every system at the profiled
    layer speed, no ring step cost.  For comparison: it prices whole steps faster than they run."""
    return _shipped("uncalibrated")


def shipped_calibration() -> Calibration:
    """The shipped profile's calibration, which a profile measured with ``python -m infinipipe_hf.profile``
    on a GPU takes over (EPP's measured whole-step efficiency and the alternatives')."""
    return default_profile().calibration


def reference_spec(profile: HardwareProfile) -> ModelSpec:
    """The reference layer shape as a ``ModelSpec`` (for FLOP-ratio scaling)."""
    ref = profile.reference
    return ModelSpec(
        model_type=ref.get("model_type", "llama"), num_layers=1, hidden_size=ref["hidden_size"],
        intermediate_size=ref["intermediate_size"], num_attention_heads=ref["num_attention_heads"],
        num_key_value_heads=ref["num_key_value_heads"], head_dim=ref["head_dim"],
        vocab_size=ref["vocab_size"], tie_word_embeddings=False,
    )
