"""The trainer's data path: dataset -> token lists -> token-budget global batches.

Design:
- ``prepare_token_dataset`` accepts a dataset with an ``input_ids`` column (optionally ``labels``;
  an ``attention_mask`` column means padded data: masked tokens are dropped) or a ``text`` column
  plus a tokenizer (tokenized once with ``datasets.map``), else it raises; an empty one raises.
- Loss masks: without a ``labels`` column, TRL's mask columns (``completion_mask``,
  ``assistant_masks``: 1 = train on this token) become the labels, the way TRL builds them (a
  token is trained when every mask marks it); with ``labels`` they are ignored, with a warning.
- Documents become *pieces* ``(doc, start, end)``: a document longer than the limit (the model's
  max positions or ``tokens_per_step``, whichever is smaller: the *binding* limit, named in every
  message) is cut into near-equal independent pieces (one warning with the counts), or rejected.
  Documents shorter than 2 tokens carry no next-token target and are skipped with a warning.
- ``TokenBudgetBatchSampler`` packs pieces into batches of at most ``tokens_per_step`` tokens with
  best-fit decreasing, so batches are full and every token of an epoch is in exactly one batch.
  Each epoch (``set_epoch``) reshuffles with ``seed + epoch``: ties between equally long pieces
  are broken randomly and the batch order is shuffled.
- Every rank builds the same batches (no sharding): the pipeline plans the whole global batch
  and assigns sequences to DP replicas itself.

Trade-off: best-fit decreasing only looks at lengths, so the *number* of batches per epoch is the
same every epoch (HF's Trainer computes steps per epoch once, and exact resume relies on it),
at the price of batch composition varying across epochs only among pieces of equal length.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from infinipipe_hf.planner.batch.packing import best_fit_decreasing


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


def _column_names(dataset) -> list[str]:
    names = getattr(dataset, "column_names", None)
    if names is not None:
        return list(names)
    if len(dataset) == 0:
        return []
    first = dataset[0]
    return list(first.keys()) if isinstance(first, dict) else []


MASK_COLUMNS = ("completion_mask", "assistant_masks")
"""TRL's per-token loss masks (1: the token is trained), folded into labels when there are none."""


def prepare_token_dataset(dataset, tokenizer=None, *, add_eos: bool = True, what: str = "train_dataset"):
    """Return a dataset whose items have ``input_ids`` (and maybe ``labels``) token lists.

    ``text`` datasets are tokenized with ``tokenizer`` (an EOS token is appended so documents
    stay delimited, unless ``add_eos=False`` or the tokenizer already ends with it).
    """
    if dataset is None:
        return None
    try:
        rows = len(dataset)
    except TypeError:
        raise ValueError(f"{what} has no length ({type(dataset).__name__}); EPPTrainer plans batches "
                         f"from document lengths: pass a datasets.Dataset (not an IterableDataset) "
                         f"or a list of examples") from None
    if rows == 0:
        raise ValueError(f"{what} is empty (0 examples); pass a dataset with at least one document "
                         f"of 2 or more tokens")
    cols = _column_names(dataset)
    masks = [c for c in MASK_COLUMNS if c in cols]
    if "input_ids" in cols and "labels" in cols and masks:
        warnings.warn(f"{what} has a 'labels' column and {', '.join(masks)}: the labels decide which "
                      f"tokens are trained and {', '.join(masks)} is ignored; drop 'labels' to train "
                      f"by the mask instead", UserWarning, stacklevel=3)
    if "input_ids" in cols:
        if "attention_mask" in cols and hasattr(dataset, "map"):
            return dataset.map(_strip_padding, batched=True, remove_columns=["attention_mask"],
                               desc="Removing padding")
        return dataset
    if "text" in cols:
        if tokenizer is None:
            raise ValueError(f"{what} has a 'text' column but no tokenizer was given; pass "
                             f"processing_class=tokenizer to EPPTrainer or tokenize into 'input_ids'")
        if not hasattr(dataset, "map"):
            raise ValueError(f"{what} with a 'text' column must be a datasets.Dataset (to tokenize with "
                             f".map); got {type(dataset).__name__}: tokenize it into 'input_ids' first")
        eos = getattr(tokenizer, "eos_token_id", None) if add_eos else None

        def tokenize(batch):
            ids = tokenizer(batch["text"])["input_ids"]
            if eos is not None:
                ids = [x if x and x[-1] == eos else list(x) + [eos] for x in ids]
            return {"input_ids": ids}

        return dataset.map(tokenize, batched=True, remove_columns=cols, desc="Tokenizing")
    raise ValueError(f"{what} has columns {cols} but EPPTrainer needs token ids: an 'input_ids' "
                     f"column (optionally 'labels'), or a 'text' column plus a tokenizer "
                     f"(processing_class=...)")


