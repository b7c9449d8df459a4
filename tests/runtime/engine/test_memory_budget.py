"""The engine's default memory budget on CUDA: the device's memory less the margin and reserve.

Runs on CPU with ``torch.cuda.get_device_properties`` stood in, so the arithmetic and the names
the GPU tests call are checked before a lease is spent on them."""
import types

import pytest
import torch

from infinipipe_hf import InfiniPipeConfig
from infinipipe_hf.runtime.engine import planning
from infinipipe_hf.runtime.engine.planning import memory_budget_bytes


def test_cuda_budget_is_total_less_margin_and_reserve(monkeypatch):
    total = 80 * 2**30
    monkeypatch.setattr(planning.torch.cuda, "get_device_properties",
                        lambda device: types.SimpleNamespace(total_memory=total))
    cfg = InfiniPipeConfig(memory_margin=0.1, memory_reserve_gib=1.0)
    assert memory_budget_bytes(cfg, torch.device("cuda", 0)) == pytest.approx(total * 0.9 - 2**30)


def test_explicit_budget_wins_and_cpu_is_unlimited():
    assert memory_budget_bytes(InfiniPipeConfig(memory_budget_gib=3.0), torch.device("cuda", 0)) == 3 * 2**30
    assert memory_budget_bytes(InfiniPipeConfig(), torch.device("cpu")) is None


def test_gpu_engine_tests_run_on_cpu(monkeypatch):
    """The CUDA engine tests' logic (fp32 steps against the unsplit model) with the device set to CPU."""
    from tests.gpu import test_engine_cuda as gpu_tests

    monkeypatch.setattr(gpu_tests, "DEVICE", "cpu")
    gpu_tests.test_fp32_training_steps_match_unsplit_model("full")
