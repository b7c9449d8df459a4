"""Preparing (tokenizing) a dataset once per job: rank 0 does it, the other ranks load its result.

Design: every rank needs the same token dataset, and tokenizing it on every rank costs the whole
corpus once per process (and interleaves their progress bars).  As ``main_process_first`` does in
HF, rank 0 prepares first and the others reuse its result: rank 0 writes the prepared dataset
with ``save_to_disk`` under ``<output_dir>/.prepared/<name>`` (written to a temporary folder,
then renamed), then tells every rank where it is (one ``broadcast_object_list``); the others
``load_from_disk`` it (memory-mapped, no bar).  A preparation error on rank 0 reaches every rank
in the same broadcast, so no rank waits for a dataset that never comes.  When the preparation
changed nothing (token ids given), or the result is not a ``datasets.Dataset``, every rank keeps
its own.  The time is logged on rank 0.

Trade-off: the path must be visible to every rank (the same shared filesystem checkpoints need);
a rank that cannot see it prepares the dataset itself, with a warning saying so.
"""
from __future__ import annotations

import os
import shutil
import time
from typing import Any, Callable

from infinipipe_hf.trainer import notices


def _world() -> tuple[int, int, Any]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), dist
    return 0, 1, None


def describe(dataset) -> str:
    """``N documents, M tokens`` of a token dataset (documents only when there is no ``input_ids``)."""
    try:
        n = len(dataset)
        cols = getattr(dataset, "column_names", None) or []
        if "input_ids" in cols:
            tokens = sum(len(x) for x in dataset.select_columns(["input_ids"])["input_ids"])
            return f"{n} documents, {tokens} tokens"
        return f"{n} documents"
    except Exception:  # a description must never fail the preparation
        return "the dataset"


def _save(dataset, path: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    dataset.save_to_disk(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def _main_prepares(name: str, original, prepare: Callable[[], Any], path: str) -> tuple[Any, list]:
    import datasets

    t0 = time.perf_counter()
    try:
        prepared = prepare()
    except Exception as exc:
        return None, ["error", f"{type(exc).__name__}: {exc}", exc]
    took = time.perf_counter() - t0
    if prepared is original or not isinstance(prepared, datasets.Dataset):
        return prepared, ["own", None, None]
    try:
        _save(prepared, path)
    except Exception as exc:  # e.g. a full disk: the other ranks must not wait for it
        notices.warn(f"{name}: could not write the prepared copy to {path} ({type(exc).__name__}: "
                     f"{exc}); every rank prepares it itself")
        return prepared, ["own", None, None]
    notices.info(f"prepared {name} ({describe(prepared)}) in {took:.1f} s on rank 0; the other ranks "
                 f"load it from {path}")
    return prepared, ["load", path, None]


def prepare_once(name: str, original, prepare: Callable[[], Any], cache_root: str) -> Any:
    """``prepare()`` on rank 0, its result loaded by the other ranks (collective); ``prepare()``
    everywhere in a world of one.  ``original``: the input dataset (an unchanged result is not
    shared)."""
    rank, world, dist = _world()
    if world == 1:
        t0 = time.perf_counter()
        prepared = prepare()
        if prepared is not original and prepared is not None:
            notices.info(f"prepared {name} ({describe(prepared)}) in {time.perf_counter() - t0:.1f} s")
        return prepared
    path = os.path.join(os.path.abspath(cache_root), ".prepared", name.replace("/", "_"))
    prepared, box = None, [None, None, None]
    if rank == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        prepared, box = _main_prepares(name, original, prepare, path)
    msg = box[:2]
    dist.broadcast_object_list(msg, src=0)
    kind, payload = msg
    if kind == "error":
        if rank == 0:
            raise box[2]
        raise ValueError(f"rank 0 could not prepare {name}, so no rank can: {payload}")
    if rank == 0:
        return prepared
    if kind == "own":
        return prepare()
    return _load(name, payload, prepare)


def _load(name: str, path: str, prepare: Callable[[], Any]):
    import datasets

    if not os.path.isdir(path):
        notices.warn(f"{name}: rank 0 prepared it in {path}, which this rank cannot see (no shared "
                     f"filesystem?); preparing it here as well", every_rank=True)
        return prepare()
    was = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        return datasets.load_from_disk(path)
    finally:
        if was:
            datasets.enable_progress_bars()
