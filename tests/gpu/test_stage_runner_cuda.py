"""The local pipeline on CUDA: float64 exact against the unsplit model, bf16 close."""
import copy

import pytest
import torch

from infinipipe_hf.runtime.stage.local import run_plan_locally
from tests.helpers.local_pipeline import LENGTHS, NUM_LAYERS, build_stages, collect_grads, make_plan
from tests.helpers.reference import assert_grads_close, random_batch, reference_loss_and_grads, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("ckpt", ["none", "some"])
def test_cuda_float64_exact(ckpt):
    """Against the unsplit model on the same CUDA device (a CPU reference differs by ~3e-10:
    HF's float32 rotary tables round differently on CPU and CUDA)."""
    model = tiny_model("llama", num_layers=NUM_LAYERS, seed=11)
    batch = random_batch(LENGTHS, seed=11, with_labels=True)
    ref_loss, ref = reference_loss_and_grads(copy.deepcopy(model).to("cuda"), batch)
    stages = [st.to("cuda") for st in build_stages(model, 2)]
    loss = run_plan_locally(stages, make_plan(2, "1f1b", ckpt), batch, loss_chunk_tokens=4)
    assert loss == pytest.approx(ref_loss, rel=1e-10)
    got = {n: g.cpu() for n, g in collect_grads(stages, False).items()}
    assert_grads_close(got, {n: g.cpu() for n, g in ref.items()}, rtol=1e-9)


def test_cuda_bfloat16_runs():
    model = tiny_model("qwen2", num_layers=NUM_LAYERS, seed=12)
    batch = random_batch(LENGTHS, seed=12)
    ref_loss, _ = reference_loss_and_grads(model, batch)
    stages = [st.to(device="cuda", dtype=torch.bfloat16) for st in build_stages(model, 2)]
    loss = run_plan_locally(stages, make_plan(2), batch)
    assert loss == pytest.approx(ref_loss, rel=2e-2)
