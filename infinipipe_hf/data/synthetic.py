"""Seeded synthetic sequence lengths shaped like published long-context data distributions.

Design: each generator draws lengths from a log-normal body (the usual shape of document
lengths) but fixes the one published statistic it stands for *by construction* rather than in
expectation, so every seed, not just most, reproduces the figure:
- ``slimpajama_like``: SlimPajama, where about 30% of documents are longer than 4K tokens (the
  figure the InfiniPipe paper quotes).  Exactly ``round(0.3 * n)`` documents are drawn from the
  log-normal's tail above 4K (up to ``max_len``), the rest from its body at or below 4K; the tail
  is heavy (log-normal with sigma 1.6: p99 around 70K).
- ``prolong_like``: ProLong's 64K training mix (Gao et al. 2024), where about 60% of the tokens
  come from long documents of 64K tokens or more.  Long documents are log-uniform in
  ``[64K, max_len]``, short ones log-normal below 64K; the number of long documents is the one
  whose token share is nearest 60%.
- ``short_only``: log-normal lengths capped at ``max_len`` (a fine-tuning/chat-like batch).
``long_tailed_batch`` draws a global batch from real lengths (e.g. ``document_lengths("stdlib")``)
up to a token budget.

The InfiniPipe paper's table uses CommonCrawl and GitHub batches capped at 48K and 96K tokens; its
length histograms are not reproduced here, so the two stand-ins are anchored on figures that are
published or measured, and say which:
- ``commoncrawl_like``: web text.  The figure is SlimPajama's (about 30% of documents over 4K
  tokens, the statistic the InfiniPipe paper quotes; SlimPajama is mostly CommonCrawl and C4 web
  text), with the same log-normal (sigma 1.6, median about 1.8K); documents longer than the cap
  are *truncated* to it, as a training pipeline with a maximum length does, so some sit at the cap.
- ``github_like``: source files.  A log-normal through the quantiles of a real code corpus, the
  Python standard library's sources in SmolLM2 tokens (median 2.1K, p90 11.9K, max 172K, measured
  by this project: ``corpus.document_lengths("stdlib")``), truncated at the cap.  Draws are
  stratified (one uniform per ``1/n`` slice of probability, shuffled), so every batch reproduces
  the quantiles closely, not only on average.

Trade-off: fixing the statistic couples the draws (the count of long documents is not random),
which is what benchmarks want (comparable batches across seeds) but is not an i.i.d. sample.
Only numpy and the standard library are used; everything is deterministic given ``seed``.
"""
from __future__ import annotations

import math
from statistics import NormalDist
from typing import Sequence

import numpy as np

SLIMPAJAMA_LONG_THRESHOLD = 4096
SLIMPAJAMA_LONG_DOC_FRACTION = 0.30
PROLONG_LONG_THRESHOLD = 65536
PROLONG_LONG_TOKEN_SHARE = 0.60
MIN_LEN = 16

_NORMAL = NormalDist()


def _check(n: int, max_len: int, min_max_len: int, name: str) -> None:
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{name}: n must be a positive integer, got {n!r}")
    if not isinstance(max_len, (int, np.integer)) or max_len < min_max_len:
        raise ValueError(f"{name}: max_len must be an integer >= {min_max_len}, got {max_len!r}")


def _truncated_lognormal(rng: np.random.Generator, size: int, mu: float, sigma: float,
                         lo: float, hi: float) -> np.ndarray:
    """Inverse-CDF draws of a log-normal restricted to ``[lo, hi]`` (exact, no rejection loop)."""
    if size == 0:
        return np.zeros(0, dtype=np.int64)
    c_lo = _NORMAL.cdf((math.log(lo) - mu) / sigma)
    c_hi = _NORMAL.cdf((math.log(hi) - mu) / sigma)
    # Keep u strictly inside (0, 1): inv_cdf rejects the end points.
    u = np.clip(rng.uniform(c_lo, c_hi, size), 1e-12, 1 - 1e-12)
    x = np.exp([mu + sigma * _NORMAL.inv_cdf(float(v)) for v in u])
    return np.clip(np.round(x), lo, hi).astype(np.int64)


def slimpajama_like(n: int = 512, max_len: int = 131072, seed: int = 0) -> list[int]:
    """``n`` lengths with 30% of documents longer than 4K tokens and a heavy tail to ``max_len``."""
    _check(n, max_len, SLIMPAJAMA_LONG_THRESHOLD + 1, "slimpajama_like")
    rng = np.random.default_rng(seed)
    sigma = 1.6
    # mu puts 30% of the untruncated log-normal above 4K, so body and tail join smoothly.
    mu = math.log(SLIMPAJAMA_LONG_THRESHOLD) - sigma * _NORMAL.inv_cdf(1 - SLIMPAJAMA_LONG_DOC_FRACTION)
    n_long = int(round(SLIMPAJAMA_LONG_DOC_FRACTION * n))
    long = _truncated_lognormal(rng, n_long, mu, sigma, SLIMPAJAMA_LONG_THRESHOLD + 1, max_len)
    short = _truncated_lognormal(rng, n - n_long, mu, sigma, MIN_LEN, SLIMPAJAMA_LONG_THRESHOLD)
    lengths = np.concatenate([long, short])
    rng.shuffle(lengths)
    return [int(x) for x in lengths]


