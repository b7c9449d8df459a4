# %% [markdown]
# # 02 - Units from real text
#
# What actually flows through the pipeline. We take real documents (an excerpt of a Shakespeare
# play, an excerpt of Genesis, and four whole Python standard-library files), tokenize them with
# SmolLM2's tokenizer, plan them, and look at what the unit builder
# (`infinipipe_hf.runtime.stage.unit_tensors.build_unit_tensors`) emits for a **slice**, a **hybrid** and
# a **packed** unit:
#
# - `input_ids` of the unit's segments, concatenated;
# - `position_ids` continuing from each segment's start (RoPE sees the unsplit positions);
# - `labels` shifted on the *whole* sequence before cutting: a slice's last token predicts the
#   next slice's first token; only a sequence's very last token has no target (-100);
# - the segment table (`cu_seqlens_q`, `cu_seqlens_k`: keys include each segment's context).
#
# Then we run the plan through the real SmolLM2-135M in one process and check that the sliced and
# packed units give the same loss as the unsplit model.

# %%
import time

import matplotlib.pyplot as plt
import torch

from infinipipe_hf.data.corpus import kjv_documents, load_tokenizer
from infinipipe_hf.data.long_tail import long_tailed_mix
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.units import UnitKind
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.models.model_configs import config_path
from infinipipe_hf.planner.search.api import PlanOptions, plan_step
from infinipipe_hf.runtime.stage.unit_tensors import build_unit_tensors

tok = load_tokenizer()
# A 128-token Shakespeare excerpt and whole stdlib files of at most 40 tokens...
docs = [(d.name, d.input_ids) for d in long_tailed_mix(tok, 256, long_tokens=128, num_long=1, max_doc_tokens=40)]
# ...plus the first 100 tokens of Genesis (EOS last, like the others).
genesis = tok(kjv_documents(max_docs=1)[0][1], add_special_tokens=False)["input_ids"][:99] + [tok.eos_token_id]
docs.append(("kjv:Genesis", genesis))
batch = [{"input_ids": ids} for _, ids in docs]
lengths = [len(ids) for _, ids in docs]
for i, (name, ids) in enumerate(docs):
    print(f"sequence {i}: {len(ids):>3} tokens  {name:<38} {tok.decode(ids[:12])!r}...")

# %% [markdown]
# ## The plan
#
# SmolLM2-135M's config at pp 2; the longest sequence is cut into 2 slices of equal time. Genesis
# is cut at the same absolute positions, so its remainder (the *tail slice*) is short and gets a
# short file packed next to it: a hybrid unit.

# %%
spec = ModelSpec.from_json_file(config_path("smollm2-135m"))
plan = plan_step(lengths, spec, ParallelDims(pp_degree=2), PlanOptions(num_slices=[2])).plan
print(plan)
kinds = {u.id: u.kind(lengths) for u in plan.units}
assert set(kinds.values()) == set(UnitKind), "this batch is chosen to give all three kinds"

# %% [markdown]
# Every token of every sequence is in exactly one segment, and each sequence's segments are in
# order, so concatenating them gives the documents back:

# %%
rebuilt = {i: [] for i in range(len(docs))}
for u in plan.units:
    for seg in u.segments:
        assert seg.start == len(rebuilt[seg.seq]), "segments of a sequence are consecutive"
        rebuilt[seg.seq] += docs[seg.seq][1][seg.start:seg.end]
assert all(rebuilt[i] == ids for i, (_, ids) in enumerate(docs))
print("all", sum(lengths), "tokens covered exactly once")

# %% [markdown]
# ## What the unit builder emits
#
# One table per unit kind: each row is a token of the unit; `target` is the label (the next token
# of the *whole* sequence). Segment boundaries are marked with a line.

# %%
def show(unit, rows_per_segment=4):
    t = build_unit_tensors(unit, batch)
    print(f"unit {unit.id} ({kinds[unit.id].value}): {t.num_tokens} tokens, "
          f"{t.num_label_tokens} targets, segments {[s.to_list() for s in t.segments]}")
    print(f"  cu_seqlens_q {t.cu_seqlens_q.tolist()}   cu_seqlens_k {t.cu_seqlens_k.tolist()}")
    print(f"  {'pos':>4} {'input_id':>8} {'token':<14} {'label':>6} {'target':<14}")
    start = 0
    for seg in t.segments:
        idx = list(range(start, start + seg.length))
        shown = idx if len(idx) <= 2 * rows_per_segment else idx[:rows_per_segment] + [None] + idx[-rows_per_segment:]
        print(f"  -- sequence {seg.seq} tokens [{seg.start}:{seg.end}) (context {seg.context})")
        for j in shown:
            if j is None:
                print("  ...")
                continue
            i, lab = int(t.input_ids[0, j]), int(t.labels[0, j])
            print(f"  {int(t.position_ids[0, j]):>4} {i:>8} {tok.decode([i])!r:<14} {lab:>6} "
                  f"{(tok.decode([lab]) if lab >= 0 else '(none)')!r:<14}")
        start += seg.length
    return t


