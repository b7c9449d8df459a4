"""``alst``: Arctic Long Sequence Training (Snowflake, arXiv 2506.13996), the HF ecosystem's answer
to "my sequence does not fit".

What it models, as ArcticTraining runs it:
- Ulysses sequence parallelism over a node: ``sp = min(world, gpus_per_node)`` (at most the
  attention heads), data parallelism over the nodes; each group trains one sequence at a time
  (rounds of one sequence per group, slowest first, in lockstep as ZeRO-3 gathers need).  On
  more than a node the SP group over every GPU (at most the heads; its all-to-alls cross nodes)
  is tried too, as the paper's multi-node runs do for one sequence: the faster that fits wins;
- ZeRO-3 states over all GPUs (:class:`~.flat_cost.Zero3States`) with the optimizer in host
  memory (``state_offload="optimizer"``: AdamW moments and fp32 masters on host, the step on the
  CPU) and, on one GPU, the parameters too (``"states"``); priced by the state-offload helpers of
  :mod:`infinipipe_hf.planner.cost.state_host` (host bytes, per-unit copies, the CPU step's tail);
- every decoder layer checkpointed with its input offloaded to host memory: the device holds no
  layer's saved tensors, only the two inputs in flight (one going out, one coming back), the
  running layer's working set and gradients;
- tiled MLP (tiles of ``hidden_size`` tokens per GPU, ArcticTraining's default) and tiled loss
  (``loss_chunk_tokens`` logits at a time): no per-token MLP intermediate grows with the sequence.

Time: the SP group's compute from the pipeline cost model (:class:`~.flat_cost.UlyssesGroup`:
forward, backward and the replay of every layer), the ZeRO-3 gathers and reduce-scatters
overlapped as FSDP's prefetch does, the input copies at ``host_bandwidth_bytes_per_s`` (a copy
longer than its layer's compute shows the excess, as :mod:`infinipipe_hf.planner.cost.host`
prices EPP's), and the CPU optimizer step after the last round.  Memory: device states plus the
largest round's working set within the GPU budget; host states plus every layer's input of the
longest sequence within the host budget.  Trade-off: the tiles' extra kernel launches are not
priced (the paper measures them small), and the working set outside the MLP is taken to scale
with the activations as the profile's reference layer's does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

from infinipipe_hf.layout.state_offload import state_offload
from infinipipe_hf.planner.alternatives.flat_cost import FlatCost, UlyssesGroup
from infinipipe_hf.planner.alternatives.round_plan import GroupRun, RoundPlan, RoundSimulation, check_plan
from infinipipe_hf.planner.alternatives.round_schedule import RoundContext, RoundSchedule
from infinipipe_hf.planner.batch.rounds import lockstep_rounds
from infinipipe_hf.planner.cost.activations import norm_elements
from infinipipe_hf.planner.cost.calibration import overlapped
from infinipipe_hf.planner.cost.state_host import host_state_bytes_per_param, offloaded_step_tail_s, unit_copy_s
from infinipipe_hf.planner.cost.states import sharded_numel
from infinipipe_hf.planner.schedules.base import Candidate, Knobs, SearchState

NAME = "alst"
ATTENTION = "ulysses"


@dataclass(frozen=True)
class ALSTKnobs(Knobs):
    sp_degree: int

    def record(self) -> dict:
        return {"sp_degree": self.sp_degree}


def device_kept_bytes(offload, precision) -> float:
    """Device bytes per parameter of a shard kept through the step besides its gradient: weights and
    moments, the weights alone (optimizer on host) or nothing (every state on host)."""
    if offload.weights_on_host:
        return 0.0
    kept = precision.state_bytes_per_param - precision.grad_bytes_per_param
    return kept - precision.optimizer_bytes_per_param if offload.optimizer_on_host else kept


class ALSTStates:
    """ZeRO-3 states over all GPUs with the optimizer (one GPU: every state) in host memory."""

    def __init__(self, cost: FlatCost):
        z = self.zero3 = cost.states
        self.profile = cost.layout.profile
        self.offload = state_offload("states" if cost.world_size == 1 else "optimizer")
        p = self.precision = z.precision
        self.shard_numel = [sharded_numel(u, z.world_size) for u in z.units]
        largest = max(z.unit_numel)
        grads = 0.0 if self.offload.weights_on_host else p.grad_bytes_per_param
        self.device_bytes = (sum(self.shard_numel) * (device_kept_bytes(self.offload, p) + grads)
                             + 3 * largest * p.compute_bytes_per_param + largest * p.reduce_bytes_per_param)
        """Device bytes of the states during a step: kept shards, gathered and running units."""
        self.host_bytes = sum(self.shard_numel) * host_state_bytes_per_param(self.offload, p)
        """Host bytes of the states on one GPU's share."""
        on_host = self.offload.weights_on_host
        self.fetch_s = unit_copy_s(self.shard_numel, p.weight_bytes_per_param, self.profile) if on_host else []
        self.drain_s = unit_copy_s(self.shard_numel, p.reduce_bytes_per_param, self.profile) if on_host else []
        self.step_tail_s = offloaded_step_tail_s(self.offload, self.shard_numel, p, self.profile,
                                                 grads_on_device=not on_host)
        """Exposed seconds of the CPU optimizer step after the last round."""

    def round_time(self, forward_s: float, backward_s: float) -> float:
        """A round's seconds: ZeRO-3 gathers (and, with parameters on host, their copies up and the
        gradients' copies down) overlapped with the slowest group's compute."""
        if not self.fetch_s:
            return self.zero3.round_time(forward_s, backward_s)
        c, z = self.zero3.calibration, self.zero3
        gathers = [f + g for f, g in zip(self.fetch_s, z.gather_s)] if z.world_size > 1 else self.fetch_s
        reduces = [d + r for d, r in zip(self.drain_s, z.reduce_s)] if z.world_size > 1 else self.drain_s
        return overlapped(forward_s, gathers, (), c) + overlapped(backward_s, gathers, reduces, c)