def _strip_padding(batch):
    # Pre-padded data: the pipeline packs and slices sequences itself, so padding would only be
    # trained on.  Labels (when present) are aligned with input_ids and filtered the same way.
    keep = [[bool(m) for m in mask] for mask in batch["attention_mask"]]
    out = {"input_ids": [[t for t, k in zip(ids, ks) if k] for ids, ks in zip(batch["input_ids"], keep)]}
    for col in ("labels", *MASK_COLUMNS):
        if col in batch:
            out[col] = [[t for t, k in zip(lab, ks) if k] for lab, ks in zip(batch[col], keep)]
    return out


def labels_of(row: dict, doc: int) -> list[int] | None:
    """The row's labels: its ``labels``, else ``input_ids`` masked by TRL's mask columns (-100
    where a mask is 0, as TRL's ``build_labels``), else ``None`` (every token is trained)."""
    ids = _as_list(row["input_ids"])
    if row.get("labels") is not None:
        labels = _as_list(row["labels"])
        if len(labels) != len(ids):
            raise ValueError(f"document {doc} has {len(ids)} input_ids but {len(labels)} labels; "
                             f"labels must align with input_ids (use -100 for ignored positions)")
        return labels
    masks = [(c, _as_list(row[c])) for c in MASK_COLUMNS if row.get(c) is not None]
    if not masks:
        return None
    for name, mask in masks:
        if len(mask) != len(ids):
            raise ValueError(f"document {doc} has {len(ids)} input_ids but {len(mask)} {name} entries; "
                             f"{name} must have one 0/1 entry per token")
    return [t if all(m[i] for _, m in masks) else -100 for i, t in enumerate(ids)]


def document_lengths(dataset) -> list[int]:
    """Token count of every document (reads only the ``input_ids`` column when it can)."""
    if hasattr(dataset, "column_names") and hasattr(dataset, "select_columns"):
        return [len(x) for x in dataset.select_columns(["input_ids"])["input_ids"]]
    return [len(dataset[i]["input_ids"]) for i in range(len(dataset))]


_RAISE_HINT = {
    "tokens_per_step": "raise tokens_per_step",
    "max_position_embeddings": "the model cannot attend over more positions (use a model with a "
                               "longer context)",
}


def binding_limit(limits: dict[str, int]) -> tuple[str, int]:
    """``(name, value)`` of the smallest of the named length limits (ties: the first named)."""
    if not limits:
        raise ValueError("no document length limit given")
    name = min(limits, key=lambda k: limits[k])
    return name, int(limits[name])


