"""The chunked loss's logits in the memory model (``StageActivations.loss_chunk_bytes``) against
the allocator's events of the runtime's own loss (``runtime/stage/loss.py``): forward and backward
each hold a chunk's logits in the model's dtype and one ``LOSS_BLOCK_ROWS`` block in float32.
Everything else the loss allocates is hidden-sized (the labelled tokens' copy, the input's
gradient) or one head-gradient temporary, kept small here by a narrow hidden size, so the measured
peak is the logits' bytes within a few percent."""
from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from torch import nn

from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.layout import ParallelDims
from infinipipe_hf.planner.cost import activations
from infinipipe_hf.planner.cost.model import CostModel
from infinipipe_hf.planner.cost.profile import default_profile
from infinipipe_hf.profiling.memory_events import MemoryProbe
from infinipipe_hf.runtime.stage import loss as runtime_loss
from infinipipe_hf.runtime.stage.loss import chunked_lm_loss

HIDDEN, VOCAB = 32, 4096
SPEC = ModelSpec(model_type="llama", num_layers=2, hidden_size=HIDDEN, intermediate_size=64,
                 num_attention_heads=4, num_key_value_heads=4, head_dim=8, vocab_size=VOCAB,
                 tie_word_embeddings=False)


def _measured_peaks(tokens: int, chunk: int, dtype: torch.dtype) -> tuple[int, int]:
    torch.manual_seed(0)
    head = nn.Linear(HIDDEN, VOCAB, bias=False).to(dtype)
    head.weight.grad = torch.zeros_like(head.weight)  # the stage's gradients exist after its first backward
    hidden = torch.randn(1, tokens, HIDDEN, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, VOCAB, (1, tokens))
    gc.collect()
    with MemoryProbe() as forward:
        loss = chunked_lm_loss(head, hidden, labels, tokens, chunk)
    with MemoryProbe() as backward:
        loss.backward()
    return forward.trace.peak_bytes, backward.trace.peak_bytes


def test_the_block_rows_are_the_runtimes():
    assert activations.LOSS_BLOCK_ROWS == runtime_loss.LOSS_BLOCK_ROWS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, chunk", [(256, 1024), (512, 256), (3000, 2048), (4096, 4096)])
def test_loss_chunk_bytes_are_the_measured_peak(dtype, tokens, chunk):
    profile = dataclasses.replace(default_profile(), bytes_per_element=torch.finfo(dtype).bits // 8)
    acts = CostModel(SPEC, profile, ParallelDims(pp_degree=1), loss_chunk_tokens=chunk).acts
    predicted = acts.loss_chunk_bytes(tokens)
    for phase, measured in zip(("forward", "backward"), _measured_peaks(tokens, chunk, dtype)):
        assert 0.99 * predicted <= measured <= 1.1 * predicted, (phase, predicted, measured)

