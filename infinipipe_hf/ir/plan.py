"""The plan of one training step, as plain data (docs/contracts.md, plan JSON).

A ``Plan`` holds everything decided before a step runs: the units, which pipeline and DP replica
each belongs to, every stage's action list per DP replica, and the number of checkpointed decoder
layers per (stage, unit): ``checkpoint_layers`` counts layers recomputed whole, the optional
``checkpoint_levels`` layers recomputed in part (``ir.levels``).  It is computed identically on
every rank and serialises to the JSON of the ``--emit-plan`` contract, so a plan can be printed,
diffed, stored and replayed.

With sequence parallelism (``sp_degree > 1``) a stage is a group of ``sp_degree`` GPUs: units and
actions are those of the group as a whole (how a unit's tokens are split over its ranks is the
runtime's business).  ``sp_degree`` and ``shard`` are written to JSON only when they differ from
their defaults (1 and ``"none"``), and a JSON without them reads back with the defaults.  The
plan's degrees and shard mode are read back as a :class:`~infinipipe_hf.layout.ParallelDims`, the
one place a shard mode's name becomes its row.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.levels import HOST_LEVELS, CheckpointMix
from infinipipe_hf.ir.sp_rounds import SubGroup
from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.layout import NO_SHARDING, ParallelDims, ShardMode


@dataclass
class Plan:
    """One step's plan.  ``actions[dp_rank][stage_index]`` is that stage's ordered action list."""

    schedule: str
    pp_degree: int
    dp_degree: int
    sequences: list[int]
    units: list[Unit]
    actions: dict[int, list[list[Action]]]
    checkpoint_layers: dict[int, dict[int, int]]
    layers_per_stage: list[int] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form planner facts (chosen slice count, token budget...); serialised, never required."""
    sp_degree: int = 1
    """GPUs per stage sharing every unit (Ulysses sequence parallelism)."""
    shard: ShardMode = NO_SHARDING
    """Model-state sharding the plan was costed with (a row of the shard table; JSON: its name)."""
    checkpoint_levels: dict[int, dict[int, dict[str, int]]] = field(default_factory=dict)
    """stage -> unit id -> level -> layers (``{"offload": n, "mlp": n}``), beside the whole
    layers of ``checkpoint_layers``; missing entries are 0.  JSON key ``checkpoint_levels``,
    written only when some count is non-zero."""
    sp_groups: dict[int, SubGroup] = field(default_factory=dict)
    """unit id -> the SP sub-group that runs it (``ir.rounds``); a unit not listed runs on the
    whole SP group.  JSON key ``sp_groups`` (``{"<unit>": [offset, size]}``), written when used."""
    rounds: list[list[int]] = field(default_factory=list)
    """Unit ids that run at the same time on disjoint sub-groups covering the stage's SP ranks;
    empty: every unit is its own round.  JSON key ``rounds``, written when used."""
    offload_kv: list[int] = field(default_factory=list)
    """Stages whose KV store (context K/V of continuing sequences, their pending gradients) lives in
    host memory, copied in layer by layer as slices need it.  JSON key ``offload_kv``, written
    when used.  Offloaded layer inputs are the ``offload`` level of ``checkpoint_levels``."""
    mlp_tile_tokens: dict[int, int] = field(default_factory=dict)
    """unit id -> tokens per MLP tile (per GPU): every layer of the unit runs its MLP tile by tile,
    each tile checkpointed (``runtime/recompute/tiled_mlp.py``), so no MLP intermediate grows with
    the unit.  JSON key ``mlp_tile_tokens`` (``{"<unit>": tokens}``), written when used."""
    attention_tile_tokens: dict[int, int] = field(default_factory=dict)
    """unit id -> tokens per tile (per GPU) of every layer's token-wise parts around the attention
    core (norms, q/k/v and o projections, rotary, residuals, MLP), each tile checkpointed
    (``runtime/recompute/tiled_attention.py``), so a layer keeps over the whole unit only what its
    attention kernel saves.  JSON key ``attention_tile_tokens``, written when used."""
    grad_reduce: str = "step"
    """When a sharded stage reduces gradients (``ir.grad_reduce``): ``step`` (once, after the
    stage's last backward) or ``unit`` (after every backward), as the plan was priced.  JSON key
    ``grad_reduce``, written when ``unit``."""

    def __post_init__(self) -> None:
        assert len(self.actions) == self.dp_degree, (len(self.actions), self.dp_degree)
        for per_stage in self.actions.values():
            assert len(per_stage) == self.pp_degree, (len(per_stage), self.pp_degree)

    # --- lookups -------------------------------------------------------------------------
    @cached_property
    def unit_by_id(self) -> dict[int, Unit]:
        return {u.id: u for u in self.units}

    def units_of(self, dp_rank: int) -> list[Unit]:
        return [u for u in self.units if u.dp_rank == dp_rank]

    def stage_actions(self, dp_rank: int, stage_index: int) -> list[Action]:
        return self.actions[dp_rank][stage_index]

    def checkpointed(self, stage_index: int, unit_id: int) -> int:
        return self.checkpoint_layers.get(stage_index, {}).get(unit_id, 0)

    def checkpoint_mix(self, stage_index: int, unit_id: int) -> CheckpointMix:
        """Whole and finer checkpointed layers of the unit on the stage."""
        finer = self.checkpoint_levels.get(stage_index, {}).get(unit_id)
        return CheckpointMix.of(self.checkpointed(stage_index, unit_id), finer)

    def sub_group(self, unit_id: int) -> SubGroup:
        return self.sp_groups.get(unit_id) or SubGroup(0, self.sp_degree)

    def check_sub_group(self, g: SubGroup, what: str = "sub-group") -> None:
        """``ValueError`` unless ``g`` is an aligned sub-group of a stage's SP ranks: a power-of-two
        size dividing ``sp_degree``, at an offset that is a multiple of it."""
        sp = self.sp_degree
        ok_size = g.size >= 1 and g.size & (g.size - 1) == 0 and sp % g.size == 0
        if not ok_size or g.offset % g.size or not 0 <= g.offset < sp:
            sizes = [n for n in (1 << k for k in range(sp.bit_length())) if sp % n == 0]
            raise ValueError(f"{what} (offset {g.offset}, size {g.size}) is not an aligned SP sub-group of "
                             f"sp_degree={sp}: the size must be one of {sizes} and the offset a "
                             f"multiple of it below {sp}")

    @property
    def round_units(self) -> list[list[int]]:
        """Unit ids per round: ``rounds``, or without them every unit its own round."""
        return self.rounds or [[u.id] for u in self.units]

    def check_rounds(self) -> None:
        """``ValueError`` unless every unit is in exactly one round (:attr:`round_units`) and each
        round's sub-groups partition the stage's SP ranks."""
        rounds = self.round_units
        ids = {u.id for u in self.units}
        seen: dict[int, int] = {}
        for r, members in enumerate(rounds):
            covered: list[int] = []
            for u in members:
                if u not in ids:
                    raise ValueError(f"round {r} names unit {u}, which the plan does not have")
                if u in seen:
                    raise ValueError(f"unit {u} is in round {seen[u]} and round {r}; a unit runs in one round")
                seen[u] = r
                self.check_sub_group(self.sub_group(u), f"unit {u}'s sub-group")
                covered.extend(self.sub_group(u).ranks)
            if sorted(covered) != list(range(self.sp_degree)):
                raise ValueError(f"round {r} (units {list(members)}) covers SP ranks {sorted(covered)}; the "
                                 f"sub-groups of a round must cover ranks 0..{self.sp_degree - 1} exactly once")
        missing = sorted(ids - set(seen))
        if missing:
            raise ValueError(f"units {missing[:8]} are in no round; with rounds every unit is in one")

    def runs_on(self, unit_id: int, sp_rank: int) -> bool:
        """Whether SP rank ``sp_rank`` of a stage takes part in the unit."""
        return self.sub_group(unit_id).contains(sp_rank)

    @property
    def num_tokens(self) -> int:
        return sum(self.sequences)

    @property
    def num_pipelines(self) -> int:
        return len({(u.dp_rank, u.pipeline) for u in self.units})

    @property
    def uses_host_tier(self) -> bool:
        """Whether the plan keeps activations in host memory: a stage's K/V store (``offload_kv``)
        or layers of some (stage, unit) at a host level (``offload``, ``offload_attn``)."""
        return bool(self.offload_kv) or any(per.get(lv) for per_stage in self.checkpoint_levels.values()
                                            for per in per_stage.values() for lv in HOST_LEVELS)

    def continues_after(self, segment: Segment) -> bool:
        """True when a later slice of the same sequence needs this segment's K/V."""
        return segment.end < self.sequences[segment.seq]

    # --- serialisation (docs/contracts.md) --------------------------------------------------
    def to_dict(self) -> dict:
        d = {
            "schedule": self.schedule,
            "pp_degree": self.pp_degree,
            "dp_degree": self.dp_degree,
        }
        if self.sp_degree != 1:
            d["sp_degree"] = self.sp_degree
        if self.shard.sharded:
            d["shard"] = self.shard.name
        d.update({
            "sequences": list(self.sequences),
            "units": [u.to_dict() for u in self.units],
            "actions": {
                str(r): [[str(a) for a in stage] for stage in per_stage]
                for r, per_stage in sorted(self.actions.items())
            },
            "checkpoint_layers": {
                str(s): {str(u): int(n) for u, n in sorted(per_unit.items())}
                for s, per_unit in sorted(self.checkpoint_layers.items())
            },
            "layers_per_stage": list(self.layers_per_stage),
            "info": self.info,
        })
        levels = self._levels_dict()
        if levels:  # absent when no finer level is used
            d["checkpoint_levels"] = levels
        if self.sp_groups:
            d["sp_groups"] = {str(u): [g.offset, g.size] for u, g in sorted(self.sp_groups.items())}
        if self.rounds:
            d["rounds"] = [list(r) for r in self.rounds]
        if self.offload_kv:
            d["offload_kv"] = sorted(int(s) for s in self.offload_kv)
        if self.mlp_tile_tokens:
            d["mlp_tile_tokens"] = {str(u): int(n) for u, n in sorted(self.mlp_tile_tokens.items())}
        if self.attention_tile_tokens:
            d["attention_tile_tokens"] = {str(u): int(n) for u, n in sorted(self.attention_tile_tokens.items())}
        if self.grad_reduce != "step":
            d["grad_reduce"] = self.grad_reduce
        return d

    def _levels_dict(self) -> dict:
        out = {}
        for s, per_unit in sorted(self.checkpoint_levels.items()):
            units = {str(u): {lv: int(n) for lv, n in sorted(per.items()) if n}
                     for u, per in sorted(per_unit.items()) if any(per.values())}
            if units:
                out[str(s)] = units
        return out

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @staticmethod
    def from_dict(d: dict) -> "Plan":
        layout = ParallelDims(int(d["pp_degree"]), int(d.get("sp_degree", 1)), int(d["dp_degree"]),
                              str(d.get("shard", "none")))
        return Plan(
            schedule=d["schedule"],
            pp_degree=layout.pp_degree,
            dp_degree=layout.dp_degree,
            sequences=[int(x) for x in d["sequences"]],
            units=[Unit.from_dict(u) for u in d["units"]],
            actions={
                int(r): [[Action.parse(a) for a in stage] for stage in per_stage]
                for r, per_stage in d["actions"].items()
            },
            checkpoint_layers={
                int(s): {int(u): int(n) for u, n in per_unit.items()}
                for s, per_unit in d.get("checkpoint_layers", {}).items()
            },
            layers_per_stage=[int(x) for x in d.get("layers_per_stage", [])],
            info=dict(d.get("info", {})),
            sp_degree=layout.sp_degree,
            shard=layout.shard,
            checkpoint_levels={
                int(s): {int(u): {str(lv): int(n) for lv, n in per.items()} for u, per in per_unit.items()}
                for s, per_unit in d.get("checkpoint_levels", {}).items()
            },
            sp_groups={int(u): SubGroup(int(g[0]), int(g[1])) for u, g in d.get("sp_groups", {}).items()},
            rounds=[[int(u) for u in r] for r in d.get("rounds", [])],
            offload_kv=[int(s) for s in d.get("offload_kv", [])],
            mlp_tile_tokens={int(u): int(n) for u, n in d.get("mlp_tile_tokens", {}).items()},
            attention_tile_tokens={int(u): int(n) for u, n in d.get("attention_tile_tokens", {}).items()},
            grad_reduce=str(d.get("grad_reduce", "step")),
        )

    @staticmethod
    def from_json(text: str) -> "Plan":
        """A plan from its JSON; malformed JSON, a missing field or a value of the wrong type is a
        ``ValueError`` naming it (whether the plan can run is the validator's check, made on every
        rank before the plan runs)."""
        try:
            return Plan.from_dict(json.loads(text))
        except KeyError as exc:
            raise ValueError(f"plan JSON lacks the field {exc}; write plans with Plan.to_json or "
                             f"--emit-plan (docs/contracts.md)") from None
        except (TypeError, ValueError, AttributeError, IndexError) as exc:
            raise ValueError(f"plan JSON is malformed ({type(exc).__name__}: {exc}); write plans with "
                             f"Plan.to_json or --emit-plan (docs/contracts.md)") from None

    def __str__(self) -> str:
        lines = [
            f"Plan[{self.schedule}] pp={self.pp_degree} dp={self.dp_degree} "
            + (f"sp={self.sp_degree} " if self.sp_degree != 1 else "")
            + (f"shard={self.shard.name} " if self.shard.sharded else "")
            + f"sequences={len(self.sequences)} tokens={self.num_tokens} units={len(self.units)} "
            f"pipelines={self.num_pipelines}"
        ]
        for u in self.units:
            segs = " ".join(f"{s.seq}[{s.start}:{s.end}]" for s in u.segments)
            lines.append(f"  unit {u.id:>3} dp{u.dp_rank} pipe{u.pipeline}: {segs}")
        for r, per_stage in sorted(self.actions.items()):
            for s, acts in enumerate(per_stage):
                lines.append(f"  dp{r} stage{s}: " + " ".join(
                    f"{a}" + (self._ckpt_tag(s, a.unit) if a.is_forward else "") for a in acts))
        return "\n".join(lines)

    def _ckpt_tag(self, stage_index: int, unit_id: int) -> str:
        """``(c2)`` for two whole layers, ``(o1+c2+k1+m1+a3)`` with other levels (``h``: offload_attn,
        ``o``: offload, ``k``: keep_attn), empty for none."""
        mix = self.checkpoint_mix(stage_index, unit_id)
        tags = (("h", mix.offload_attn), ("p", mix.offload_pair), ("o", mix.offload), ("c", mix.full), ("k", mix.keep_attn), ("m", mix.mlp), ("a", mix.mlp_act))
        parts = [f"{tag}{n}" for tag, n in tags if n]
        return f"({'+'.join(parts)})" if parts else ""