def commoncrawl_like(n: int = 512, max_len: int = 49152, seed: int = 0) -> list[int]:
    """``n`` web-text lengths: 30% of documents over 4K tokens, longer ones truncated to ``max_len``."""
    _check(n, max_len, SLIMPAJAMA_LONG_THRESHOLD + 1, "commoncrawl_like")
    rng = np.random.default_rng(seed)
    sigma = 1.6
    mu = math.log(SLIMPAJAMA_LONG_THRESHOLD) - sigma * _NORMAL.inv_cdf(1 - SLIMPAJAMA_LONG_DOC_FRACTION)
    n_long = int(round(SLIMPAJAMA_LONG_DOC_FRACTION * n))
    # The tail is drawn without an upper bound, then cut at the cap (truncated documents).
    long = _truncated_lognormal(rng, n_long, mu, sigma, SLIMPAJAMA_LONG_THRESHOLD + 1, 1 << 30)
    short = _truncated_lognormal(rng, n - n_long, mu, sigma, MIN_LEN, SLIMPAJAMA_LONG_THRESHOLD)
    lengths = np.minimum(np.concatenate([long, short]), max_len)
    rng.shuffle(lengths)
    return [int(x) for x in lengths]


GITHUB_MEDIAN_TOKENS = 2100
GITHUB_P90_TOKENS = 11900


def github_like(n: int = 512, max_len: int = 49152, seed: int = 0) -> list[int]:
    """``n`` source-file lengths: log-normal with the stdlib's median 2.1K and p90 11.9K tokens,
    stratified draws, truncated to ``max_len``."""
    _check(n, max_len, MIN_LEN, "github_like")
    rng = np.random.default_rng(seed)
    mu = math.log(GITHUB_MEDIAN_TOKENS)
    sigma = (math.log(GITHUB_P90_TOKENS) - mu) / _NORMAL.inv_cdf(0.9)
    u = (np.arange(n) + rng.uniform(0.0, 1.0, n)) / n
    u = np.clip(u, 1e-12, 1 - 1e-12)
    x = np.exp([mu + sigma * _NORMAL.inv_cdf(float(v)) for v in u])
    lengths = np.clip(np.round(x), MIN_LEN, max_len).astype(np.int64)
    rng.shuffle(lengths)
    return [int(v) for v in lengths]


def prolong_like(n: int = 512, max_len: int = 131072, seed: int = 0) -> list[int]:
    """``n`` lengths where about 60% of the tokens are in documents of 64K tokens or more."""
    _check(n, max_len, PROLONG_LONG_THRESHOLD, "prolong_like")
    rng = np.random.default_rng(seed)
    short = _truncated_lognormal(rng, n, math.log(1024), 1.4, MIN_LEN, PROLONG_LONG_THRESHOLD - 1)
    long = np.round(np.exp(rng.uniform(math.log(PROLONG_LONG_THRESHOLD), math.log(max_len), n)))
    long = np.clip(long, PROLONG_LONG_THRESHOLD, max_len).astype(np.int64)
    # share(k): token share of the first k long plus the first n-k short documents.
    k = np.arange(n + 1)
    long_tokens = np.concatenate([[0], np.cumsum(long)])
    short_tokens = np.concatenate([[0], np.cumsum(short)])[n - k]
    share = long_tokens / (long_tokens + short_tokens)
    n_long = int(np.argmin(np.abs(share - PROLONG_LONG_TOKEN_SHARE)))
    lengths = np.concatenate([long[:n_long], short[:n - n_long]])
    rng.shuffle(lengths)
    return [int(x) for x in lengths]


def short_only(n: int = 512, max_len: int = 2048, seed: int = 0) -> list[int]:
    """``n`` short lengths (log-normal, median about ``max_len / 4``) in ``[16, max_len]``."""
    _check(n, max_len, MIN_LEN, "short_only")
    rng = np.random.default_rng(seed)
    lengths = _truncated_lognormal(rng, n, math.log(max(max_len / 4, MIN_LEN)), 0.8, MIN_LEN, max_len)
    return [int(x) for x in lengths]


def long_tailed_batch(lengths: Sequence[int], token_budget: int, seed: int = 0) -> list[int]:
    """A global batch of lengths drawn from ``lengths`` (without replacement) within a token budget.

    Documents are visited in a seeded random order and each is taken if it still fits, so the
    batch is close to full while long documents keep their chance of being drawn first.
    Documents longer than the whole budget can never fit and are never taken.
    """
    pool = np.asarray(list(lengths), dtype=np.int64)
    if pool.size == 0:
        raise ValueError("long_tailed_batch: lengths is empty; pass the document lengths to draw from")
    if (pool < 1).any():
        raise ValueError(f"long_tailed_batch: lengths must be positive, got min {int(pool.min())}")
    if not isinstance(token_budget, (int, np.integer)) or token_budget < 1:
        raise ValueError(f"long_tailed_batch: token_budget must be a positive integer, got {token_budget!r}")
    if int(pool.min()) > token_budget:
        raise ValueError(f"long_tailed_batch: no document fits token_budget={token_budget} (the "
                         f"shortest has {int(pool.min())} tokens); raise the budget")
    rng = np.random.default_rng(seed)
    batch: list[int] = []
    left = int(token_budget)
    shortest = int(pool.min())
    for length in pool[rng.permutation(pool.size)]:
        if length <= left:
            batch.append(int(length))
            left -= int(length)
            if left < shortest:
                break
    return batch
