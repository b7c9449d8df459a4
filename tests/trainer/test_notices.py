"""Warnings of a multi-process job: shown on rank 0 only (or on every rank with its rank when it
is a fact of one rank), attributed to the user's line, never to generated code."""
from __future__ import annotations

import logging
import warnings

import pytest

from infinipipe_hf.trainer import notices


def _shown(fn) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    return list(seen)


def test_a_warning_shows_on_rank_0_only_pointing_at_the_caller(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    seen = _shown(lambda: notices.warn("hello"))
    assert [str(w.message) for w in seen] == ["hello"]
    assert seen[0].filename == __file__
    monkeypatch.setenv("RANK", "1")
    assert _shown(lambda: notices.warn("hello")) == []


def test_a_fact_of_one_rank_shows_on_every_rank_with_its_rank(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    seen = _shown(lambda: notices.warn("cannot see the cache", every_rank=True))
    assert [str(w.message) for w in seen] == ["rank 2: cannot see the cache"]


def test_an_argument_warning_points_at_the_users_line_not_generated_code(monkeypatch):
    pytest.importorskip("transformers")
    from infinipipe_hf.trainer.arguments import EPPTrainingArguments

    monkeypatch.setenv("RANK", "0")
    seen = _shown(lambda: EPPTrainingArguments(output_dir="/tmp/unused", per_device_train_batch_size=4,
                                               report_to=[]))
    ours = [w for w in seen if "per_device_train_batch_size=4 is ignored" in str(w.message)]
    assert len(ours) == 1
    assert ours[0].filename == __file__, ours[0].filename  # not '<string>' (the dataclass __init__)


def test_info_logs_on_rank_0_only(monkeypatch, caplog):
    logger = logging.getLogger("infinipipe_hf")
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.INFO, logger="infinipipe_hf"):
        monkeypatch.setenv("RANK", "1")
        notices.info("not here")
        monkeypatch.setenv("RANK", "0")
        notices.info("prepared train_dataset in 0.1 s")
        logger.propagate = True  # info() configures its own handler on first use
        notices.info("again")
    texts = [r.getMessage() for r in caplog.records if r.name == "infinipipe_hf"]
    assert "not here" not in texts and "again" in texts