class ALSTCost:
    """What ALST's plans are priced with: the job's :class:`FlatCost`, the SP group, the host budget."""

    def __init__(self, cost: FlatCost, host_budget_bytes: float, sp: int):
        if not host_budget_bytes >= 0:
            raise ValueError(f"host_budget_bytes={host_budget_bytes!r} must be >= 0 (host memory per GPU)")
        self.flat = cost
        self.host_budget_bytes = float(host_budget_bytes)
        self.sp_degree = int(sp)
        self.group: UlyssesGroup = cost.group(ATTENTION, self.sp_degree)
        self.states = ALSTStates(cost)
        acts = self.group.cost.acts
        self.layers = cost.spec.num_layers
        self.hidden = acts.hidden_bytes_per_token
        act, mlp = acts.act_bytes_per_token, 4 * cost.spec.intermediate_size * acts.profile.bytes_per_element
        mlp = min(mlp, act)
        work = acts.layer_working_bytes_per_token
        outside = (act - mlp) / act if act else 0.0
        # Per GPU token: the running layer's rebuilt activations outside the MLP and its working set,
        # the gradients flowing through it (in and out), the two offloaded inputs in flight, and the
        # final norm's saved tensors with the head's input (as the pipeline's last stage keeps them).
        final = norm_elements(acts.profile.bytes_per_element) + 1
        self.per_token_bytes = (act - mlp) + work * outside + (2 + 2 + final) * self.hidden
        self.tile_bytes = cost.spec.hidden_size * (2 * mlp + work * (1 - outside))
        """One MLP tile's intermediates and their gradients (``hidden_size`` tokens per GPU)."""
        self.acts = acts

    def gpu_tokens(self, padded: int) -> int:
        return self.group.gpu_tokens(padded)

    def device_activation_bytes(self, padded: int) -> float:
        t = self.gpu_tokens(padded)
        return t * self.per_token_bytes + self.tile_bytes + self.acts.loss_chunk_bytes(t)

    def host_activation_bytes(self, padded: int) -> float:
        """Every layer's input of the sequence, on one GPU's share of it."""
        return self.layers * self.gpu_tokens(padded) * self.hidden

    def copy_exposed_s(self, padded: int, forward_s: float, backward_s: float) -> float:
        """Seconds the input copies add: each layer's copy out beyond its forward, back beyond its
        backward with replay."""
        copy = self.gpu_tokens(padded) * self.hidden / self.flat.layout.profile.host_bandwidth_bytes_per_s
        per_f, per_b = forward_s / self.layers, backward_s / self.layers
        return self.layers * (max(0.0, copy - per_f) + max(0.0, copy - per_b))

    def fits(self, padded: int) -> bool:
        device = self.states.device_bytes + self.device_activation_bytes(padded)
        host = self.states.host_bytes + self.host_activation_bytes(padded)
        return device <= self.flat.memory_budget_bytes and host <= self.host_budget_bytes

    def max_tokens(self) -> int:
        """The longest sequence (padded tokens) that fits both budgets (0: none)."""
        lo, hi = 0, self.sp_degree
        while self.fits(hi) and hi < 1 << 36:
            lo, hi = hi, hi * 2
        while hi - lo > self.sp_degree:
            mid = (lo + hi) // 2 // self.sp_degree * self.sp_degree
            lo, hi = (mid, hi) if self.fits(mid) else (lo, mid)
        return lo


