"""State bytes per rank (``planner/cost/states.py``) against a real HF model's parameters and
torch's dim-0 chunking, which FSDP2 uses to shard."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.cost.states import FP32_ADAM, stage_state_bytes_per_rank

# Odd sizes so that sharding over 2 or 4 pads some rows.
CONFIG = dict(vocab_size=101, hidden_size=36, intermediate_size=75, num_hidden_layers=4,
              num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=False)


def _stage_params(model, first, last, layers):
    params = [p for i in layers for p in model.model.layers[i].parameters()]
    if first:
        params.append(model.model.embed_tokens.weight)
    if last:
        params += [model.model.norm.weight, model.lm_head.weight]
    return params


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG))


@pytest.mark.parametrize("shard", [1, 2, 4])
@pytest.mark.parametrize("first, last, layers", [(True, False, [0, 1]), (False, False, [2]), (False, True, [2, 3])])
def test_state_bytes_match_torch_chunks_of_the_real_stage(model, shard, first, last, layers):
    spec = ModelSpec.from_hf_config(model.config)
    params = _stage_params(model, first, last, layers)
    # FSDP2 splits dim 0 like torch.chunk and pads every rank to the first chunk's size.
    per_rank = sum(torch.chunk(p.detach(), shard, dim=0)[0].numel() for p in params)
    got = stage_state_bytes_per_rank(spec, len(layers), embedding=first, head=last, shard_degree=shard)
    assert got == per_rank * 16  # fp32 weights, gradients and two Adam moments
    if shard == 1:
        assert got == sum(p.numel() for p in params) * 16


def test_tied_head_on_one_stage_is_the_embedding():
    tied = LlamaForCausalLM(LlamaConfig(**{**CONFIG, "tie_word_embeddings": True}))
    spec = ModelSpec.from_hf_config(tied.config)
    n = sum(p.numel() for p in tied.parameters())  # parameters() lists the tied matrix once
    assert stage_state_bytes_per_rank(spec, 4, embedding=True, head=True, head_is_embedding=True) == 16 * n


def test_shard_over_replicas_holds_whole_weights_during_the_step(model):
    """``dp``/``sp+dp``: the runtime gathers every FSDP unit once per step (replicas run different
    units, so per-unit gathers would not line up): the whole stage's weights, in the compute
    dtype, are alive during the step, and the gathers are paid once, not per action."""
    spec = ModelSpec.from_config_dict({**CONFIG, "model_type": "llama"})
    per_unit = CostModel(spec, dims=ParallelDims(pp_degree=2, sp_degree=2, shard="sp"), state_precision=FP32_ADAM)
    per_step = CostModel(spec, dims=ParallelDims(pp_degree=2, dp_degree=2, shard="dp"), state_precision=FP32_ADAM)
    assert not per_unit.states.gathers_per_step and per_step.states.gathers_per_step
    for s in range(2):
        params = _stage_params(model, s == 0, s == 1, range(*(
            (0, per_step.layers_per_stage[0]) if s == 0 else (per_step.layers_per_stage[0], 4))))
        numel = sum(p.numel() for p in params)
        shard = sum(torch.chunk(p.detach(), 2)[0].numel() for p in params)  # FSDP2's dim-0 chunks
        # kept shards (weights + Adam moments) + whole fp32 gradient + whole fp32 weight copy
        want = shard * (16 - 4) + numel * 4 + numel * 4
        assert per_step.states.peak_static_bytes(s) == want
        # actions pay no gathers; the step pays all of them once
        assert per_step.states.overlapped(s, 1.0) == 1.0
        assert per_step.states.gradient_sync_time(s, 0.0) >= sum(per_step.states.gather_s[s])
        assert per_unit.states.overlapped(s, 1.0) > 1.0