# The first unit of each kind (for packed units: the one holding the most sequences).
first_of = {k: max((u for u in plan.units if kinds[u.id] is k), key=lambda u: (len(u.segments), -u.id))
            for k in UnitKind}
slice_t = show(first_of[UnitKind.SLICE])

# %% [markdown]
# The first slice of sequence 0 ends at its first cut; its last label is the first token of the
# next slice, not -100: the loss over slices equals the loss over the whole sequence.

# %%
seq0_units = [u for u in plan.units if 0 in u.seqs]
second = build_unit_tensors(seq0_units[1], batch)
assert int(slice_t.labels[0, -1]) == int(second.input_ids[0, 0])
assert int(second.position_ids[0, 0]) == seq0_units[1].segments[0].start
print("slice 1's last target", int(slice_t.labels[0, -1]), "== slice 2's first input",
      int(second.input_ids[0, 0]), "; slice 2 starts at position", int(second.position_ids[0, 0]))
hybrid_t = show(first_of[UnitKind.HYBRID])

# %%
packed_t = show(first_of[UnitKind.PACKED])
ends = packed_t.cu_seqlens_q[1:].tolist()
assert all(int(packed_t.labels[0, e - 1]) == -100 for e in ends), "each whole sequence's last token has no target"
assert all(int(packed_t.position_ids[0, s]) == 0 for s in packed_t.cu_seqlens_q[:-1].tolist())

# %% [markdown]
# ## The attention mask of the hybrid unit
#
# Queries are the unit's own tokens; the keys of each segment are its context (K/V of the earlier
# slices, read from the stage's KV store) followed by its own tokens. The mask is causal aligned to
# the **lower right** for a slice, and packed sequences never see each other.

# %%
from infinipipe_hf.runtime.attention.types import segment_mask

segs = hybrid_t.segments
cols = sum(s.end for s in segs)
mask = torch.zeros(hybrid_t.num_tokens, cols)
q0, k0 = 0, 0
for s in segs:
    mask[q0:q0 + s.length, k0:k0 + s.end] = segment_mask(s.length, s.context, None, "cpu").float()
    q0, k0 = q0 + s.length, k0 + s.end
fig, ax = plt.subplots(figsize=(9, 3))
ax.imshow(mask, cmap="Greys", aspect="auto", interpolation="nearest")
k0 = 0
for s in segs:
    if s.context:
        ax.axvspan(k0 - 0.5, k0 + s.context - 0.5, color="tab:blue", alpha=0.15)
    k0 += s.end
    ax.axvline(k0 - 0.5, color="tab:red", linewidth=0.8)
ax.set_xlabel("keys (blue: context from the KV store)")
ax.set_ylabel("queries")
ax.set_title(f"hybrid unit {first_of[UnitKind.HYBRID].id}: segments {[s.to_list() for s in segs]}")
plt.show()

# %% [markdown]
# ## Same loss as the unsplit model
#
# The real SmolLM2-135M: the plan runs in one process (`run_plan_locally`: both stages in memory,
# tensors passed directly, the same stage runner and KV store as the multi-process runtime),
# against the plain HF model on the unsplit documents.

# %%
import copy

import transformers

from infinipipe_hf.ir.partition import partition_layers
from infinipipe_hf.models.smollm2 import load_smollm2
from infinipipe_hf.runtime.stage.local import run_plan_locally
from infinipipe_hf.runtime.stage.module import build_stage

transformers.utils.logging.disable_progress_bar()
t0 = time.perf_counter()
model, _ = load_smollm2()
with torch.no_grad():  # reference: sum of token losses over every document / number of targets
    total = sum(model(input_ids=torch.tensor([ids]), labels=torch.tensor([ids])).loss.item() * (len(ids) - 1)
                for _, ids in docs)
reference = total / sum(n - 1 for n in lengths)
ranges = partition_layers(spec.num_layers, 2, layer_split=plan.layers_per_stage)
stages = [build_stage(copy.deepcopy(model), s, r) for s, r in enumerate(ranges)]
pipelined = run_plan_locally(stages, plan, batch)
print(f"unsplit model: {reference:.6f}   pipelined units: {pipelined:.6f}   "
      f"({time.perf_counter() - t0:.0f} s)")
assert abs(pipelined - reference) < 1e-4 * reference
