"""The engine's overhead on CPU: a stage's actions through ``StageRunner`` against its layers' own time.

    python -m benchmarks.cpu.engine_overhead [--layers 4] [--repeat 5] [--out benchmarks/results/engine_overhead.json]

One middle stage of a small float32 Llama runs a step's units of every kind (a whole sequence, a
pack, the slices of a long sequence carrying K/V context, a hybrid) forward and backward in a valid
order, twice per round: through ``StageRunner.forward`` / ``backward`` (what a pipeline action
runs: unit tensors, context, rotary tables, the layers, the KV store's bookkeeping) and as the
same decoder layers called directly on prepared inputs (``run_decoder_layers`` with the unit's
tensors, context and rotary tables built beforehand, untimed).  The overhead of an action is the
first minus the second, as a share of the second; per unit kind and for the whole step.  Both
paths run in every round, interleaved, for two runner settings side by side: ``cached`` (each
sequence's ids and labels converted once per step, as the runtime does now) and ``per_unit``
(``StageRunner(cache_sequences=False)``: converted again for every unit, the earlier path).
The batch holds Python lists, as a trainer's collator hands them over.

Clock: the thread's CPU seconds with one intra-op thread, so the other work on a shared machine
is not counted; the load average is recorded beside the figures.  Reported: the median share
over rounds, the worst round, and the share of each action's fastest round on either path
(``fastest_share``: interference only ever adds time, so minima are the steadiest figure).  CUDA's own overheads (launch gaps, host synchronisation) are
not visible here: ``benchmarks/gpu/gpu_unit_profile.py --depths 1,3`` measures them on a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.lib.paths import RESULTS
from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Segment, Unit

MODEL = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 8,
         "num_key_value_heads": 4, "head_dim": 32, "vocab_size": 1024, "max_position_embeddings": 1 << 17,
         "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
# (kind, segments (seq, start, end)) of one step; sequence 2 is sliced, its last slice in a hybrid.
UNITS = (("whole", ((0, 0, 1024),)), ("pack", tuple((3 + i, 0, 128) for i in range(8))),
         ("slice", ((2, 0, 1024),)), ("slice", ((2, 1024, 2048),)),
         ("hybrid", ((2, 2048, 3072), (1, 0, 256), (11, 0, 256))))
LENGTHS = [1024, 256, 3072] + [128] * 8 + [256]
MODES = {"cached": True, "per_unit": False}


def step_plan(layers: int) -> Plan:
    """A 3-stage plan whose middle stage (``layers`` layers) runs ``UNITS`` forward, then backward
    in reverse (a sequence's slices last first)."""
    us = [Unit(i, tuple(Segment(*s) for s in segs)) for i, (_, segs) in enumerate(UNITS)]
    acts = [Action("F", u.id) for u in us] + [Action("B", u.id) for u in reversed(us)]
    return Plan("epp", 3, 1, list(LENGTHS), us, {0: [[], acts, []]}, {1: {u.id: 0 for u in us}},
                [1, layers, 1])


def build_model(layers: int, seed: int = 0):
    import transformers

    cfg = dict(MODEL)
    cfg.pop("model_type")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=layers + 2, **cfg))
    return model.float().eval()


def _timed(fn):
    t0 = time.thread_time()
    out = fn()
    return out, time.thread_time() - t0


