# %% [markdown]
# # 03 - Memory and adaptive checkpointing
#
# Under 1F1B a stage holds the activations of every unit between its forward and its backward.
# With elastic units those windows differ per stage and per unit: the first stage holds the most
# units at once, a long sequence's slices all stay alive until its last slice's backward, and the
# KV store keeps the K/V of earlier slices. The **adaptive checkpoint solver** (paper Alg. 2)
# picks, per (stage, unit), how many decoder layers to checkpoint (recompute in the backward) so
# that every stage stays under its memory budget at every point of its timeline, with the least
# total recompute time.
#
# Here: a 128K-token batch of Python stdlib files, Llama-2-7B, pp 4, 80 GiB per GPU (H100 cost
# profile). We show the solver's choices as a heat map, then the memory of each stage over the
# step against the budget with no, uniform (the least one static count that fits, as Megatron or
# Seq1F1B would set it), adaptive and full checkpointing of the *same* units and schedule, and what
# each costs in recompute.

# %%
import random
import time

import matplotlib.pyplot as plt
import numpy as np

from infinipipe_hf.data.corpus import document_lengths
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.checkpointing.solver import solve_checkpointing
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.search.api import plan_step
from infinipipe_hf.planner.simulate.simulator import simulate

corpus = document_lengths("stdlib")  # SmolLM2 token counts, cached on disk after the first call
order = list(range(len(corpus)))
random.Random(0).shuffle(order)
batch = []
for i in order:
    if 0 < corpus[i] and sum(batch) + corpus[i] <= 128 * 1024:
        batch.append(corpus[i])
spec = ModelSpec.from_json_file(config_path("llama2-7b"))
PP, BUDGET = 4, 80 * GIB
cost = CostModel(spec, dims=ParallelDims(pp_degree=PP), memory_budget_bytes=BUDGET)
t0 = time.perf_counter()
result = plan_step(batch, spec, ParallelDims(pp_degree=PP), cost=cost)
plan = result.plan
print(f"{len(batch)} files, {sum(batch)} tokens, longest {max(batch)}: {len(plan.units)} units, "
      f"{plan.num_pipelines} pipeline(s), layers per stage {plan.layers_per_stage}, "
      f"planned in {time.perf_counter() - t0:.1f} s ({plan.info.get('checkpoint_method')})")

# %% [markdown]
# ## The solver's choices
#
# Rows are stages, columns units in forward order; the number is how many of the stage's layers
# are checkpointed for that unit. The solver's variables are shared along backward-order diagonals
# (recompute on one stage shows up as equal bubbles on the others: d_p - 1 + n variables instead of
# n * d_p), then every cell is checked against the stage's full memory timeline. The first units
# need nothing: few units are alive yet when they run.

# %%
unit_ids = [a.unit for a in plan.stage_actions(0, 0) if a.is_forward]
# Layers recomputed at any level: whole, keep_attn (whole but the attention core), mlp, mlp_act.
grid = np.array([[plan.checkpoint_mix(s, u).total for u in unit_ids] for s in range(PP)])
fig, ax = plt.subplots(figsize=(min(16, 1 + 0.5 * len(unit_ids)), 2.8))
im = ax.imshow(grid, cmap="magma_r", vmin=0, vmax=max(plan.layers_per_stage), aspect="auto")
for s in range(PP):
    for j in range(len(unit_ids)):
        ax.text(j, s, str(grid[s, j]), ha="center", va="center", fontsize=7,
                color="white" if grid[s, j] > max(plan.layers_per_stage) / 2 else "black")
ax.set_xticks(range(len(unit_ids)), [f"{u}\n{plan.unit_by_id[u].num_tokens // 1000}K" for u in unit_ids], fontsize=7)
ax.set_yticks(range(PP), [f"stage {s}" for s in range(PP)])
ax.set_xlabel("unit (tokens)")
fig.colorbar(im, ax=ax, label="checkpointed layers (any level)")
ax.set_title("adaptive checkpointing: layers recomputed per (stage, unit)")
plt.show()
print("checkpointed layer-forwards per stage:", grid.sum(axis=1).tolist(), "of",
      [n * len(unit_ids) for n in plan.layers_per_stage])

