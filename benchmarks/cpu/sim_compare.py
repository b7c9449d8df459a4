"""Compare one executed step with the simulator: order, step time, per-action breakdown, memory.

Used by ``sim_vs_real.py``.  Given the executed plan, the merged timelines of the timed steps
(per action: wall start/end, time blocked on a peer, the thread's CPU seconds) and every rank's
peak memory (``runtime_worker.memory_probe_step``), and the cost model the engine planned with:

- step time: the simulated step (``planner.simulator.simulate``, processor sharing when the
  cost model is a ``shared_cores.SharedCoresCost``) against the median span of the executed
  pipelines; where the run probed the machine's speed before every timed step, each step against
  the simulation at the speed of the two probes around it, and the median over steps (a speed
  burst during one step is one outlier, not the result);
- where the difference goes, per (stage, F/B): the cost model's work against the measured CPU
  seconds (the *cost model's* error), and the wall seconds the actions took beyond their CPU
  seconds and waits (time the rank was descheduled: sharing the cores with the other ranks,
  which the simulator models, or with other jobs, which it does not);
- a *measured-work replay*: the same replay with every action's work set to its measured CPU
  seconds.  Its step against the measured span is the error of the machine model alone
  (sharing, transfers, the executor's glue between actions), the simulated step against it the
  error of the per-action costs alone;
- CPU outside the actions, per rank: the executor's glue on the main thread and what the
  process's other threads (gloo's) used, from the worker's per-step CPU counts;
- background: the cores other processes used while the steps ran, and as a diagnostic the
  simulated step on the cores they left free (the simulator's own figure assumes none used);
- memory: per stage, the simulator's peak (``SimulationResult.peak_memory_bytes``) against the
  largest measured peak of the stage's ranks.
"""
from __future__ import annotations

import statistics
from collections import defaultdict


def _actions_work(plan, cost):
    """``duration(stage, action)`` (the action's own compute, what its thread's CPU seconds
    measure) and ``transfer(action)`` exactly as the simulator prices them."""
    from infinipipe_hf.planner.simulate.action_costs import ActionCosts

    costs = ActionCosts(plan, cost)
    return costs.duration, costs.transfer


def measured_work_replay(plan, cost, timeline) -> float:
    """Step time of the simulator's replay with each action's work = its measured CPU seconds (the
    busiest SP rank of the stage), plus on shared cores its modelled share of its messages' CPU
    (spent on gloo's threads, outside the action's own thread); one DP replica (the benchmark's
    layouts).  A round of SP sub-groups is one step: its slowest unit's measured work."""
    from benchmarks.lib.shared_cores import shared_replay
    from infinipipe_hf.planner.simulate.replay import replay

    if plan.dp_degree != 1:
        raise ValueError(f"measured_work_replay handles one DP replica, the plan has {plan.dp_degree}")
    from infinipipe_hf.planner.simulate.action_costs import ActionCosts

    cpu: dict[tuple[int, str], float] = defaultdict(float)
    for e in timeline.events:
        cpu[(e.stage, e.action)] = max(cpu[(e.stage, e.action)], e.cpu_s)
    from infinipipe_hf.ir.actions import Action
    from infinipipe_hf.ir.rank_views import has_sub_groups
    from infinipipe_hf.planner.simulate.sp_round_steps import RoundSteps

    # With SP rounds a round's units run side by side: one step, as long as its slowest unit.
    steps = RoundSteps(plan) if has_sub_groups(plan) else None
    costs = ActionCosts(plan, cost, steps)
    stages = plan.actions[0] if steps is None else steps.lists[0]

    def measured(s, a):
        units = [a.unit] if steps is None else steps.units(a.unit)
        return max(cpu[(s, str(Action(a.kind, u)))] for u in units)

    shared = getattr(cost, "shared", None)
    if shared is not None:
        (rep,) = shared_replay([stages], lambda s, a: measured(s, a) + costs.message_cpu(s, a), costs.transfer,
                               cores=shared.cores, ranks_per_stage=plan.sp_degree, pinned=shared.pinned)
    else:
        rep = replay(stages, measured, costs.transfer)
    return max((e[-1] for e in rep.end if e), default=0.0)


