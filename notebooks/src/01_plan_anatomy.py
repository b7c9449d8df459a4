# %% [markdown]
# # 01 - Anatomy of a plan
#
# A step of elastic pipeline parallelism (EPP) is decided before it runs, as **plain data**: the
# units (which token ranges of which sequences go through the pipeline together), the action list
# of every stage (`F<unit>` / `B<unit>`), and the number of checkpointed decoder layers per
# (stage, unit). This notebook
#
# 1. prints a small plan, its action strings and its JSON form;
# 2. corrupts it in three ways and lets the validator catch each, with the stage-by-time grid and
#    the failing action marked;
# 3. plans a real long-tailed batch (Python standard-library files, SmolLM2 token counts) for a
#    Llama-2-7B at pp 4 with 80 GiB per GPU under EPP and the three baselines, and draws their
#    Gantt charts and the table of simulated tokens/s.
#
# Everything here is the pure planner: no torch, no processes. Times come from the shipped H100
# cost profile, so they describe an H100, not this machine.

# %%
import random
import tempfile
import time
from pathlib import Path

from IPython.display import Image, display

from infinipipe_hf.ir.actions import Action, format_actions, parse_actions
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.cost.model import GIB, CostModel
from infinipipe_hf.planner.registry import PIPELINE_SCHEDULES as SCHEDULES
from infinipipe_hf.planner.search.api import PlanOptions, plan_step
from infinipipe_hf.planner.validate.validator import PlanValidationError, validate

spec = ModelSpec.from_json_file(config_path("llama2-7b"))
PP, BUDGET = 4, 80 * GIB
print(f"Llama-2-7B: {spec.num_layers} layers, hidden {spec.hidden_size}, vocab {spec.vocab_size}")

# %% [markdown]
# ## A small plan
#
# Seven sequences: one of 24K tokens, one of 9K, five short ones. The planner cuts the longest into
# slices of equal *time* (later slices are shorter: they attend to more context), cuts the 9K one at
# the same positions, and packs the short sequences with the 9K one's tail slice (a *hybrid* unit)
# or together (*packed*).

# %%
lengths = [24000, 9000, 3000, 2500, 900, 400, 300]
result = plan_step(lengths, spec, ParallelDims(pp_degree=PP), PlanOptions(memory_budget_bytes=BUDGET))
plan = result.plan
print(plan)
print()
for u in plan.units:
    print(f"unit {u.id:>2}: {u.kind(plan.sequences).value:<6} {u.num_tokens:>5} tokens  "
          f"segments {[s.to_list() for s in u.segments]}")

# %% [markdown]
# `(cN)` after a forward means N of that stage's layers are checkpointed for that unit (recomputed
# in its backward). Backwards of a sequence's slices run last slice first: K/V gradients flow from
# later slices back to earlier ones. The action strings round-trip, and so does the whole plan:

# %%
stage0 = plan.stage_actions(0, 0)
text = format_actions(stage0)
assert parse_actions(text) == stage0 and Action.parse("B7") == Action("B", 7)
print("stage 0:", text)
restored = Plan.from_json(plan.to_json())
assert restored.to_dict() == plan.to_dict()
d = plan.to_dict()
print({k: d[k] for k in ("schedule", "pp_degree", "dp_degree", "sequences")})
print("units[10]:", d["units"][10])
print("checkpoint_layers of stage 0:", d["checkpoint_layers"]["0"])
s = result.summary()
print(f"simulated: {s['step_time_s'] * 1e3:.0f} ms per step, {s['tokens_per_s']:,.0f} tokens/s, "
      f"bubbles {s['bubble_fraction']:.1%}, peak memory per stage "
      f"{[round(b / GIB, 1) for b in s['peak_memory_bytes']]} GiB of {BUDGET / GIB:.0f}")

# %% [markdown]
# ## The validator catches corrupted plans
#
# Every plan is validated before it runs; a bad one is an error that prints the rank-by-time grid
# with the failing action marked `[..]!`, never a hang. Three corruptions of the plan above:

# %%
cost = CostModel(spec, dims=ParallelDims(pp_degree=PP), layers_per_stage=plan.layers_per_stage, memory_budget_bytes=BUDGET)
validate(plan, cost)  # the original passes


def corrupted(change) -> Plan:
    bad = Plan.from_dict(plan.to_dict())
    change(bad)
    return bad


slices = [u.id for u in plan.units if 0 in u.seqs]  # the units holding sequence 0's slices
print("sequence 0 runs as units", slices)


def drop_forward(p):  # stage 1 loses the forward of the second slice
    p.actions[0][1].remove(Action("F", slices[1]))


