"""The trainer's data path: token columns, long-document pieces, the token-budget sampler, collator."""
from __future__ import annotations

import random
import warnings

import pytest

datasets = pytest.importorskip("datasets")
torch = pytest.importorskip("torch")

from infinipipe_hf.planner.batch.packing import best_fit_decreasing
from infinipipe_hf.trainer.batches.loader import GlobalBatchCollator, build_global_batch_loader, label_token_count
from infinipipe_hf.trainer.batches.pieces import Piece, split_documents
from infinipipe_hf.trainer.batches.sampler import TokenBudgetBatchSampler
from infinipipe_hf.trainer.batches.tokens import prepare_token_dataset
from tests.helpers.char_tokenizer import char_tokenizer


def _lengths(n=200, seed=0):
    rng = random.Random(seed)
    # long-tailed: mostly short, a few long
    return [max(1, int(rng.paretovariate(1.2) * 20)) for _ in range(n)]


# --- pieces ----------------------------------------------------------------------------------
def test_split_documents_covers_every_token_once_and_respects_limit():
    lengths = _lengths()
    limit = 64
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pieces = split_documents(lengths, limit, "split")
    covered = {d: [] for d in range(len(lengths))}
    for p in pieces:
        assert 2 <= p.length <= limit or (p.length <= limit and lengths[p.doc] > limit)
        covered[p.doc].append((p.start, p.end))
    for d, n in enumerate(lengths):
        spans = sorted(covered[d])
        if n < 2:
            assert spans == []  # no next-token target: skipped
            continue
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), spans
        sizes = [b - a for a, b in spans]
        assert max(sizes) - min(sizes) <= 1, sizes  # near-equal pieces
        assert len(spans) == -(-n // limit)


def test_split_documents_reject_names_document_and_fix():
    with pytest.raises(ValueError, match=r"document 2 has 100 tokens.*limit of 50.*long_document_policy='split'"):
        split_documents([10, 20, 100], 50, "reject")


def test_short_documents_are_skipped_with_a_warning():
    with pytest.warns(UserWarning, match="2 document"):
        pieces = split_documents([1, 5, 0, 3], 10)
    assert [p.doc for p in pieces] == [1, 3]


def test_piece_checks_its_range():
    with pytest.raises(ValueError, match="start < end"):
        Piece(0, 5, 5)


# --- packing and the sampler -----------------------------------------------------------------
def test_best_fit_decreasing_respects_budget_and_count_is_order_independent():
    lengths = [min(n, 100) for n in _lengths(300, seed=1)]
    counts = set()
    for seed in range(5):
        order = list(range(len(lengths)))
        random.Random(seed).shuffle(order)
        bins = best_fit_decreasing(lengths, order, 100)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= 100 for b in bins)
        counts.add(len(bins))
    assert len(counts) == 1
    # close to the lower bound: length-aware packing fills the budget
    assert counts.pop() <= sum(lengths) / 100 * 1.15 + 1


def test_sampler_trains_every_token_of_an_epoch_exactly_once_per_epoch():
    lengths = [min(n, 128) for n in _lengths(150, seed=2)]
    sampler = TokenBudgetBatchSampler(lengths, 128, seed=3)
    epochs = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(len(lengths)))  # every piece (so every token) once
        assert all(sum(lengths[i] for i in b) <= 128 for b in batches)
        epochs.append(batches)
    sampler.set_epoch(1)
    assert list(sampler) == epochs[1]  # deterministic per (seed, epoch)
    assert epochs[0] != epochs[1]  # reshuffled across epochs
    other = TokenBudgetBatchSampler(lengths, 128, seed=4)
    assert list(other) != epochs[0]


def test_sampler_without_shuffle_is_stable():
    lengths = [5, 9, 3, 7, 2, 8]
    a = TokenBudgetBatchSampler(lengths, 12, shuffle=False)
    a.set_epoch(5)
    assert list(a) == list(TokenBudgetBatchSampler(lengths, 12, shuffle=False))


def test_sampler_rejects_a_piece_over_the_budget():
    with pytest.raises(ValueError, match="more than tokens_per_step=10"):
        TokenBudgetBatchSampler([4, 11], 10)


# --- datasets and the loader -----------------------------------------------------------------
def _docs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50, (n,), generator=g).tolist() for n in lengths]