def sp_degrees(cost: FlatCost) -> list[int]:
    """ALST's SP groups: the node (``min(world, gpus_per_node)``) and, on more than a node, every
    GPU; both at most the attention heads (Ulysses' limit)."""
    sizes = cost.group_sizes(ATTENTION)
    node = max(g for g in sizes if g <= min(cost.world_size, cost.layout.gpus_per_node))
    return sorted({node, max(sizes)})


@dataclass
class ALSTSimulation(RoundSimulation):
    """:class:`RoundSimulation` with the host tier's figures."""

    host_peak_memory_bytes: float = 0.0
    host_budget_bytes: float = 0.0
    step_tail_s: float = 0.0
    """Exposed seconds of the CPU optimizer step (in ``step_time_s``)."""


def build_plan(lengths: Sequence[int], alst: ALSTCost) -> RoundPlan:
    """One sequence per group per round, slowest first, rounds in lockstep."""
    g = alst.group
    times = []
    for n in lengths:
        padded = g.padded_tokens(n)
        times.append(sum(g.times(g.micro_batch_pairs([n], padded), padded, alst.layers)[:2]))
    groups = alst.flat.world_size // alst.sp_degree
    rounds = [[GroupRun(alst.sp_degree, (i,)) for i in idx] for idx in lockstep_rounds(times, groups)]
    return RoundPlan(NAME, alst.flat.world_size, list(lengths), ATTENTION, rounds, alst.layers,
                     {"sp_degree": alst.sp_degree, "state_offload": alst.states.offload.name})


def simulate_alst(plan: RoundPlan, alst: ALSTCost) -> ALSTSimulation:
    """Price ``plan`` (module docstring)."""
    check_plan(plan)
    g, states = alst.group, alst.states
    step = busy = recompute = 0.0
    padded_total, longest, round_times = 0, 0, []
    for rnd in plan.rounds:
        fwd_max = bwd_max = 0.0
        for run in rnd:
            n = plan.sequences[run.seqs[0]]
            padded = g.padded_tokens(n)
            fwd, bwd, rec = g.times(g.micro_batch_pairs([n], padded), padded, alst.layers)
            bwd += alst.copy_exposed_s(padded, fwd, bwd)
            fwd_max, bwd_max = max(fwd_max, fwd), max(bwd_max, bwd)
            busy += run.gpus * (fwd + bwd)
            recompute += rec
            padded_total += padded
            longest = max(longest, padded)
        t = states.round_time(fwd_max, bwd_max) + states.zero3.calibration.group_round_s * sum(r.gpus > 1 for r in rnd)
        round_times.append(t)
        step += t
    step += states.step_tail_s
    peak = states.device_bytes + alst.device_activation_bytes(longest)
    host = states.host_bytes + alst.host_activation_bytes(longest)
    budget, host_budget = alst.flat.memory_budget_bytes, alst.host_budget_bytes
    error = None
    if peak > budget or host > host_budget:
        error = (f"{NAME}: a sequence of {longest} tokens on {alst.sp_degree} GPU(s) needs {peak / 2**30:.2f} GiB per "
                 f"GPU (budget {budget / 2**30:.2f}) and {host / 2**30:.2f} GiB of host memory per GPU (budget "
                 f"{host_budget / 2**30:.2f})")
    capacity = step * plan.world_size
    return ALSTSimulation(step, plan.num_tokens / step if step > 0 else 0.0,
                          max(0.0, 1.0 - busy / capacity) if capacity > 0 else 0.0, peak, budget, recompute,
                          padded_total, round_times, error is None, error, host, host_budget, states.step_tail_s)


