"""The host step's thread count: the cores over the local ranks, restored after the step."""
import torch

from infinipipe_hf.runtime.offload.host_optimizer import host_step_threads, host_threads


def test_threads_divide_the_cores_among_local_ranks(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert host_step_threads() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert host_step_threads() == 1


def test_thread_count_is_restored(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr("infinipipe_hf.runtime.offload.host_optimizer.host_step_threads", lambda: before + 1)
    with host_threads(True):
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before
    with host_threads(False):
        assert torch.get_num_threads() == before