def split_documents(lengths: Sequence[int], limit: int | dict[str, int], policy: str = "split"
                    ) -> list[Piece]:
    """Pieces covering every token of every trainable document exactly once, each <= the limit.

    ``limit`` is a number or ``{name: value}`` of limits (e.g. ``tokens_per_step`` and
    ``max_position_embeddings``); the smallest binds and is named in the warning (``split``: once,
    with the number of documents and tokens affected) or the error (``reject``).  ``split`` cuts a
    longer document into ``ceil(n / limit)`` near-equal pieces (equal sizes keep the planner's
    units balanced better than one full piece plus a short rest).
    """
    name, limit = binding_limit(limit if isinstance(limit, dict) else {"": limit})
    what = f"{name}={limit}" if name else f"the limit of {limit}"
    if limit < 2:
        raise ValueError(f"the document length limit must be >= 2 tokens, got {what}")
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
            raise ValueError(f"document {doc} has {n} tokens, more than {what} (the binding "
                             f"length limit); {fix}, drop or truncate the document, or set "
                             f"long_document_policy='split' to train it as independent pieces")
        k = -(-n // limit)
        bounds = [round(i * n / k) for i in range(k + 1)]
        pieces.extend(Piece(doc, a, b) for a, b in zip(bounds[:-1], bounds[1:]))
        long_docs, long_tokens, extra_pieces = long_docs + 1, long_tokens + n, extra_pieces + k
    if long_docs:
        warnings.warn(f"{long_docs} of {len(lengths)} documents ({long_tokens} of {sum(map(int, lengths))} "
                      f"tokens) are longer than {what} and are trained as {extra_pieces} "
                      f"independent pieces (no attention across pieces); set "
                      f"long_document_policy='reject' to refuse them instead", UserWarning, stacklevel=2)
    if skipped:
        warnings.warn(f"{skipped} document(s) with fewer than 2 tokens have no next-token target and "
                      f"are skipped", UserWarning, stacklevel=2)
    return pieces


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Yields lists of piece indices, each list one global batch of <= ``tokens_per_step`` tokens."""

    def __init__(self, piece_lengths: Sequence[int], tokens_per_step: int, *, seed: int = 0,
                 shuffle: bool = True) -> None:
        if tokens_per_step < 2:
            raise ValueError(f"tokens_per_step must be >= 2, got {tokens_per_step}")
        too_long = [i for i, n in enumerate(piece_lengths) if n > tokens_per_step]
        if too_long:
            raise ValueError(f"piece {too_long[0]} has {piece_lengths[too_long[0]]} tokens, more than "
                             f"tokens_per_step={tokens_per_step}; split documents with split_documents")
        self.piece_lengths = [int(n) for n in piece_lengths]
        self.tokens_per_step = int(tokens_per_step)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.epoch = 0
        # Bin count is independent of the tie order, so it is computed once.
        self._num_batches = len(best_fit_decreasing(self.piece_lengths, range(len(self.piece_lengths)),
                                                    self.tokens_per_step))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def batches(self, epoch: int | None = None) -> list[list[int]]:
        """The batches of ``epoch`` (default: the current one), in the order they are yielded."""
        epoch = self.epoch if epoch is None else epoch
        n = len(self.piece_lengths)
        if not self.shuffle:
            bins = best_fit_decreasing(self.piece_lengths, range(n), self.tokens_per_step)
            return [sorted(b) for b in bins]
        g = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(n, generator=g).tolist()
        bins = best_fit_decreasing(self.piece_lengths, order, self.tokens_per_step)
        assert len(bins) == self._num_batches
        perm = torch.randperm(len(bins), generator=g).tolist()
        return [bins[i] for i in perm]

    def __iter__(self):
        return iter(self.batches())

    def __len__(self) -> int:
        return self._num_batches


class PieceDataset(Dataset):
    """Item ``i`` is piece ``i`` as ``{"input_ids": [...], "labels": [...]}`` (python ints)."""

    def __init__(self, token_dataset, pieces: Sequence[Piece]) -> None:
        self.token_dataset = token_dataset
        self.pieces = list(pieces)

    def __len__(self) -> int:
        return len(self.pieces)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        p = self.pieces[i]
        row = self.token_dataset[p.doc]
        item = {"input_ids": _as_list(row["input_ids"])[p.start:p.end]}
        labels = labels_of(row, p.doc)
        if labels is not None:
            item["labels"] = labels[p.start:p.end]
        return item


def _as_list(x) -> list[int]:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return [int(t) for t in x]


class GlobalBatchCollator:
    """Turns dataset items into the engine's global batch: a list of ``{"input_ids", "labels"}``.

    No padding: the pipeline packs and slices sequences itself.  Labels default to the inputs
    (the model shifts them); extra columns are dropped.
    """

    def __call__(self, items: list[dict[str, Any]]) -> list[dict[str, list[int]]]:
        batch = []
        for i, item in enumerate(items):
            if "input_ids" not in item:
                raise ValueError(f"item {i} of the batch has keys {sorted(item)}; it needs 'input_ids'")
            ids = _as_list(item["input_ids"])
            labels = _as_list(item["labels"]) if item.get("labels") is not None else list(ids)
            if len(labels) != len(ids):
                raise ValueError(f"item {i}: {len(ids)} input_ids but {len(labels)} labels")
            batch.append({"input_ids": ids, "labels": labels})
        return batch


def label_token_count(batch: Sequence[dict]) -> int:
    """Next-token targets in a global batch (labels after the shift, not -100)."""
    return sum(sum(1 for t in item.get("labels", item["input_ids"])[1:] if t != -100) for item in batch)


class GlobalBatchLoader(DataLoader):
    """A ``DataLoader`` over pieces whose ``set_epoch`` reaches the token-budget sampler.

    HF's Trainer calls ``set_epoch`` on the loader; a plain ``DataLoader`` has none.  When
    ``lookahead`` is set, it is called with every batch one batch before that batch is yielded
    (the first one right away), so its plan can be computed while the previous batch trains.
    """

    lookahead: Callable[[list[dict]], None] | None = None

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.batch_sampler, "set_epoch"):
            self.batch_sampler.set_epoch(epoch)

    def __iter__(self):
        it = super().__iter__()
        return it if self.lookahead is None else self._ahead(it, self.lookahead)

    @staticmethod
    def _ahead(it, lookahead):
        try:
            current = next(it)
        except StopIteration:
            return
        lookahead(current)
        for upcoming in it:
            lookahead(upcoming)
            yield current
            current = upcoming
        yield current


def build_global_batch_loader(token_dataset, *, tokens_per_step: int, max_length: int,
                              long_document_policy: str = "split", seed: int = 0, shuffle: bool = True,
                              num_workers: int = 0, pin_memory: bool = False) -> GlobalBatchLoader:
    """Loader yielding the same global batches on every rank (nothing is sharded).

    ``max_length``: the model's ``max_position_embeddings``; documents longer than it or than
    ``tokens_per_step`` are split or rejected (``long_document_policy``)."""
    limits = {"tokens_per_step": int(tokens_per_step), "max_position_embeddings": int(max_length)}
    pieces = split_documents(document_lengths(token_dataset), limits, long_document_policy)
    if not pieces:
        raise ValueError("the dataset has no document with at least 2 tokens; nothing to train on")
    sampler = TokenBudgetBatchSampler([p.length for p in pieces], tokens_per_step, seed=seed,
                                      shuffle=shuffle)
    return GlobalBatchLoader(PieceDataset(token_dataset, pieces), batch_sampler=sampler,
                             collate_fn=GlobalBatchCollator(), num_workers=num_workers,
                             pin_memory=pin_memory)
