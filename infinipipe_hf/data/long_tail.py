"""A small long-tailed training mix of real text, for the demo and the notebooks.

Design: a fixed token budget is filled with *whole* real documents so that one global batch
looks like long-context data in miniature: a few long documents (an excerpt of a Shakespeare
play and of a King James book, truncated to ``long_tokens``) and many short-to-medium whole
Python standard-library files.  The stdlib files are visited in a fixed pseudo-random order (a
hash of their path) and a file is taken when it has at most ``max_doc_tokens`` tokens and still
fits the remaining budget, so the mix keeps the stdlib's skew (many small modules, few large
ones) instead of being a list of equal-length chunks.

Trade-off: tokenizing the whole stdlib costs tens of seconds, and the demo runs this on every
rank, so files are pre-filtered by size in bytes (code averages about 3-4 bytes per SmolLM2
token; a file of more than ``_BYTES_PER_TOKEN_MAX`` bytes per allowed token is surely too long)
and only the remaining candidates are tokenized.  The
mix therefore depends on the Python version's stdlib: callers rely on its properties (budget,
skew, determinism), never on exact documents.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from infinipipe_hf.data.corpus import kjv_documents, shakespeare_documents, stdlib_documents

# Hardly any text averages more bytes per SmolLM2 token than this (long runs of spaces do, a
# little); used only to skip files that are surely too long without tokenizing them.
_BYTES_PER_TOKEN_MAX = 8.0
# Documents shorter than this carry almost no signal and only add packing noise.
_MIN_DOC_TOKENS = 16


@dataclass(frozen=True)
class MixDocument:
    name: str
    """``corpus:name`` of the source document (``stdlib:json/decoder.py``)."""
    input_ids: list[int]
    truncated: bool
    """True when the document is an excerpt (its first ``long_tokens`` tokens)."""


def _hash_order(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def _encode(tokenizer, text: str, eos: int | None) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return list(ids) + ([eos] if eos is not None else [])


def long_tailed_mix(tokenizer, budget_tokens: int, *, long_tokens: int, max_doc_tokens: int | None = None,
                    num_long: int = 2) -> list[MixDocument]:
    """Real documents totalling at most ``budget_tokens`` tokens (EOS appended to each).

    ``num_long`` excerpts of ``long_tokens`` tokens (alternately Shakespeare and KJV) come first;
    whole stdlib files of ``_MIN_DOC_TOKENS``..``max_doc_tokens`` tokens (default
    ``long_tokens // 2``) fill the rest.  Deterministic for a given Python installation.
    """
    if budget_tokens < long_tokens * num_long or long_tokens < _MIN_DOC_TOKENS:
        raise ValueError(f"budget_tokens={budget_tokens} must hold num_long={num_long} excerpts of "
                         f"long_tokens={long_tokens} (>= {_MIN_DOC_TOKENS}) tokens")
    max_doc_tokens = max_doc_tokens if max_doc_tokens is not None else long_tokens // 2
    eos = getattr(tokenizer, "eos_token_id", None)
    docs: list[MixDocument] = []
    # Modern-spelling editions (the First Folio ones end in _f): closer to what the model knows.
    plays = [d for d in shakespeare_documents() if not d[0].endswith("_f")]
    sources = [("shakespeare", plays), ("kjv", kjv_documents(max_docs=num_long))]
    for i in range(num_long):
        corpus, pool = sources[i % 2]
        name, text = pool[i // 2]
        # Decode a generous prefix only: a whole play is ~40K tokens and we keep long_tokens.
        ids = _encode(tokenizer, text[: long_tokens * 8], None)[: long_tokens - 1]
        docs.append(MixDocument(f"{corpus}:{name}", ids + ([eos] if eos is not None else []), True))
    remaining = budget_tokens - sum(len(d.input_ids) for d in docs)
    stdlib = sorted(stdlib_documents(), key=lambda d: _hash_order(d[0]))
    for name, text in stdlib:
        if remaining < _MIN_DOC_TOKENS:
            break
        limit = min(max_doc_tokens, remaining)
        if len(text.encode()) > limit * _BYTES_PER_TOKEN_MAX or len(text) < _MIN_DOC_TOKENS:
            continue
        ids = _encode(tokenizer, text, eos)
        if _MIN_DOC_TOKENS <= len(ids) <= limit:
            docs.append(MixDocument(f"stdlib:{name}", ids, False))
            remaining -= len(ids)
    return docs


def describe_lengths(lengths: list[int]) -> str:
    """One line of statistics: count, total, median, p90, max, and the longest 10%'s token share."""
    if not lengths:
        return "no documents"
    s = sorted(lengths)
    n = len(s)
    top = s[n - max(1, n // 10):]
    return (f"{n} documents, {sum(s)} tokens: median {s[n // 2]}, p90 {s[min(n - 1, (9 * n) // 10)]}, "
            f"max {s[-1]}; the longest 10% hold {100 * sum(top) / sum(s):.0f}% of the tokens")
