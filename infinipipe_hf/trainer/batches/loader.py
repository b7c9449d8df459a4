"""The global batch loader: pieces -> unpadded global batches, the same on every rank.

Nothing is sharded: every rank yields the whole global batch, which holds work for every DP
replica (the sampler's replica shares) and which the pipeline plans and deals to the replicas.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from torch.utils.data import DataLoader, Dataset

from infinipipe_hf.trainer.batches.pieces import Piece, split_documents
from infinipipe_hf.trainer.batches.sampler import TokenBudgetBatchSampler
from infinipipe_hf.trainer.batches.tokens import as_list, dataset_lengths, labels_of


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
        item = {"input_ids": as_list(row["input_ids"])[p.start:p.end]}
        labels = labels_of(row, p.doc)
        if labels is not None:
            item["labels"] = labels[p.start:p.end]
        return item


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
            ids = as_list(item["input_ids"])
            labels = as_list(item["labels"]) if item.get("labels") is not None else list(ids)
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
                              num_workers: int = 0, pin_memory: bool = False, dp_degree: int = 1,
                              what: str = "the dataset") -> GlobalBatchLoader:
    """Loader yielding the same global batches on every rank (nothing is sharded).

    ``max_length``: the model's ``max_position_embeddings``; documents longer than it or than
    ``tokens_per_step`` are split or rejected (``long_document_policy``).  ``dp_degree``: each
    global batch feeds that many replicas (:class:`TokenBudgetBatchSampler`)."""
    limits = {"tokens_per_step": int(tokens_per_step), "max_position_embeddings": int(max_length)}
    pieces = split_documents(dataset_lengths(token_dataset), limits, long_document_policy, what)
    if not pieces:
        raise ValueError(f"{what} has no document with at least 2 tokens; nothing to train on")
    sampler = TokenBudgetBatchSampler([p.length for p in pieces], tokens_per_step, dp_degree=dp_degree,
                                      seed=seed, shuffle=shuffle, what=what)
    return GlobalBatchLoader(PieceDataset(token_dataset, pieces), batch_sampler=sampler,
                             collate_fn=GlobalBatchCollator(), num_workers=num_workers,
                             pin_memory=pin_memory)
