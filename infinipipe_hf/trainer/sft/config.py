"""``EPPSFTConfig``: TRL's ``SFTConfig`` with the pipeline's fields, for ``EPPSFTTrainer``.

Design: the class inherits both ``EPPTrainingArguments`` (every ``InfiniPipeConfig`` setting,
``tokens_per_step``, the Trainer-argument checks) and TRL's ``SFTConfig`` (dataset formats,
``max_length``, ``completion_only_loss``, ``assistant_only_loss``, ``chat_template_path``...), so
a TRL script swaps ``SFTConfig`` -> ``EPPSFTConfig`` and adds ``pp_degree``; ``HfArgumentParser``
parses both sets of flags.  Defaults stay TRL's (``learning_rate=2e-5``, ``bf16`` on unless
``fp16``, ``max_length=1024`` truncation) except ``gradient_checkpointing``, which is off: the
pipeline's ``checkpointing`` setting picks the recomputed layers per stage and unit, and HF's
checkpointing of the whole model would be ignored with a warning on every run.

SFT settings the pipeline does not use are refused or warned about by ``EPPSFTTrainer`` (it sees
the model and data), not here.  Trade-off: TRL is an optional dependency (``pip install
infinipipe_hf[sft]``), imported when this module is.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from transformers import TrainingArguments

try:
    import trl
    from trl import SFTConfig
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("EPPSFTConfig/EPPSFTTrainer need TRL: pip install 'infinipipe_hf[sft]' "
                      "(trl>=1.16,<1.17)") from exc

from infinipipe_hf.trainer.arguments import EPPTrainingArguments
from infinipipe_hf.trainer.compat import check_tested_range
from infinipipe_hf.trainer.pipeline_arguments import PipelineArguments

TRL_TESTED = ("1.16", "1.17")
"""``[lower, upper)`` TRL releases ``EPPSFTTrainer`` is tested with (it calls TRL's dataset
preparation, ``SFTTrainer._prepare_dataset``); ``setup.py``'s ``sft`` extra pins the same."""

check_tested_range("trl", trl.__version__, TRL_TESTED, (
    "EPPSFTTrainer prepares datasets with TRL's private SFTTrainer._prepare_dataset: with an "
    "untested TRL the tokens or loss masks may silently differ from what SFTTrainer trains on"))

_overlap = ({f.name for f in dataclasses.fields(PipelineArguments)}
            & {f.name for f in dataclasses.fields(SFTConfig)})
if _overlap:  # a later SFTConfig field would silently shadow a pipeline setting (or vice versa)
    raise TypeError(f"SFTConfig and the pipeline arguments both define {sorted(_overlap)}; rename "
                    f"the pipeline field in infinipipe_hf.trainer.pipeline_arguments.RENAMED")


def _trl_defaults(cls: type) -> type:
    """Re-declare on ``cls`` the ``TrainingArguments`` fields whose default ``SFTConfig`` changes
    (``learning_rate``, ``bf16``, ``logging_steps``...): ``EPPTrainingArguments`` carries the
    Trainer's own defaults for them, which come later in the MRO and would hide TRL's."""
    base = TrainingArguments.__dataclass_fields__
    ours = {n for n, f in EPPTrainingArguments.__dataclass_fields__.items() if f is not base.get(n)}
    hints = typing.get_type_hints(SFTConfig)
    annotations = cls.__dict__.get("__annotations__", {})
    for name, f in SFTConfig.__dataclass_fields__.items():
        if name not in base or f is base[name] or name in ours or name in annotations:
            continue
        kw = {"metadata": f.metadata}
        if f.default is not dataclasses.MISSING:
            kw["default"] = f.default
        else:
            kw["default_factory"] = f.default_factory
        annotations[name] = hints[name]
        setattr(cls, name, field(**kw))
    cls.__annotations__ = annotations
    return cls


@dataclass
@_trl_defaults
class EPPSFTConfig(EPPTrainingArguments, SFTConfig):
    """``trl.SFTConfig`` plus every pipeline setting (``pp_degree``, ``tokens_per_step``...)."""

    gradient_checkpointing: bool | None = field(default=None, metadata={
        "help": "Ignored by EPPSFTTrainer (default off): use --checkpointing adaptive|none|full."})
    """Off by default (TRL turns it on): the pipeline's ``checkpointing`` decides what is
    recomputed; ``True`` is ignored with a warning.  (``None``, transformers' own default, reads
    as off without its deprecation warning for the old name.)"""
