"""Whole-system mechanisms the per-layer profile does not see, as one parameter set for every schedule.

A layer profile prices a decoder layer run alone on an idle GPU.  A real training step also pays for
kernels outside the profiled layer (optimizer step, embedding, framework launches), for collectives
that are not hidden perfectly behind compute, for each SP/CP group it runs per round, and for ring
attention's blockwise steps.  :class:`Calibration` holds those mechanisms; its defaults are the ideal
machine (no effect); docs/calibration.md says how values are fitted on published measurements.  Every schedule -- EPP, the pipeline baselines and the alternatives -- reads the
same values from its profile, so calibration never favours one system, with one exception that is
measured per system: whole-step efficiency (``compute_efficiency`` is EPP's own, baked into the
profile's times; ``system_efficiency`` holds each measured alternative's, :func:`for_system`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Mapping, Sequence


@dataclass(frozen=True)
class Calibration:
    """Mechanisms beyond the layer profile (module docstring); defaults change nothing."""

    compute_efficiency: float = 1.0
    """Share of the profiled compute speed EPP's whole training step reaches (this project's runtime,
    measured on its own GPU runs): layer, head and embedding times are divided by it
    (:func:`apply_calibration`).  It lumps launch gaps and framework overheads of a full model; 1.0: the
    step runs at the profile's layer speed.  The pipeline baselines run on the same runtime and share it."""
    collective_overlap: float = 1.0
    """Share of the overlappable FSDP / ZeRO-3 gathers and reduce-scatters hidden behind compute
    (the rest shows in the step); 1.0: perfect prefetch overlap."""
    nccl_compute_slowdown: float = 0.0
    """Fractional slowdown of compute while collectives run beside it (NCCL kernels take SMs and
    memory bandwidth), charged on the overlapped time; 0.0: none."""
    group_round_s: float = 0.0
    """Fixed seconds per group and round of SP / CP groups (kernel launches on a fresh communicator,
    a barrier, straggler wait), summed over the groups of a round; 0.0: none."""
    ring_step_efficiency: float = 1.0
    """Speed of one ring-attention step's blockwise attention relative to the same pairs in one
    single-GPU kernel (shorter blocks, one launch per step); the ring's attention time is divided by
    it at CP degree > 1."""
    ring_merge_bytes_per_token: float = 0.0
    """Bytes moved per local token, layer and ring step to merge partial attention outputs (the
    online-softmax rescale of output and log-sum-exp), at the profile's elementwise bandwidth."""
    system_efficiency: dict[str, float] = field(default_factory=dict)
    """Whole-step efficiency of another system, by schedule name (``ulysses-zero3``, ``ring-cp``...),
    fitted on that system's published rows: its compute is priced at this share of the profiled speed
    instead of ``compute_efficiency`` (:func:`for_system`).  A system not listed has no measurement
    and is priced at EPP's own (neutral)."""

    def __post_init__(self) -> None:
        effs = {f"system_efficiency[{k!r}]": v for k, v in self.system_efficiency.items()}
        for name, v in {"compute_efficiency": self.compute_efficiency,
                        "ring_step_efficiency": self.ring_step_efficiency, **effs}.items():
            if not 0 < v <= 1.5:
                raise ValueError(f"calibration field {name} must be in (0, 1.5] (a speed ratio), got {v!r}")
        if not 0 <= self.collective_overlap <= 1:
            raise ValueError(f"calibration field collective_overlap must be in [0, 1] (share hidden), got "
                             f"{self.collective_overlap!r}")
        for name in ("nccl_compute_slowdown", "group_round_s", "ring_merge_bytes_per_token"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"calibration field {name} must be >= 0, got {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any] | "Calibration" | None) -> "Calibration":
        """From a profile's ``calibration`` entry (unknown keys are an error naming the known ones)."""
        if d is None:
            return Calibration()
        if isinstance(d, Calibration):
            return d
        known = {f.name for f in fields(Calibration)}
        bad = sorted(set(d) - known)
        if bad:
            raise ValueError(f"calibration has unknown field(s) {bad}; known: {', '.join(sorted(known))}")
        kw = {k: (v if k == "system_efficiency" else float(v)) for k, v in d.items()}
        if not isinstance(kw.get("system_efficiency", {}), Mapping):
            raise ValueError(f"calibration field system_efficiency must map schedule names to speed ratios, "
                             f"got {kw['system_efficiency']!r}")
        kw["system_efficiency"] = {str(k): float(v) for k, v in kw.get("system_efficiency", {}).items()}
        return Calibration(**kw)

    def efficiency_of(self, system: str) -> float:
        """Whole-step efficiency ``system`` is priced at (EPP's own when it has no measurement)."""
        return self.system_efficiency.get(system, self.compute_efficiency)

    @property
    def is_ideal(self) -> bool:
        return self == Calibration()


def overlapped(compute_s: float, gathers: Sequence[float], reduces: Sequence[float] = (),
               calibration: Calibration | None = None) -> float:
    """Seconds of an action whose ``compute_s`` overlaps per-unit gathers (and reduce-scatters).

    The first gather (and the last reduce-scatter) are exposed; the rest run beside compute.  Ideal:
    ``first + max(compute, rest) + last``.  Calibrated, the overlapped span ``min(compute, rest)``
    costs an extra ``(1 - collective_overlap + nccl_compute_slowdown)`` of itself.
    """
    return overlapped_with(compute_s, overlap_terms(gathers, reduces, calibration))


def overlap_terms(gathers: Sequence[float], reduces: Sequence[float] = (),
                  calibration: Calibration | None = None) -> tuple[float, float, float | None, float]:
    """What :func:`overlapped` needs of the collectives, for a caller that prices many actions
    beside the same ones: (first gather, all of them, last reduce-scatter or None, overlap factor)."""
    c = calibration or Calibration()
    comm = sum(gathers) + sum(reduces) if reduces else sum(gathers)
    first = max(gathers) if gathers else 0.0
    return first, comm, max(reduces) if reduces else None, 1.0 - c.collective_overlap + c.nccl_compute_slowdown


def overlapped_with(compute_s: float, terms: tuple[float, float, float | None, float]) -> float:
    """:func:`overlapped` of ``compute_s`` beside collectives given by :func:`overlap_terms`."""
    first, comm, last, factor = terms
    extra = factor * min(compute_s, comm)
    t = first + max(compute_s, comm) + last if last is not None else first + max(compute_s, comm)
    return t + extra if extra else t  # the ideal machine adds nothing, not even a rounding


def ring_extra_s(attention_s: float, local_tokens: float, cp: int, elementwise_bytes_per_s: float,
                 calibration: Calibration | None = None) -> float:
    """Seconds one layer and direction of ring attention adds to its ideal single-kernel time:
    the attention's step inefficiency and the ``cp - 1`` merges of partial outputs."""
    c = calibration or Calibration()
    if cp <= 1:
        return 0.0
    slow = attention_s * (1.0 / c.ring_step_efficiency - 1.0)
    merge = (cp - 1) * local_tokens * c.ring_merge_bytes_per_token / elementwise_bytes_per_s
    return slow + merge


def apply_calibration(profile, calibration: Calibration):
    """``profile`` with ``calibration`` recorded and its compute times divided by
    ``compute_efficiency`` (layer, head, embedding); apply once, to an uncalibrated profile."""
    if not profile.calibration.is_ideal:
        raise ValueError(f"profile {profile.name!r} is already calibrated ({profile.calibration}); "
                         f"apply a calibration to the uncalibrated profile")
    k = 1.0 / calibration.compute_efficiency
    return replace(profile, name=f"{profile.name}+calibrated",
                   layer_forward=profile.layer_forward.scaled(k, k),
                   layer_backward=profile.layer_backward.scaled(k, k),
                   head_forward=profile.head_forward.scaled(k, k),
                   head_backward=profile.head_backward.scaled(k, k),
                   embedding_token_s=profile.embedding_token_s * k, calibration=calibration)


def for_system(profile, system: str):
    """``profile`` as ``system`` runs: compute times rescaled from EPP's ``compute_efficiency`` (baked
    into the profile) to the system's own (``system_efficiency``); ``profile`` itself when they agree."""
    c = profile.calibration
    eff = c.efficiency_of(system)
    if eff == c.compute_efficiency:
        return profile
    k = c.compute_efficiency / eff
    return replace(profile, name=f"{profile.name}@{system}", layer_forward=profile.layer_forward.scaled(k, k),
                   layer_backward=profile.layer_backward.scaled(k, k), head_forward=profile.head_forward.scaled(k, k),
                   head_backward=profile.head_backward.scaled(k, k), embedding_token_s=profile.embedding_token_s * k,
                   calibration=replace(c, compute_efficiency=eff, system_efficiency={}))


def pricing_record(profile, systems: Sequence[str] = ()) -> dict:
    """Which profile and whole-step efficiencies price a table (its JSON key ``pricing``)."""
    c = profile.calibration
    return {"profile": profile.name, "epp_efficiency": c.compute_efficiency,
            "system_efficiency": {s: c.efficiency_of(s) for s in systems} or dict(c.system_efficiency),
            "measured": sorted(c.system_efficiency), "sources": dict(profile.meta.get("efficiency_sources", {}))}


def pricing_line(profile, systems: Sequence[str] = ()) -> str:
    """:func:`pricing_record` as one printed line."""
    return pricing_text(pricing_record(profile, systems))


def pricing_text(r: dict) -> str:
    """A :func:`pricing_record` as one printed line."""
    per = ", ".join(f"{s} {e:.2f}" + ("" if s in r["measured"] else " (no measurement: EPP's)")
                    for s, e in r["system_efficiency"].items())
    return (f"priced with profile {r['profile']}: whole-step efficiency EPP (and the pipeline baselines) "
            f"{r['epp_efficiency']:.2f}" + (f"; {per}" if per else ""))