def test_loader_reconstructs_every_document_and_yields_global_batches():
    lengths = [3, 70, 12, 1, 40, 25, 9, 130]
    docs = _docs(lengths)
    labels = [[-100] + d[1:] for d in docs]
    ds = datasets.Dataset.from_dict({"input_ids": docs, "labels": labels})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loader = build_global_batch_loader(ds, tokens_per_step=64, max_length=4096, seed=1)
    loader.set_epoch(2)
    seen_ids, seen_labels = [], []
    for batch in loader:
        assert isinstance(batch, list) and sum(len(x["input_ids"]) for x in batch) <= 64
        for x in batch:
            assert set(x) == {"input_ids", "labels"} and len(x["input_ids"]) == len(x["labels"])
            seen_ids.append(x["input_ids"])
            seen_labels.append(x["labels"])
    # every trainable document's tokens appear exactly once; long ones as in-order slices
    assert sorted(t for s in seen_ids for t in s) == sorted(t for d in docs if len(d) >= 2 for t in d)
    assert sum(len(s) for s in seen_ids) == sum(n for n in lengths if n >= 2)
    long_doc = docs[7]
    parts = sorted((next(i for i in range(len(long_doc)) if long_doc[i:i + len(s)] == s), s)
                   for s in seen_ids if len(s) > 2 and _is_slice_of(s, long_doc))
    assert [t for _, s in parts for t in s] == long_doc and len(parts) == 3
    assert sum(sum(1 for t in s if t == -100) for s in seen_labels) == sum(1 for n in lengths if n >= 2)


def _is_slice_of(s, d):
    return any(d[i:i + len(s)] == s for i in range(len(d) - len(s) + 1))


def test_loader_limit_is_model_positions_when_smaller():
    ds = datasets.Dataset.from_dict({"input_ids": _docs([50])})
    with pytest.warns(UserWarning, match=r"longer than max_position_embeddings=20 .* to keep them whole, the "
                                         r"model cannot attend over more positions"):
        loader = build_global_batch_loader(ds, tokens_per_step=64, max_length=20, long_document_policy="split")
    assert sorted(len(x["input_ids"]) for b in loader for x in b) == [16, 17, 17]
    with pytest.raises(ValueError, match="document 0 has 50 tokens"):
        build_global_batch_loader(ds, tokens_per_step=64, max_length=20, long_document_policy="reject")


def test_text_dataset_is_tokenized_with_eos():
    tok = char_tokenizer()
    ds = datasets.Dataset.from_dict({"text": ["abc", "hello world"], "meta": [1, 2]})
    out = prepare_token_dataset(ds, tok)
    assert out.column_names == ["input_ids"]
    assert out[0]["input_ids"][-1] == tok.eos_token_id and len(out[0]["input_ids"]) == 4
    assert len(out[1]["input_ids"]) == len("hello world") + 1


def test_dataset_without_token_ids_is_a_clear_error():
    ds = datasets.Dataset.from_dict({"question": ["a"], "answer": ["b"]})
    with pytest.raises(ValueError, match=r"columns \['question', 'answer'\].*'input_ids'.*'text'"):
        prepare_token_dataset(ds)
    with pytest.raises(ValueError, match="'text' column but no tokenizer"):
        prepare_token_dataset(datasets.Dataset.from_dict({"text": ["a"]}))


def test_token_dataset_passes_through_and_plain_lists_work():
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]]})
    assert prepare_token_dataset(ds) is ds
    plain = [{"input_ids": [1, 2, 3, 4]}, {"input_ids": [5, 6]}]
    loader = build_global_batch_loader(prepare_token_dataset(plain), tokens_per_step=8, max_length=100)
    assert sorted(len(x["input_ids"]) for b in loader for x in b) == [2, 4]


def test_padded_dataset_loses_its_padding():
    ds = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7, 0, 0], [8, 9, 0, 0, 0]],
                                     "attention_mask": [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]],
                                     "labels": [[-100, 6, 7, -100, -100], [8, 9, -100, -100, -100]]})
    out = prepare_token_dataset(ds)
    assert out["input_ids"] == [[5, 6, 7], [8, 9]] and out["labels"] == [[-100, 6, 7], [8, 9]]
    assert "attention_mask" not in out.column_names


def test_collator_defaults_labels_and_checks_alignment():
    c = GlobalBatchCollator()
    batch = c([{"input_ids": torch.tensor([1, 2, 3]), "attention_mask": [1, 1, 1]}])
    assert batch == [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}]
    assert label_token_count(batch) == 2
    with pytest.raises(ValueError, match="3 input_ids but 2 labels"):
        c([{"input_ids": [1, 2, 3], "labels": [1, 2]}])
    with pytest.raises(ValueError, match="needs 'input_ids'"):
        c([{"text": "x"}])
