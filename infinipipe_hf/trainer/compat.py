"""The transformers versions ``EPPTrainer`` is tested with, enforced when the trainer is imported.

Design: ``EPPTrainer`` overrides private ``Trainer`` methods (``PRIVATE_OVERRIDES``): where the
model is wrapped, how gradients are clipped, how checkpoints are saved and loaded.  A transformers
release may rename or re-sign them without notice, and then the override is silently skipped or
called wrongly: training would run but clip, save or resume wrongly.  So the trainer refuses to
import outside the tested range (``TESTED``, the same bounds as ``setup.py``) and checks that every
overridden method still exists; ``INFINIPIPE_HF_ALLOW_UNTESTED_TRANSFORMERS=1`` turns the version
refusal into a warning that says what is at risk.  A missing method is always an error: an
override of nothing cannot work.  ``EPPSFTTrainer`` checks TRL the same way (it calls TRL's
dataset preparation, a private method of ``SFTTrainer``).

Trade-off: a newer transformers that would have worked is refused until the range is widened (and
the trainer tests rerun); that is the price of never mis-training quietly.
"""
from __future__ import annotations

import os
import re
import warnings

TESTED = ("5.17", "5.24")
"""``[lower, upper)`` bounds of transformers releases the trainer is tested with (5.23 on CPU CI,
5.17 on the GPU machine); ``setup.py`` declares the same range."""

ALLOW_ENV = "INFINIPIPE_HF_ALLOW_UNTESTED_TRANSFORMERS"

PRIVATE_OVERRIDES = ("_wrap_model", "_track_num_input_tokens", "_clip_grad_norm", "_get_grad_norm",
                     "_save_checkpoint", "_save_optimizer_and_scheduler", "_load_from_checkpoint",
                     "_load_optimizer_and_scheduler", "_load_best_model")
"""Private ``Trainer`` methods ``EPPTrainer`` overrides."""

PRIVATE_CALLS = ("_save_scaler", "_save_rng_state", "_push_from_checkpoint", "_get_output_dir")
"""Private ``Trainer`` methods ``EPPTrainer`` calls (its checkpoint save runs HF's steps)."""


def _release(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        raise ValueError(f"cannot read the transformers version {version!r}")
    return int(m.group(1)), int(m.group(2))


def check_tested_range(package: str, version: str, tested: tuple[str, str], risk: str,
                       env: dict[str, str] | None = None) -> None:
    """Return inside ``[tested[0], tested[1])``; outside it raise ImportError naming ``risk``, or
    warn when the escape hatch ``INFINIPIPE_HF_ALLOW_UNTESTED_TRANSFORMERS`` is set."""
    env = os.environ if env is None else env
    if _release(tested[0]) <= _release(version) < _release(tested[1]):
        return
    risk = f"{risk}; it is tested with {package}>={tested[0]},<{tested[1]}, this is {package} {version}"
    if env.get(ALLOW_ENV, "") not in ("", "0"):
        warnings.warn(f"{risk} ({ALLOW_ENV} is set, continuing at that risk)", RuntimeWarning,
                      stacklevel=3)
        return
    raise ImportError(f"{risk}. Install a tested version (pip install '{package}>={tested[0]},"
                      f"<{tested[1]}'), or set {ALLOW_ENV}=1 to run anyway at that risk")


def check_transformers(version: str, trainer_cls: type, env: dict[str, str] | None = None) -> None:
    """ImportError outside the tested range (a warning with the escape hatch); ImportError when
    an overridden private method no longer exists on ``trainer_cls``."""
    missing = [name for name in PRIVATE_OVERRIDES + PRIVATE_CALLS
               if not callable(getattr(trainer_cls, name, None))]
    if missing:
        raise ImportError(f"transformers {version}: Trainer no longer has {', '.join(missing)}, which "
                          f"EPPTrainer overrides or calls; use transformers>={TESTED[0]},<{TESTED[1]}")
    check_tested_range("transformers", version, TESTED, (
        f"EPPTrainer overrides private Trainer methods ({', '.join(PRIVATE_OVERRIDES)}): with an "
        f"untested transformers a changed method can silently skip gradient clipping, mis-save "
        f"checkpoints or resume wrongly"), env)
