"""Tokenization once per job, and layout errors before any of it (``prepare_once.py OUT_DIR``, 2 ranks).

Cases (each rank prints ``CASE <name> OK``, then ``ALL OK``):
- ``layout_error_before_tokenizing``: ``sp_degree=3`` on 2 processes raises the layout error
  without one tokenizer call on any rank;
- ``tokenized_once``: a text dataset is tokenized by rank 0 only; rank 1 loads rank 0's copy and
  both ranks train on the same token ids.
"""
from __future__ import annotations

import os
import sys

import datasets
import torch
import torch.distributed as dist
from trainer_common import SCENARIOS, make_model

from infinipipe_hf.trainer.arguments import EPPTrainingArguments
from infinipipe_hf.trainer.trainer import EPPTrainer

OUT = sys.argv[1]
TEXTS = [("lorem ipsum dolor sit amet " * (k + 1)).strip() for k in range(12)]


class CountingTokenizer:
    """Characters to ids, counting its calls (a tokenizer is all the trainer needs here)."""

    eos_token_id = 1
    calls = 0

    def __call__(self, texts):
        CountingTokenizer.calls += 1
        return {"input_ids": [[2 + ord(c) % 90 for c in t] for t in texts]}


def log(msg: str) -> None:
    print(f"[rank {dist.get_rank()}] {msg}", flush=True)


def args(**over) -> EPPTrainingArguments:
    kw = dict(SCENARIOS["base"].train_kwargs(), max_steps=1, save_strategy="no")
    kw.update(over)
    return EPPTrainingArguments(output_dir=OUT, tokens_per_step=128, **kw)


def layout_error_before_tokenizing() -> None:
    data = datasets.Dataset.from_dict({"text": TEXTS})
    try:
        EPPTrainer(model=make_model(SCENARIOS["base"]), args=args(pp_degree=1, sp_degree=3),
                   train_dataset=data, processing_class=CountingTokenizer())
    except ValueError as exc:
        assert "sp_degree=3 = 3 does not divide world size 2" in str(exc), exc
        assert CountingTokenizer.calls == 0, CountingTokenizer.calls
        log(f"CASE layout_error_before_tokenizing OK: {str(exc)[:120]!r}")
        return
    raise AssertionError("sp_degree=3 on 2 processes was accepted")


def tokenized_once() -> None:
    data = datasets.Dataset.from_dict({"text": TEXTS})
    tr = EPPTrainer(model=make_model(SCENARIOS["base"]), args=args(pp_degree=2), train_dataset=data,
                    processing_class=CountingTokenizer())
    calls = CountingTokenizer.calls
    assert (calls > 0) if dist.get_rank() == 0 else (calls == 0), (dist.get_rank(), calls)
    ids = [list(x) for x in tr.train_dataset["input_ids"]]
    assert ids == [[2 + ord(c) % 90 for c in t] + [1] for t in TEXTS]
    seen = [None, None]
    dist.all_gather_object(seen, ids)
    assert seen[0] == seen[1]
    tr.train()
    log(f"CASE tokenized_once OK: {calls} tokenizer calls here")


if __name__ == "__main__":
    torch.set_num_threads(1)
    os.makedirs(OUT, exist_ok=True)
    layout_error_before_tokenizing()
    tokenized_once()
    dist.barrier()
    log("ALL OK")
