"""The planner benchmark's setups and batches, shared by its tables and ``solver_study.py``.

Setups: Llama-2-7B on 4 GPUs (pp 4) and Llama-2-13B on 8 GPUs (pp 8), one node.  Batches of 512
sequences (128 with ``quick``): real document lengths (SmolLM2 tokenizer) of the Python stdlib and
of stdlib + Shakespeare + KJV, SlimPajama-like and ProLong-like synthetic lengths to 128K, and
short ones to 2K.
"""
from __future__ import annotations

import random
import sys

from infinipipe_hf.data import synthetic

SETUPS = [("llama2-7b", 4), ("llama2-13b", 8)]


def real_batch(corpora: tuple[str, ...], n: int, seed: int) -> list[int]:
    """``n`` real document lengths (SmolLM2 tokenizer) drawn without replacement from the pooled corpora."""
    from infinipipe_hf.data.corpus import document_lengths

    pool = [x for corpus in corpora for x in document_lengths(corpus) if x > 0]
    rng = random.Random(seed)
    return rng.sample(pool, min(n, len(pool)))


def batches(quick: bool) -> dict[str, list[int]]:
    """``name -> lengths`` for every batch of the benchmark (fewer and smaller with ``quick``)."""
    out: dict[str, list[int]] = {}
    n = 128 if quick else 512
    real = [("stdlib",)] if quick else [("stdlib",), ("stdlib", "shakespeare", "kjv")]
    for corpora in real:
        try:
            out["real:" + "+".join(corpora)] = real_batch(corpora, n, seed=0)
        except Exception as exc:  # a missing optional corpus package is reported, not fatal
            print(f"skipping real:{'+'.join(corpora)}: {exc}", file=sys.stderr)
    out["synthetic:slimpajama-like"] = synthetic.slimpajama_like(n=n, max_len=131072, seed=0)
    out["synthetic:prolong-like"] = synthetic.prolong_like(n=n, max_len=131072, seed=0)
    out["synthetic:short-only"] = synthetic.short_only(n=n, max_len=2048, seed=0)
    return out
