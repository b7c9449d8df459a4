"""The planner's host bytes of offloaded optimizer states (``cost.state_host``) against what
``HostOptimizer`` holds on the host after a step, on CPU, for whole models and pipeline stages
(float64 states priced at 8 bytes per element: master, gradient buffer, two moments)."""
import pytest
import torch

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.partition import partition_layers
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.cost.states import StatePrecision
from infinipipe_hf.runtime.offload.host_optimizer import HostOptimizer
from infinipipe_hf.runtime.stage.module import build_stage
from tests.helpers.reference import tiny_model

FP64_ADAMW = StatePrecision(state_bytes_per_param=32, grad_bytes_per_param=8, compute_bytes_per_param=8,
                            reduce_bytes_per_param=8, optimizer_bytes_per_param=16)


@pytest.mark.parametrize("pp, tie", [(1, False), (2, False), (2, True)])
def test_host_optimizer_bytes_match_the_cost_model(pp, tie):
    model = tiny_model("llama", num_layers=4, tie=tie, vocab=500, hidden=64)
    spec = ModelSpec.from_hf_config(model.config)
    ranges = partition_layers(4, pp)
    cost = CostModel(spec, None, ParallelDims(pp_degree=pp, state_offload="optimizer"),
                     layers_per_stage=[len(r) for r in ranges], state_precision=FP64_ADAMW,
                     host_budget_bytes=2.0**40)
    for s, r in enumerate(ranges):
        stage = build_stage(tiny_model("llama", num_layers=4, tie=tie, vocab=500, hidden=64), s, r)
        opt = HostOptimizer(torch.optim.AdamW(stage.parameters()))
        for p in stage.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        got, want = opt.host_bytes(), cost.state_host.host_bytes(s)
        print(f"pp {pp} stage {s}: measured {got} B, predicted {want:.0f} B")
        assert abs(got - want) <= 0.05 * want, f"stage {s}: measured {got} B, predicted {want:.0f} B"
