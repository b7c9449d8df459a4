"""Documents as *pieces* ``(doc, start, end)``: each trains as its own sequence.

A document longer than the binding length limit (the smaller of the model's max positions and
``tokens_per_step``, named in every message) is cut into near-equal independent pieces or
rejected; documents shorter than 2 tokens carry no next-token target and are skipped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from infinipipe_hf.trainer import notices


@dataclass(frozen=True)
class Piece:
    """A contiguous token range of one document that trains as its own sequence."""

    doc: int
    """Index of the document in the token dataset."""
    start: int
    """First token (inclusive)."""
    end: int
    """One past the last token."""

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(f"piece of document {self.doc} needs 0 <= start < end, got "
                             f"[{self.start}, {self.end})")

    @property
    def length(self) -> int:
        return self.end - self.start


_RAISE_HINT = {
    "tokens_per_step": "raise tokens_per_step (the planner cuts long sequences into slices; "
                       "python -m infinipipe_hf.plan says what fits)",
    "max_position_embeddings": "the model cannot attend over more positions (use a model with a "
                               "longer context)",
}


def binding_limit(limits: dict[str, int]) -> tuple[str, int]:
    """``(name, value)`` of the smallest of the named length limits (ties: the first named)."""
    if not limits:
        raise ValueError("no document length limit given")
    name = min(limits, key=lambda k: limits[k])
    return name, int(limits[name])


def split_documents(lengths: Sequence[int], limit: int | dict[str, int], policy: str = "split",
                    what: str = "the dataset") -> list[Piece]:
    """Pieces covering every token of every trainable document exactly once, each <= the limit.

    ``limit`` is a number or ``{name: value}`` of limits (e.g. ``tokens_per_step`` and
    ``max_position_embeddings``); the smallest binds and is named in the warning (``split``: once,
    with the number of documents and tokens affected) or the error (``reject``).  ``split`` cuts a
    longer document into ``ceil(n / limit)`` near-equal pieces (equal sizes keep the planner's
    units balanced better than one full piece plus a short rest).
    """
    name, limit = binding_limit(limit if isinstance(limit, dict) else {"": limit})
    bound = f"{name}={limit}" if name else f"the limit of {limit}"
    if limit < 2:
        raise ValueError(f"the document length limit must be >= 2 tokens, got {bound}")
    if policy not in ("split", "reject"):
        raise ValueError(f"long_document_policy={policy!r} is not known; use 'split' or 'reject'")
    pieces: list[Piece] = []
    skipped = long_docs = long_tokens = extra_pieces = 0
    for doc, n in enumerate(lengths):
        n = int(n)
        if n < 2:
            skipped += 1
            continue
        if n <= limit:
            pieces.append(Piece(doc, 0, n))
            continue
        if policy == "reject":
            fix = _RAISE_HINT.get(name, f"raise {name or 'the limit'}")
            raise ValueError(f"{what}: document {doc} has {n} tokens, more than {bound} (the binding "
                             f"length limit); {fix}, drop or truncate the document, or set "
                             f"long_document_policy='split' to train it as independent pieces")
        k = -(-n // limit)
        bounds = [round(i * n / k) for i in range(k + 1)]
        pieces.extend(Piece(doc, a, b) for a, b in zip(bounds[:-1], bounds[1:]))
        long_docs, long_tokens, extra_pieces = long_docs + 1, long_tokens + n, extra_pieces + k
    if long_docs:
        fix = _RAISE_HINT.get(name, f"raise {name or 'the limit'}")
        notices.warn(f"{what}: {long_docs} of {len(lengths)} documents ({long_tokens} of {sum(map(int, lengths))} "
                     f"tokens) are longer than {bound} and are trained as {extra_pieces} "
                     f"independent pieces (no attention across pieces); to keep them whole, "
                     f"{fix}; set "
                     f"long_document_policy='reject' to refuse them instead")
    if skipped:
        notices.warn(f"{what}: {skipped} document(s) with fewer than 2 tokens have no next-token target and "
                     f"are skipped")
    return pieces