class OverheadRun:
    """One stage, its plan and batch, and the inputs and output gradients of every unit."""

    def __init__(self, layers: int, cache_sequences: bool, seed: int = 0):
        from infinipipe_hf.runtime.stage.module import build_stage
        from infinipipe_hf.runtime.stage.runner import StageRunner

        self.plan = step_plan(layers)
        self.runner = StageRunner(build_stage(build_model(layers, seed), 1, range(1, 1 + layers)),
                                  cache_sequences=cache_sequences)
        g = torch.Generator().manual_seed(seed)
        self.batch = [{"input_ids": torch.randint(0, MODEL["vocab_size"], (n,), generator=g).tolist()}
                      for n in self.plan.sequences]
        h = self.runner.stage.hidden_size
        self.xs = {u.id: torch.randn(1, u.num_tokens, h, generator=g) for u in self.plan.units}
        self.grads = {u.id: torch.randn(1, u.num_tokens, h, generator=g) for u in self.plan.units}
        self.labels = max(sum(n - 1 for n in self.plan.sequences), 1)

    def _actions(self):
        return self.plan.stage_actions(0, 1)

    def through_runner(self) -> dict[str, float]:
        """CPU seconds of every action through ``StageRunner``."""
        r, out = self.runner, {}
        r.begin_step(self.plan, self.batch, self.labels)
        for a in self._actions():
            if a.is_forward:
                _, out[str(a)] = _timed(lambda: r.forward(a.unit, self.xs[a.unit]))
            else:
                _, out[str(a)] = _timed(lambda: r.backward(a.unit, self.grads[a.unit]))
        r.end_step()
        self._drop_grads()
        return out

    def layers_only(self) -> dict[str, float]:
        """CPU seconds of the same actions' decoder layers alone, on inputs prepared untimed."""
        from infinipipe_hf.runtime.recompute.layers import run_decoder_layers

        r, st, out, graphs = self.runner, self.runner.stage, {}, {}
        r.begin_step(self.plan, self.batch, self.labels)
        layers = st.decoder_layers()
        for a in self._actions():
            if a.is_forward:
                t = r.unit_tensors(a.unit)
                ctx = r._context(t)
                x = self.xs[a.unit].detach().requires_grad_(True)
                cos_sin = st.hf_model.model.rotary_emb(x, position_ids=t.position_ids)
                with torch.enable_grad():
                    graphs[a.unit], out[str(a)] = _timed(lambda: run_decoder_layers(
                        layers, x, num_checkpointed=0, position_ids=t.position_ids,
                        position_embeddings=cos_sin, unit_ctx=ctx))
            else:
                _, out[str(a)] = _timed(lambda: torch.autograd.backward(graphs.pop(a.unit), self.grads[a.unit]))
        r.end_step()
        self._drop_grads()
        return out

    def _drop_grads(self) -> None:
        for p in self.runner.stage.parameters():
            p.grad = None


def shares(runner_s: dict[str, float], layers_s: dict[str, float], plan: Plan) -> dict[str, float]:
    """Overhead (runner - layers) / layers, per unit kind (forward and backward together) and step."""
    kind_of = {u.id: kind for u, (kind, _) in zip(plan.units, UNITS)}
    per: dict[str, list[float]] = {}
    for label, t in runner_s.items():
        kind = kind_of[int(label[1:])]
        a, b = per.setdefault(kind, [0.0, 0.0]), per.setdefault("step", [0.0, 0.0])
        for acc in (a, b):
            acc[0] += t
            acc[1] += layers_s[label]
    return {k: (r - lay) / lay for k, (r, lay) in per.items()}


def run(layers: int, repeat: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    runs = {name: OverheadRun(layers, cached) for name, cached in MODES.items()}
    rounds: dict[str, list[dict]] = {name: [] for name in MODES}
    for i in range(warmup + repeat):
        for name, r in runs.items():  # interleaved: a slow phase of the machine hits both
            lay = r.layers_only()
            got = r.through_runner()
            if i >= warmup:
                rounds[name].append({"shares": shares(got, lay, r.plan), "runner_s": sum(got.values()),
                                     "layers_s": sum(lay.values()), "runner": got, "layers": lay})
    out = {}
    for name, rs in rounds.items():
        kinds = rs[0]["shares"].keys()
        fastest = [{a: min(x[path][a] for x in rs) for a in rs[0][path]} for path in ("runner", "layers")]
        out[name] = {"median_share": {k: statistics.median(x["shares"][k] for x in rs) for k in kinds},
                     "worst_share": {k: max(x["shares"][k] for x in rs) for k in kinds},
                     "fastest_share": shares(*fastest, runs[name].plan),
                     "step_runner_s": statistics.median(x["runner_s"] for x in rs),
                     "step_layers_s": statistics.median(x["layers_s"] for x in rs), "rounds": rs}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the timed middle stage")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default=str(RESULTS / "engine_overhead.json"))
    args = p.parse_args(argv)
    for flag, value, least in (("--layers", args.layers, 1), ("--repeat", args.repeat, 1), ("--warmup", args.warmup, 0)):
        if value < least:
            p.error(f"{flag} must be >= {least}, got {value}")
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    modes = run(args.layers, args.repeat, args.warmup)
    report = {"what": "(StageRunner action CPU seconds - the same decoder layers called directly) / the latter",
              "layers": args.layers, "model": MODEL, "units": [[k, [list(s) for s in segs]] for k, segs in UNITS],
              "sequence_lengths": LENGTHS, "repeat": args.repeat, "torch": torch.__version__,
              "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "elapsed_s": time.perf_counter() - t0, "modes": modes}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    for name, m in modes.items():
        print(f"{name:9s} step overhead median {m['median_share']['step']:+.2%} worst {m['worst_share']['step']:+.2%} "
              f"fastest {m['fastest_share']['step']:+.2%}  "
              + "  ".join(f"{k} {v:+.2%}" for k, v in m["median_share"].items() if k != "step"))
    print(f"load average {load_before} -> {report['load_average_after']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