def breakdown(plan, cost, sim, timelines) -> dict:
    """Per (stage, F/B) sums over the timed steps' medians (module docstring)."""
    duration, _ = _actions_work(plan, cost)
    sim_work = defaultdict(float)
    for r, stages in plan.actions.items():
        for s, acts in enumerate(stages):
            for a in acts:
                sim_work[(s, a.kind)] += duration(s, a)
    sim_wall = defaultdict(float)
    for e in sim.events:
        sim_wall[(e.stage, e.action[0])] += e.end_s - e.start_s
    per_step = []
    for tl in timelines:
        m = defaultdict(lambda: defaultdict(float))
        ranks_of = defaultdict(set)
        for e in tl.events:
            k = (e.stage, e.action[0])
            ranks_of[k].add(e.rank)
            m[k]["cpu_s"] += e.cpu_s
            m[k]["wall_s"] += e.duration_s - e.wait_s
            m[k]["wait_s"] += e.wait_s
        # SP ranks of a stage run the same actions: average them, as the simulator prices one.
        per_step.append({k: {q: v / len(ranks_of[k]) for q, v in d.items()} for k, d in m.items()})
    rows = []
    for k in sorted(sim_work):
        med = {q: statistics.median(st[k][q] for st in per_step if k in st) for q in ("cpu_s", "wall_s", "wait_s")}
        rows.append({"stage": k[0], "kind": k[1], "simulated_work_s": sim_work[k],
                     "simulated_wall_s": sim_wall[k], "measured_cpu_s": med["cpu_s"],
                     "measured_wall_busy_s": med["wall_s"], "measured_wait_s": med["wait_s"],
                     "cpu_over_simulated_work": med["cpu_s"] / sim_work[k] if sim_work[k] else None,
                     "wall_busy_over_simulated_wall": med["wall_s"] / sim_wall[k] if sim_wall[k] else None})
    return {"rows": rows}


def _per_action_memory(acts: list[str], simulated: list[float], top: dict | None) -> dict | None:
    """Simulated vs measured bytes at every action of the rank with the highest peak, and the
    action where the simulator falls furthest below the measurement (where a model term is missing)."""
    measured = (top or {}).get("action_peaks")
    if not measured:
        return None
    rows = [(a, s, measured.get(a)) for a, s in zip(acts, simulated)]
    gaps = [(m - s, a) for a, s, m in rows if m is not None]
    worst = max(gaps) if gaps else None
    return {"actions": acts, "simulated_bytes": simulated, "measured_bytes": [m for _, _, m in rows],
            "largest_underestimate_bytes": worst[0] if worst else None,
            "largest_underestimate_action": worst[1] if worst else None}


def cpu_outside_actions(run: dict, timelines) -> dict | None:
    """Per rank, the median over timed steps of the CPU seconds a step took beyond its actions'
    own: on the main thread (the executor's glue, ``executor_glue``) and on the process's other
    threads (gloo moving bytes, ``other_threads``); None for runs that did not record them."""
    process, main = run.get("process_cpu_s"), run.get("main_thread_cpu_s")
    if not process or not main or len(process) != len(timelines):
        return None
    glue, threads = defaultdict(list), defaultdict(list)
    for tl, proc_step, main_step in zip(timelines, process, main):
        actions = defaultdict(float)
        for e in tl.events:
            actions[e.rank] += e.cpu_s
        for rank, (p, m) in enumerate(zip(proc_step, main_step)):
            glue[rank].append(m - actions[rank])
            threads[rank].append(p - m)
    return {"executor_glue": [statistics.median(glue[r]) for r in sorted(glue)],
            "other_threads": [statistics.median(threads[r]) for r in sorted(threads)]}


def bracketed_steps(plan, step_costs, spans) -> list[dict]:
    """Each timed step against the simulation priced at the machine's speed measured right
    around it (``step_costs[k]``: the profile rescaled to the probes before and after step k)."""
    from infinipipe_hf.planner.simulate.simulator import simulate

    if len(step_costs) != len(spans):
        raise ValueError(f"one cost model per timed step: got {len(step_costs)} for {len(spans)} steps")
    out = []
    for c, span in zip(step_costs, spans):
        t = simulate(plan, c).step_time_s
        out.append({"speed_factor": c.profile.meta.get("speed_factor"), "simulated_step_s": t,
                    "measured_step_s": span, "relative_difference": (t - span) / span})
    return out


def simulated_memory_series(plan, cost, stage: int, sp_rank: int) -> tuple[list[str], list[float]]:
    """The simulated device bytes at each action of replica 0's ``stage`` as SP rank ``sp_rank``
    runs it: with SP rounds a rank holds only its own units (its rank view), so the series'
    maximum over the ranks is the simulator's peak."""
    from infinipipe_hf.ir.rank_views import rank_view
    from infinipipe_hf.planner.simulate.simulator import stage_point_values

    view = rank_view(plan, sp_rank)
    return [str(a) for a in view.stage_actions(0, stage)], stage_point_values(view, cost, 0, stage)