def wrong_slice_order(p):  # the last stage runs the first slice's backward before the last one's
    acts = p.actions[0][PP - 1]
    i, j = acts.index(Action("B", slices[0])), acts.index(Action("B", slices[-1]))
    acts[i], acts[j] = acts[j], acts[i]


def no_checkpointing(p):  # memory: the same units with nothing recomputed
    p.checkpoint_layers = {s: {u: 0 for u in per_unit} for s, per_unit in p.checkpoint_layers.items()}
    p.checkpoint_levels = {}  # and no finer level (keep_attn, mlp, mlp_act) either


caught = 0
for change in (drop_forward, wrong_slice_order, no_checkpointing):
    try:
        validate(corrupted(change), cost)
        print(f"{change.__name__}: accepted")
    except PlanValidationError as err:
        caught += 1
        print(f"--- {change.__name__}\n{err.problem}\n{err.grid}\n")
assert caught == 3, "every corruption must be rejected"

# %% [markdown]
# ## A real long-tailed batch: EPP against the baselines
#
# The token counts of the Python standard library's source files (SmolLM2 tokenizer; computed once,
# then cached on disk) are long-tailed like web and code data. We draw files in a fixed random order
# until a 128K-token global batch is full.

# %%
from infinipipe_hf.data.corpus import document_lengths

t0 = time.perf_counter()
corpus = document_lengths("stdlib")
print(f"{len(corpus)} stdlib files in {time.perf_counter() - t0:.1f} s: median "
      f"{sorted(corpus)[len(corpus) // 2]} tokens, max {max(corpus)}")
order = list(range(len(corpus)))
random.Random(0).shuffle(order)
batch, budget = [], 128 * 1024
for i in order:
    if 0 < corpus[i] and sum(batch) + corpus[i] <= budget:  # empty __init__.py files have no tokens
        batch.append(corpus[i])
top = sorted(batch)[-max(1, len(batch) // 10):]
print(f"batch: {len(batch)} files, {sum(batch)} tokens, longest {max(batch)}; the longest 10% hold "
      f"{sum(top) / sum(batch):.0%} of the tokens")

# %%
from infinipipe_hf.cli.plan import format_table
from infinipipe_hf.cli.viz import plot_plan

cost = CostModel(spec, dims=ParallelDims(pp_degree=PP), memory_budget_bytes=BUDGET)
results = [plan_step(batch, spec, ParallelDims(pp_degree=PP), PlanOptions(schedule=name), cost=cost) for name in SCHEDULES]
print(format_table(results))

# %% [markdown]
# - **epp**: long files are cut into equal-time slices, short ones packed around tail slices, the
#   checkpoint solver picks per-(stage, unit) recompute;
# - **packed-1f1b**: batch-level packing into equal-length micro-batches (Megatron / DeepSpeed
#   style), one static checkpoint setting;
# - **seq1f1b**: every packed micro-batch cut into the same number of slices across document
#   boundaries, of equal layer time (Seq1F1B's computation-wise split) or of equal tokens,
#   whichever plans faster;
# - **gpipe**: all forwards, then all backwards.
#
# The Gantt charts (forwards blue, backwards orange, a sequence's slices share a shade; recompute
# hatched; below, each stage's memory against the 80 GiB budget):

# %%
out = Path(tempfile.mkdtemp(prefix="plan_anatomy_"))
for r in results:
    if not r.feasible:
        print(f"{r.schedule}: infeasible ({r.error})")
        continue
    png = out / f"{r.schedule}.png"
    plot_plan(r.plan, r.simulation, str(png), title=f"{r.schedule}: Llama-2-7B, pp={PP}, 80 GiB, "
                                                    f"{len(batch)} stdlib files")
    display(Image(filename=str(png), width=900))

# %% [markdown]
# The same comparison as a table, computed from the simulations above:

# %%
best_baseline = max(r.summary()["tokens_per_s"] for r in results if r.schedule != "epp")
print(f"{'schedule':<12} {'tokens/s':>10} {'vs EPP':>7} {'bubbles':>8} {'recompute s':>12} {'units':>6}")
for r in results:
    s = r.summary()
    ratio = s["tokens_per_s"] / results[0].summary()["tokens_per_s"]
    print(f"{r.schedule:<12} {s['tokens_per_s']:>10,.0f} {ratio:>7.2f} "
          f"{s['bubble_fraction'] if s['bubble_fraction'] is not None else float('nan'):>8.1%} "
          f"{s['recompute_time_s'] or 0:>12.3f} {s['num_units']:>6}")
print(f"EPP / best baseline: {results[0].summary()['tokens_per_s'] / best_baseline:.2f}x")
