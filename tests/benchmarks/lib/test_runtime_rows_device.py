"""The device option of ``benchmarks/lib/runtime_rows.py`` and its clock (``benchmarks/lib/row_clock.py``):
on CPU the rows draw the same inputs and report thread CPU seconds as before; on CUDA the clock
synchronises the device around each call and reports wall seconds; ``device=`` / ``dtype=`` move
the model and the inputs follow its dtype."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from benchmarks.lib import row_clock  # noqa: E402
from benchmarks.lib.row_clock import RowClock  # noqa: E402
from benchmarks.lib.runtime_rows import (  # noqa: E402
    UnitCase,
    _Sampler,
    measure_embedding_rows,
    measure_loss_rows,
    measure_unit_rows,
)


def _tiny_model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return transformers.LlamaForCausalLM(cfg).float()


def test_cpu_clock_reports_thread_cpu_seconds_and_never_synchronises(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("synchronised on CPU"))
    ticks = iter([1.0, 10.0, 10.25, 1.5, 2.0, 20.0, 20.5, 4.0, 3.0, 30.0, 31.0, 3.1])  # cpu0 wall0 wall1 cpu1
    monkeypatch.setattr(row_clock.time, "thread_time", lambda: next(ticks))
    monkeypatch.setattr(row_clock.time, "perf_counter", lambda: next(ticks))
    clock = RowClock("cpu")
    assert [clock.run(lambda i=i: i) for i in range(3)] == [0, 1, 2]
    assert clock.cpu == pytest.approx([0.5, 2.0, 0.1]) and clock.wall == pytest.approx([0.25, 0.5, 1.0])
    assert clock.seconds() == pytest.approx(0.5) and clock.wall_seconds() == pytest.approx(0.5)


def test_cuda_clock_synchronises_around_each_call_and_reports_wall_seconds(monkeypatch):
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", str(device))))
    ticks = iter([0.0, 100.0, 100.003, 0.001])
    monkeypatch.setattr(row_clock.time, "thread_time", lambda: next(ticks))
    monkeypatch.setattr(row_clock.time, "perf_counter", lambda: next(ticks))
    clock = RowClock(torch.device("cuda", 0))
    assert clock.run(lambda: events.append("call") or 7) == 7
    assert events == [("sync", "cuda:0"), "call", ("sync", "cuda:0")]
    assert clock.seconds() == pytest.approx(0.003) and clock.cpu == pytest.approx([0.001])


def test_cpu_inputs_are_the_same_draws_as_a_plain_cpu_generator():
    sample = _Sampler(torch.device("cpu"), torch.float32, seed=3)
    g = torch.Generator().manual_seed(3)
    assert torch.equal(sample.randn(1, 5, 4), torch.randn(1, 5, 4, generator=g))
    assert torch.equal(sample.randint(97, 1, 6), torch.randint(0, 97, (1, 6), generator=g))


def test_dtype_option_moves_the_model_and_rows_keep_their_format():
    model = _tiny_model()
    rows = measure_unit_rows(copy.deepcopy(model), [UnitCase(((0, 16),)), UnitCase(((8, 16), (0, 8)))],
                             repeat=1, warmup=0, device="cpu", dtype=torch.float64)
    keys = {"kind", "segments", "level", "tokens", "fwd_s", "bwd_s", "fwd_wall_s", "bwd_wall_s", "repeat"}
    assert [set(r) for r in rows] == [keys, keys] and all(r["fwd_s"] > 0 and r["bwd_s"] > 0 for r in rows)
    copied = copy.deepcopy(model)
    loss = measure_loss_rows(copied, [8], loss_chunk_tokens=4, repeat=1, warmup=0, dtype=torch.float64)
    assert next(copied.parameters()).dtype == torch.float64 and loss[0]["bwd_s"] > 0
    emb = measure_embedding_rows(model, [8], repeat=1, warmup=0, device=torch.device("cpu"))
    assert next(model.parameters()).dtype == torch.float32 and emb[0]["kind"] == "embedding"