def compare_run(run: dict, cost, *, tol: float, uncalibrated=None, step_costs=None) -> dict:
    """Everything ``sim_vs_real`` reports for one schedule's run.  ``cost`` prices the plan (its
    profile rescaled to the factor of all the run's speed probes pooled); ``uncalibrated``, the cost
    model of the profile as fitted, is simulated beside it for the record.  With ``step_costs`` (one
    cost model per timed step, rescaled to the probes bracketing that step) the headline
    ``relative_difference`` is the median over the steps of each step against its own
    simulation, and the pooled comparison sits beside it (``pooled_relative_difference``)."""
    from infinipipe_hf.ir.plan import Plan
    from infinipipe_hf.planner.simulate.simulator import simulate
    from infinipipe_hf.runtime.engine.timeline import Timeline

    plan = Plan.from_dict(run["plan"])
    sim = simulate(plan, cost)
    timelines = [Timeline.from_dict(t) for t in run["timelines"]]
    spans = run["step_span_s"]
    measured = statistics.median(spans)
    last = timelines[-1]
    orders_equal = True
    for r, stages in plan.actions.items():
        for s, acts in enumerate(stages):
            executed = [e.action for e in sorted(last.events, key=lambda e: e.start_s)
                        if e.stage == s and e.dp_rank == r and e.rank == min(
                            x.rank for x in last.events if x.stage == s and x.dp_rank == r)]
            orders_equal &= executed == [str(a) for a in acts if plan.runs_on(a.unit, 0)]  # SP rank 0's units
    replayed = statistics.median(measured_work_replay(plan, cost, tl) for tl in timelines)

    mem = {}
    for stage in range(plan.pp_degree):
        ranks = [p for p in run.get("measured_peak_memory") or [] if p["stage"] == stage]
        top = max(ranks, key=lambda p: p["peak_bytes"], default=None)
        got = top["peak_bytes"] if top else None
        want = sim.peak_memory_bytes[stage]
        acts, values = simulated_memory_series(plan, cost, stage, top.get("sp_rank", 0) if top else 0)
        where = top.get("peak_action") if top else None
        mem[str(stage)] = {"simulated_peak_bytes": want, "measured_peak_bytes": got,
                           "relative_difference": (want - got) / got if got else None,
                           "simulated_peak_action": acts[values.index(max(values))] if values else None,
                           "measured_peak_action": where,
                           "simulated_bytes_at_measured_peak_action": values[acts.index(where)] if where in acts else None,
                           "per_action": _per_action_memory(acts, values, top)}
    mem_worst = max((v["relative_difference"] for v in mem.values() if v["relative_difference"] is not None),
                    key=abs, default=None)  # signed: negative = the simulator under-estimates
    pooled = (sim.step_time_s - measured) / measured
    per_step = bracketed_steps(plan, step_costs, spans) if step_costs else None
    rel = statistics.median(x["relative_difference"] for x in per_step) if per_step else pooled
    background = statistics.median(run["background_cores"]) if run.get("background_cores") else None
    outside = cpu_outside_actions(run, timelines)
    with_background, shared = None, getattr(cost, "shared", None)
    if background is not None and shared is not None and not shared.pinned:
        # (Pinned ranks cannot move to a core other jobs left free: no such diagnostic.)
        # Diagnostic only: the same replay on the cores other jobs left free on average.
        from benchmarks.lib.shared_cores import SharedCores, SharedCoresCost

        free = max(shared.cores - background, 0.5)
        with_background = simulate(plan, SharedCoresCost.of(cost, SharedCores(free))).step_time_s
    return {
        "orders_equal": orders_equal, "num_units": len(plan.units), "num_pipelines": plan.num_pipelines,
        "sliced_sequences": sum(1 for q, n in enumerate(plan.sequences)
                                if any(seg.seq == q and seg.end - seg.start < n for u in plan.units for seg in u.segments)),
        "units_with_context": sum(1 for u in plan.units if any(seg.start > 0 for seg in u.segments)),
        "packed_units": sum(1 for u in plan.units if len(u.segments) > 1),
        "checkpointed_layers": sum(sum(v.values()) for v in plan.checkpoint_layers.values()),
        "finer_levels": sum(sum(sum(lv.values()) for lv in v.values()) for v in plan.checkpoint_levels.values()),
        "simulated_step_s": sim.step_time_s, "measured_step_s": measured, "measured_spans_s": spans,
        "measured_step_wall_s": run["step_wall_s"], "relative_difference": rel, "within_tolerance": abs(rel) <= tol,
        "pooled_relative_difference": pooled, "per_step": per_step,
        "measured_work_replay_s": replayed,
        "background_cores": background, "simulated_on_free_cores_s": with_background,
        "machine_model_error": (replayed - measured) / measured,
        "cost_model_error": (sim.step_time_s - replayed) / replayed if replayed else None,
        **({"cpu_outside_actions_s": outside} if outside else {}),
        "simulated_bubble_fraction": sim.bubble_fraction, "measured_bubble_fraction": last.bubble_fraction(),
        "breakdown": breakdown(plan, cost, sim, timelines),
        "memory": mem, "memory_worst_relative_difference": mem_worst,
        "loss": run["losses"][-1],
        "speed_factor": cost.profile.meta.get("speed_factor"),
        **({"uncalibrated_simulated_step_s": (u := simulate(plan, uncalibrated).step_time_s),
            "uncalibrated_relative_difference": (u - measured) / measured} if uncalibrated is not None else {}),
    }
