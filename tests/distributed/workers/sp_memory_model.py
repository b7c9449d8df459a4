"""The planner's per-GPU memory model at sp 2 against the bytes each SP rank really saves (gloo).

``sp_memory_model.py`` on 2 ranks.  Each rank runs units through its ``PipelineEngine``'s SP
runner (sp 2, pp 1, float32, the Llama shape of ``sp_memory.py``): a 1024-token sequence as two
512-token slices (the second attends to the first's K/V), at several checkpoint mixes (whole
layers and the levels inside a layer).  While each slice's forward runs, ``saved_tensors_hooks``
record the distinct storages autograd keeps (parameters excluded; a checkpoint region counts the
inputs it keeps: whole layers and both MLP levels go through ``checkpoint`` calls that are
wrapped).  The prediction is ``CostModel(..., sp_degree=2).levels.unit_activation_bytes`` with a
float32 profile whose per-token figure is the cost model's own formula (as in
``tests/runtime/test_memory_model_vs_runtime.py``): the formula against the runtime, per rank.  The
KV store after the first slice is compared with ``StageActivations.kv_bytes`` (K/V and, once backward
ran, their gradients: here the forward has run, so half of it).  Prints ``MODEL <json>`` per case
and ``ALL OK``.
"""
from __future__ import annotations

import copy
import dataclasses
import json

from common import InfiniPipeConfig, PipelineEngine, dist, init, log, saved_bytes, torch
from sp_memory import VOCAB, T, model

from benchmarks.lib.runtime_fit import reference_of
from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.levels import CheckpointMix
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.activations import act_elements
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.cost.profile import default_profile

MIXES = [(0, 0, 0), (2, 0, 0), (4, 0, 0), (0, 4, 0), (0, 0, 4), (1, 1, 2), (0, 0, 0, 4), (1, 1, 0, 2)]


def cost_model(spec: ModelSpec) -> CostModel:
    fp32 = dataclasses.replace(default_profile(), name="fp32-formula", reference=reference_of(spec),
                               bytes_per_element=4, attention_mask_bytes_per_element=4.0,
                               activation_bytes_per_token_per_layer=act_elements(
                                   spec.hidden_size, spec.intermediate_size, spec.kv_dim, 4) * 4.0)
    return CostModel(spec, fp32, ParallelDims(pp_degree=1, sp_degree=2), layers_per_stage=[spec.num_layers])


def main() -> None:
    init()
    g = torch.Generator().manual_seed(1)
    batch = [{"input_ids": torch.randint(0, VOCAB, (2 * T,), generator=g).tolist()}]
    base = model()
    spec = ModelSpec.from_hf_config(base.config)
    cost = cost_model(spec)
    engine = PipelineEngine(copy.deepcopy(base), InfiniPipeConfig(sp_degree=2, loss_chunk_tokens=128,
                                                                  p2p_timeout_s=120))
    runner = engine.runner
    params = list(runner.stage.parameters())
    units = [Unit(0, (Segment(0, 0, T),)), Unit(1, (Segment(0, T, 2 * T),))]
    acts = [Action("F", 0), Action("F", 1), Action("B", 1), Action("B", 0)]
    for mix in map(lambda m: CheckpointMix(*m), MIXES):
        plan = Plan("epp", 1, 1, [2 * T], units, {0: [acts]}, {0: {0: mix.full, 1: mix.full}}, [4],
                    checkpoint_levels={0: {0: mix.finer, 1: mix.finer}} if mix.finer else {}, sp_degree=2)
        runner.begin_step(plan, batch, 2 * T - 1)
        first = saved_bytes(lambda: runner.forward(0, None), params)
        kv = runner.kv_store.bytes()
        second = saved_bytes(lambda: runner.forward(1, None), params)
        runner.backward(1, None)
        runner.backward(0, None)
        runner.end_step()
        row = {"mix": [mix.full, mix.mlp, mix.mlp_act, mix.keep_attn],
               "first_slice": {"measured": first, "model": cost.levels.unit_activation_bytes(0, units[0].segments, mix)},
               "second_slice": {"measured": second,
                                "model": cost.levels.unit_activation_bytes(0, units[1].segments, mix)},
               "kv_store": {"measured": kv, "model": cost.acts.kv_bytes(0, T) / 2}}
        log("MODEL " + json.dumps(row))
    dist.barrier()
    log("ALL OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