@dataclass(frozen=True)
class ALSTContext(RoundContext):
    alst: tuple[ALSTCost, ...] = ()
    """The pricing of each SP group size tried."""


class ALSTSchedule(RoundSchedule):
    """ALST on the job's GPUs (module docstring): the node or every GPU as the SP group."""

    name = NAME
    attention = ATTENTION
    uses_host_tier = True
    """``plan_alternative`` passes it ``host_budget_bytes`` (host memory per GPU)."""

    def context(self, lengths: list[int], cost: FlatCost, checkpointing: str | int = "adaptive", *,
                host_budget_bytes: float = 0.0) -> ALSTContext:
        """``checkpointing`` must leave every layer checkpointed (``adaptive`` or ``full``)."""
        cost = cost.for_system(self.name)
        if checkpointing not in ("adaptive", "full", cost.spec.num_layers):
            raise ValueError(f"{NAME} checkpoints every layer (its input offloaded to host memory); "
                             f"checkpointing={checkpointing!r} is not possible: use 'adaptive' or 'full'")
        alst = tuple(ALSTCost(cost, host_budget_bytes, sp) for sp in sp_degrees(cost))
        return ALSTContext(lengths, cost, cost.spec.num_layers, [a.sp_degree for a in alst], alst)

    def candidates(self, ctx: ALSTContext, state: SearchState) -> Iterator[Candidate]:
        for alst in ctx.alst:
            yield Candidate(ALSTKnobs(alst.sp_degree), lambda alst=alst: build_plan(ctx.lengths, alst))

    def simulate(self, plan: RoundPlan, ctx: ALSTContext) -> ALSTSimulation:
        return simulate_alst(plan, next(a for a in ctx.alst if a.sp_degree == plan.knobs["sp_degree"]))

    def infeasible_message(self, ctx: ALSTContext, last_error: str | None) -> str:
        alst = ctx.alst[-1]
        if alst.host_budget_bytes <= 0:
            return (f"{NAME} keeps optimizer states and every layer's input in host memory, but the host budget is 0; "
                    f"give the host memory per GPU (--host-memory-gib)")
        cap = alst.max_tokens()
        longest = max(ctx.lengths)
        if cap < longest:
            return (f"{NAME}: sequence {list(ctx.lengths).index(longest)} of {longest} tokens does not fit on "
                    f"{alst.sp_degree} GPU(s) (at most {cap} tokens fit in {alst.flat.memory_budget_bytes / 2**30:.1f} "
                    f"GiB per GPU and {alst.host_budget_bytes / 2**30:.1f} GiB of host memory per GPU); {last_error}")
        return f"{NAME}: {last_error}"

    def summary(self, result) -> dict:
        d = super().summary(result)
        sim = result.simulation
        ok = result.feasible and sim is not None
        d["host_peak_memory_bytes"] = sim.host_peak_memory_bytes if ok else None
        d["host_memory_budget_bytes"] = sim.host_budget_bytes if sim is not None else None
        if result.plan is not None:
            d["state_offload"] = result.plan.knobs.get("state_offload")
        if ok:
            d["info"]["state_step_tail_s"] = sim.step_tail_s
        return d
