"""The single-GPU benchmark scripts (``benchmarks/gpu/single_gpu.py``, ``benchmarks/gpu/memory_model_check.py``)
run end to end on CPU with a tiny model (smoke test)."""
import json

import pytest


@pytest.fixture()
def bench_modules():
    from benchmarks.gpu import memory_model_check, single_gpu

    return single_gpu, memory_model_check


def test_single_gpu_tiny_cpu(tmp_path, bench_modules):
    single_gpu, _ = bench_modules
    out = tmp_path / "single.json"
    assert single_gpu.main(["--tiny", "--device", "cpu", "--dtype", "fp32", "--lengths", "48",
                            "--steps", "1", "--warmup", "0", "--longtail-tokens", "120",
                            "--longtail-max-len", "4200", "--pack-tokens", "64",
                            "--methods", "hf,epp,hf_packed", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {(r["section"], r["name"]): r for r in res["rows"]}
    assert set(rows) == {("single", "hf"), ("single", "epp"), ("longtail", "hf_packed"), ("longtail", "epp")}
    for r in rows.values():
        assert "error" not in r, r
        assert r["tokens_per_s"] > 0
    # Same model, same data: the engine's loss is the HF mean token loss (random init ~ log(vocab)).
    assert abs(rows[("single", "epp")]["loss"] - 5.35) < 0.2
    # HF packing (use_cache=False) equals the per-sequence losses.
    assert rows[("longtail", "hf_packed")]["packed_vs_separate_loss_rel_diff"] < 1e-5
    assert sum(res["longtail_lengths"]) <= 120 and len(res["longtail_lengths"]) >= 1
    assert out.with_suffix(".png").exists()


def test_packs_of_respects_budget(bench_modules):
    single_gpu, _ = bench_modules
    packs = single_gpu.packs_of([[0] * 5, [0] * 4, [0] * 9, [0] * 2], 9)
    assert [[len(s) for s in p] for p in packs] == [[5, 4], [9], [2]]


def test_memory_check_tiny_cpu(tmp_path, bench_modules):
    _, mem = bench_modules
    out = tmp_path / "mem.json"
    assert mem.main(["--tiny", "--device", "cpu", "--dtype", "fp32", "--cases", "64:2:full",
                     "--steps", "1", "--warmup", "0", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert "error" not in row, row
    assert row["num_slices"] == 2 and row["num_units"] == 2 and set(row["checkpointed_layers"].values()) == {2}


def test_hf_packed_baseline_is_padding_free_and_exact(bench_modules):
    """Three sequences in one pack: the packed loss equals the per-sequence losses, i.e. the HF
    baseline really keeps packed sequences apart (it does not with the default use_cache=True)."""
    from types import SimpleNamespace

    import torch

    from benchmarks.gpu import gpu_common

    single_gpu, _ = bench_modules
    seqs = [gpu_common.random_ids(n, 211, seed=n) for n in (30, 20, 10)]
    args = SimpleNamespace(pack_tokens=64, warmup=0, steps=1)
    row = single_gpu.hf_packed_rows(gpu_common.TINY_CONFIG, seqs, torch.device("cpu"), torch.float32, args,
                                    ckpt=False)
    assert row["num_packs"] == 1 and row["tokens"] == 60
    assert row["packed_vs_separate_loss_rel_diff"] < 1e-5
