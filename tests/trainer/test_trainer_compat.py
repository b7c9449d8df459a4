"""The trainer refuses transformers/TRL releases outside the tested range, loudly, at import."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from infinipipe_hf.trainer.compat import ALLOW_ENV, PRIVATE_CALLS, PRIVATE_OVERRIDES, TESTED, check_transformers


class _Trainer:
    pass


for _name in PRIVATE_OVERRIDES + PRIVATE_CALLS:
    setattr(_Trainer, _name, lambda self: None)


def test_tested_versions_pass_and_the_installed_one_is_tested():
    import transformers
    from transformers import Trainer

    for version in (TESTED[0] + ".0", "5.23.0", "5.23.0.dev0"):
        check_transformers(version, _Trainer, env={})
    check_transformers(transformers.__version__, Trainer, env={})  # what this install runs


@pytest.mark.parametrize("version", ["5.24.0", "6.0.0", "5.16.2", "4.57.1"])
def test_untested_version_fails_at_import_with_the_escape_hatch_named(version):
    with pytest.raises(ImportError, match=rf"transformers {version}.*{ALLOW_ENV}=1.*at that risk"):
        check_transformers(version, _Trainer, env={})
    with pytest.warns(RuntimeWarning, match="silently skip gradient clipping"):
        check_transformers(version, _Trainer, env={ALLOW_ENV: "1"})


def test_a_missing_overridden_method_fails_even_with_the_escape_hatch():
    class Renamed(_Trainer):
        _clip_grad_norm = None

    with pytest.raises(ImportError, match="no longer has _clip_grad_norm"):
        check_transformers("5.23.0", Renamed, env={ALLOW_ENV: "1"})


def test_setup_py_declares_the_same_range():
    from pathlib import Path

    setup = (Path(__file__).resolve().parents[2] / "setup.py").read_text()
    assert f'"transformers>={TESTED[0]},<{TESTED[1]}"' in setup
    from infinipipe_hf.trainer.sft.config import TRL_TESTED

    assert f'"trl>={TRL_TESTED[0]},<{TRL_TESTED[1]}"' in setup
