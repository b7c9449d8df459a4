"""Estimate, in the cost model only, what a whole-layer checkpoint that keeps the attention output would buy.

    python benchmarks/attention_kept_estimate.py [--model llama2-7b --pp 4] → benchmarks/results/attention_kept_estimate.json

Not a feature: the runtime has no such level.  It asks whether one is worth building.  Today a
checkpointed layer keeps its input and replays its whole forward in backward, the attention core
included; on long slices that core (the cost model's ``a1 * pairs`` term) is most of the replay.
A flash-style attention backward needs only q, k, v (cheap to rebuild from the layer input), the
output and the per-head logsumexp, so a layer that also keeps its attention output and logsumexp
(``hidden`` elements plus one float32 per head per token) can skip the core's forward on replay.

The estimate patches three cost-model functions in this process only: a whole layer's recompute
loses its pair term (``layer_fwd(0, tokens)`` less ``down_proj``, as before), and a checkpointed
layer keeps those extra bytes (the activation bytes and the solver's slope).  It then plans every
planner-benchmark batch with the default levels (``mlp``, ``mlp_act``, per-cell counts) at the
benchmark's budget, before and after, and reports simulated tokens/s, recompute and bubble shares.
Note that the patch *replaces* the whole-layer level (its memory saving shrinks a little), so a
batch that needed every byte of it may stop fitting; the real level would sit beside ``full``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from planner_bench import batches  # noqa: E402
from planner_tables.checkpoint_levels import _plan, _shares  # noqa: E402
from planner_tables.common import spec_of  # noqa: E402


@contextlib.contextmanager
def attention_kept():
    """The cost model with whole-layer checkpoints that keep the attention output (module docstring)."""
    from infinipipe_hf.planner import checkpoint_levels as cl
    from infinipipe_hf.planner import cost_model as cm

    saved = (cl.LevelCosts.layer_recompute_s, cm.CostModel.activation_bytes,
             cm.CostModel.activation_bytes_per_checkpointed_layer)
    recompute, act, slope = saved

    def kept_per_token(cost):
        return cost.hidden_bytes_per_token + 4.0 * cost.spec.num_attention_heads

    def layer_recompute_s(self, level, shape):
        if level != cl.FULL:
            return recompute(self, level, shape)
        tokens = self.cost.gpu_tokens(shape.tokens)
        linear = self._linear.token_s * tokens + self._linear.fixed_s
        return self.cost.layer_fwd(0, shape.tokens) - self.down_share * linear

    def activation_bytes(self, stage_index, tokens, checkpointed_layers):
        return (act(self, stage_index, tokens, checkpointed_layers)
                + self.gpu_tokens(tokens) * checkpointed_layers * kept_per_token(self))

    def activation_bytes_per_checkpointed_layer(self, stage_index, tokens):
        return slope(self, stage_index, tokens) - self.gpu_tokens(tokens) * kept_per_token(self)

    cl.LevelCosts.layer_recompute_s = layer_recompute_s
    cm.CostModel.activation_bytes = activation_bytes
    cm.CostModel.activation_bytes_per_checkpointed_layer = activation_bytes_per_checkpointed_layer
    try:
        yield
    finally:
        (cl.LevelCosts.layer_recompute_s, cm.CostModel.activation_bytes,
         cm.CostModel.activation_bytes_per_checkpointed_layer) = saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama2-7b")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--memory-gib", type=float, default=80.0)
    ap.add_argument("--out", default=str(HERE / "results" / "attention_kept_estimate.json"))
    args = ap.parse_args(argv)
    spec = spec_of(args.model)
    levels = dict(checkpoint_levels=("mlp", "mlp_act"), checkpoint_sharing="cell")
    rows, t0 = [], time.time()
    for name, lengths in batches(False).items():
        before, _ = _plan(lengths, spec, args.pp, args.memory_gib, None, **levels)
        with attention_kept():
            after, _ = _plan(lengths, spec, args.pp, args.memory_gib, None, **levels)
        row = {"batch": name, "before": _shares(before), "after": _shares(after)}
        rows.append(row)
        b, a = row["before"], row["after"]
        print(f"{name:<30} " + (f"tok/s {b['tokens_per_s'] / 1e3:.1f}K -> {a['tokens_per_s'] / 1e3:.1f}K, recompute "
                                f"share {b['recompute_share']:.3f} -> {a['recompute_share']:.3f}, bubble "
                                f"{b['bubble_share']:.3f} -> {a['bubble_share']:.3f}"
                                if b["feasible"] and a["feasible"] else
                                f"feasible before {b['feasible']}, after {a['feasible']}"), flush=True)
    out = {"what": "cost-model estimate: whole-layer checkpoints that keep the attention output (not in the runtime)",
           "model": args.model, "pp_degree": args.pp, "memory_budget_gib": args.memory_gib, "rows": rows,
           "elapsed_s": time.time() - t0, "command": "python benchmarks/attention_kept_estimate.py"}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
