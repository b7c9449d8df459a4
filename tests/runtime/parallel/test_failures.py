"""The status exchange that names the rank which failed first: published own errors, heartbeats
that tell a stopped rank, and lost-peer errors re-raised with the culprit (store in this process)."""
from __future__ import annotations

import socket
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")

from infinipipe_hf.runtime.parallel import failures  # noqa: E402


@pytest.fixture
def store(monkeypatch):
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=5))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setattr(failures, "_state", {"store": None, "tried": False, "beat": None, "me": None})
    yield master
    failures.stop_heartbeat()  # before the store goes away


def test_the_first_published_failure_is_what_every_peer_reads(store):
    assert failures.first_failure(wait_s=0.0) is None
    failures.publish_failure(ValueError("shard.safetensors is damaged"), rank=1)
    failures.publish_failure(RuntimeError("later"), rank=0)
    assert failures.first_failure() == "rank 1 failed first: ValueError: shard.safetensors is damaged"
    assert failures.explain([0, 1]).startswith("rank 1 failed first")


def test_a_restarted_job_does_not_read_the_previous_attempts_failures(store, monkeypatch):
    failures.publish_failure(ValueError("old"), rank=1)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setattr(failures, "_state", {"store": None, "tried": False, "beat": None, "me": None})
    assert failures.first_failure(wait_s=0.0) is None


def test_own_errors_are_published_and_peer_failures_name_the_culprit(store):
    with pytest.raises(KeyError):
        with failures.reporting_failures(1, [0, 1]):
            raise KeyError("boom in a callback")
    assert "rank 1 failed first: KeyError" in failures.first_failure()
    with pytest.raises(RuntimeError, match=r"rank 0: rank 1 failed first: KeyError.*this rank stopped "
                                           r"with RuntimeError: .*Connection closed by peer"):
        with failures.reporting_failures(0, [0, 1]):
            raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234")


def test_a_rank_whose_heartbeat_stands_still_is_named(store, monkeypatch):
    monkeypatch.setattr(failures, "STALL_WINDOW_S", 1.2)
    assert failures.start_heartbeat(rank=0)
    failures._store().add("beat/3", 5)  # rank 3 beat, then stopped
    assert failures.stalled_ranks([0, 3], window_s=1.2) == [3]
    text = failures.explain([3])
    assert text.startswith("rank 3 has stopped: its heartbeat stood still"), text


@pytest.mark.parametrize("exc, peer", [
    (RuntimeError("[gloo] Connection closed by peer"), True),
    (RuntimeError("step 3, p2p over ranks [0, 1] did not complete within 5 s"), True),
    (ValueError("did not complete"), False),  # a user's error, whatever its text
    (RuntimeError("CUDA out of memory"), False),
])
def test_peer_failures_are_told_from_own_errors(exc, peer):
    assert failures.is_peer_failure(exc) is peer


def test_without_a_store_errors_keep_their_own_text(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setattr(failures, "_state", {"store": None, "tried": False, "beat": None, "me": None})
    assert failures.explain([0, 1]) == "" and not failures.start_heartbeat()
    with pytest.raises(RuntimeError, match="^lost$"):
        with failures.reporting_failures(0, [0, 1]):
            raise RuntimeError("lost")
