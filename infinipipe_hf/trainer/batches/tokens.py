"""Token datasets: ``input_ids`` (and maybe ``labels``) per document, from whatever the user passed.

``prepare_token_dataset`` accepts an ``input_ids`` column (optionally ``labels``; an
``attention_mask`` means padded data, whose masked tokens are dropped) or a ``text`` column plus a
tokenizer, else it raises.  Without ``labels``, TRL's mask columns (``completion_mask``,
``assistant_masks``: 1 = train on this token) become the labels the way TRL builds them; with
``labels`` they are ignored, with a warning.
"""
from __future__ import annotations

import torch

from infinipipe_hf.trainer import notices

MASK_COLUMNS = ("completion_mask", "assistant_masks")
"""TRL's per-token loss masks (1: the token is trained), folded into labels when there are none."""


def _column_names(dataset) -> list[str]:
    names = getattr(dataset, "column_names", None)
    if names is not None:
        return list(names)
    if len(dataset) == 0:
        return []
    first = dataset[0]
    return list(first.keys()) if isinstance(first, dict) else []


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
        notices.warn(f"{what} has a 'labels' column and {', '.join(masks)}: the labels decide which "
                     f"tokens are trained and {', '.join(masks)} is ignored; drop 'labels' to train "
                     f"by the mask instead")
    if "input_ids" in cols:
        if "attention_mask" in cols and hasattr(dataset, "map"):
            return dataset.map(_strip_padding, batched=True, remove_columns=["attention_mask"],
                               desc="Removing padding")
        return dataset
    if "text" in cols:
        return _tokenize_text(dataset, tokenizer, cols, add_eos, what)
    raise ValueError(f"{what} has columns {cols} but EPPTrainer needs token ids: an 'input_ids' "
                     f"column (optionally 'labels'), or a 'text' column plus a tokenizer "
                     f"(processing_class=...)")


def _tokenize_text(dataset, tokenizer, cols: list[str], add_eos: bool, what: str):
    """A ``text`` dataset tokenized once with ``datasets.map``."""
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
    ids = as_list(row["input_ids"])
    if row.get("labels") is not None:
        labels = as_list(row["labels"])
        if len(labels) != len(ids):
            raise ValueError(f"document {doc} has {len(ids)} input_ids but {len(labels)} labels; "
                             f"labels must align with input_ids (use -100 for ignored positions)")
        return labels
    masks = [(c, as_list(row[c])) for c in MASK_COLUMNS if row.get(c) is not None]
    if not masks:
        return None
    for name, mask in masks:
        if len(mask) != len(ids):
            raise ValueError(f"document {doc} has {len(ids)} input_ids but {len(mask)} {name} entries; "
                             f"{name} must have one 0/1 entry per token")
    return [t if all(m[i] for _, m in masks) else -100 for i, t in enumerate(ids)]


def dataset_lengths(dataset) -> list[int]:
    """Token count of every document (reads only the ``input_ids`` column when it can)."""
    if hasattr(dataset, "column_names") and hasattr(dataset, "select_columns"):
        return [len(x) for x in dataset.select_columns(["input_ids"])["input_ids"]]
    return [len(dataset[i]["input_ids"]) for i in range(len(dataset))]


def as_list(x) -> list[int]:
    """Token ids as a list of python ints (from a tensor or any sequence)."""
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return [int(t) for t in x]