# %% [markdown]
# ## Memory per stage: none, uniform, adaptive, full
#
# Same units, same action lists; only the checkpoint counts change. The simulator replays each
# with the cost model and records every stage's memory at every action.

# %%
def with_policy(policy: str) -> Plan:
    p = Plan.from_dict(plan.to_dict())
    if policy != "adaptive":  # the adaptive counts (and finer levels) are the plan's own
        sol = solve_checkpointing(p, cost, policy=policy)
        p.checkpoint_layers, p.checkpoint_levels = sol.checkpoint_layers, sol.checkpoint_levels
    return p


policies = ("none", "uniform", "adaptive", "full")
sims = {name: simulate(with_policy(name), cost) for name in policies}
fig, axes = plt.subplots(1, len(policies), figsize=(16, 3.4), sharey=True)
for ax, name in zip(axes, policies):
    sim = sims[name]
    for s in range(PP):
        pts = sim.memory_timeline[(0, s)]
        ts = [t for t, _ in pts] + [sim.step_time_s]
        ys = [b / GIB for _, b in pts]
        ax.step(ts, ys + ys[-1:], where="post", label=f"stage {s}")
    ax.axhline(BUDGET / GIB, color="red", linestyle="--", linewidth=1, label="budget")
    ax.set_title(f"{name}: {'fits' if sim.feasible else 'OVER BUDGET'}")
    ax.set_xlabel("time (s)")
axes[0].set_ylabel("memory (GiB)")
axes[-1].legend(fontsize=7, loc="lower right")
plt.tight_layout()
plt.show()

# %%
print(f"{'policy':<9} {'fits':>5} {'step s':>7} {'recompute s':>12} {'tokens/s':>9}  peak GiB per stage")
for name in policies:
    sim = sims[name]
    print(f"{name:<9} {str(sim.feasible):>5} {sim.step_time_s:>7.3f} {sim.recompute_time_s:>12.3f} "
          f"{sim.tokens_per_s:>9,.0f}  {[round(b / GIB, 1) for b in sim.peak_memory_bytes]}")
assert not sims["none"].feasible and sims["adaptive"].feasible and sims["full"].feasible
assert sims["adaptive"].recompute_time_s <= sims["uniform"].recompute_time_s <= sims["full"].recompute_time_s

# %% [markdown]
# ## Recompute against the memory budget
#
# Keeping the plan fixed and re-solving for other budgets shows what adaptive checkpointing buys:
# the uniform setting must checkpoint every unit on every stage as much as the worst point needs,
# the adaptive one only where and when memory is short.

# %%
budgets = [64, 68, 72, 76, 80, 84, 88]
curves = {name: [] for name in ("uniform", "adaptive", "full")}
for gib in budgets:
    c = CostModel(spec, dims=ParallelDims(pp_degree=PP), layers_per_stage=plan.layers_per_stage, memory_budget_bytes=gib * GIB)
    for name in curves:
        sol = solve_checkpointing(plan, c, policy=name, time_limit_s=0.5)
        curves[name].append(sol.recompute_time_s if sol.feasible else np.nan)
fig, ax = plt.subplots(figsize=(7, 3.2))
for name, ys in curves.items():
    ax.plot(budgets, ys, marker="o", label=name)
ax.set_xlabel("memory budget per GPU (GiB)")
ax.set_ylabel("recompute time per step (s)")
ax.legend()
ax.grid(alpha=0.3)
plt.show()
for gib, u, a in zip(budgets, curves["uniform"], curves["adaptive"]):
    print(f"{gib} GiB: adaptive recomputes {a:.3f} s, uniform {u:.3f} s"
          + (f" ({u / a:.1f}x)" if a and a == a and u == u else ""))
