"""HF's own ways to ask for parallelism, on ``EPPTrainingArguments``: mapped onto the pipeline's
layout, or refused before transformers acts on them.

Design: accelerate >= 1.12 takes a ``ParallelismConfig`` as ``TrainingArguments.parallelism_config``
(or from ``accelerate launch``'s ``--parallelism_config_*`` flags, which reach the process as
``PARALLELISM_CONFIG_*`` environment variables).  Its sizes describe a world without pipeline
stages; here the world is dp x pp x sp (``infinipipe_hf.layout``), so the DP sizes count replicas of the whole
pipeline.  The mapping (also in docs/trainer.md):

================================================ ==============================================
``ParallelismConfig``                            ``EPPTrainingArguments``
================================================ ==============================================
``sp_size=S``                                    ``sp_degree=S`` (Ulysses inside each stage)
``dp_replicate_size=R`` (``dp_shard_size=1``)    ``dp_degree=R``; states replicated over DP
``dp_shard_size=N`` (``dp_replicate_size=1``)    ``dp_degree=N``, ``shard="dp"`` (FSDP over the
                                                 replicas); ``"sp+dp"`` with ``sp_size > 1``
                                                 (ZeRO-3 over every rank of a stage, as
                                                 DeepSpeed shards Ulysses' ranks)
both DP sizes > 1 (HSDP)                         refused: no shard group inside the replicas
``cp_size > 1``                                  refused: use ``sp_size``/``sp_degree``
``tp_size > 1``                                  refused: ``pp_degree`` splits the model
================================================ ==============================================

An explicit ``sp_degree``/``dp_degree``/``shard`` that says otherwise is a ``ValueError`` naming
both; a ``shard`` that agrees in kind (it shards over DP where ``dp_shard_size`` asks for it) is
kept.  After mapping, ``parallelism_config`` is set to ``None`` and accelerate's environment switch
turned off: ``Trainer`` would otherwise hand it to ``Accelerator``, which builds its own device
mesh (and DeepSpeed's SP groups) over the processes the pipeline already lays out.

``deepspeed=`` (or ``accelerate launch --use_deepspeed``) is refused here, before
``TrainingArguments.__post_init__`` imports DeepSpeed.
"""
from __future__ import annotations

import os
from typing import Any

from infinipipe_hf.layout import shard_mode, sharding_over
from infinipipe_hf.trainer import notices

ENV_SWITCH = "ACCELERATE_USE_PARALLELISM_CONFIG"
"""Environment variable with which ``accelerate launch`` tells ``Accelerator`` to build a
``ParallelismConfig`` from ``PARALLELISM_CONFIG_*``."""
DEEPSPEED_REFUSAL = ("deepspeed cannot be combined with EPPTrainer: the pipeline already splits the "
                     "model across processes and does data parallelism itself; remove deepspeed (and "
                     "accelerate launch's --use_deepspeed) and use pp_degree, with shard='dp' or "
                     "'sp+dp' for ZeRO-3-style sharding of each stage's states")


def refuse_deepspeed(args) -> None:
    """``ValueError`` for ``deepspeed=...`` or ``ACCELERATE_USE_DEEPSPEED=true``, raised before
    ``TrainingArguments`` imports DeepSpeed (which would fail first where it is not installed)."""
    if args.deepspeed:
        raise ValueError(f"deepspeed={args.deepspeed!r}: {DEEPSPEED_REFUSAL}")
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true", "yes"):
        raise ValueError(f"ACCELERATE_USE_DEEPSPEED=true (accelerate launch --use_deepspeed): {DEEPSPEED_REFUSAL}")


def given_parallelism_config(args) -> Any:
    """The ``ParallelismConfig`` asked for: the argument (an instance or a dict of its fields),
    else the one ``accelerate launch`` put in the environment; ``None`` when neither."""
    pc = args.parallelism_config
    if pc is None and os.environ.get(ENV_SWITCH, "false").lower() == "true":
        from accelerate import ParallelismConfig

        return ParallelismConfig()  # reads PARALLELISM_CONFIG_*
    if isinstance(pc, dict):
        from accelerate import ParallelismConfig

        return ParallelismConfig(**pc)
    if pc is not None and not hasattr(pc, "sp_size"):
        raise ValueError(f"parallelism_config must be an accelerate ParallelismConfig or a dict of its "
                         f"fields, got {type(pc).__name__}")
    return pc


def mapped_fields(pc) -> dict[str, Any]:
    """The pipeline fields ``pc`` sets (module docstring); ``ValueError`` for what has no meaning here."""
    if pc.tp_size > 1:
        raise ValueError(f"parallelism_config.tp_size={pc.tp_size}: tensor parallelism is not available "
                         f"in EPPTrainer, which splits the model into pipeline stages; set tp_size=1 and "
                         f"use pp_degree (and shard to split each stage's states)")
    if pc.cp_size > 1:
        raise ValueError(f"parallelism_config.cp_size={pc.cp_size}: context parallelism (ring attention) is "
                         f"not available in EPPTrainer; a stage splits each unit's tokens over its ranks with "
                         f"Ulysses sequence parallelism instead: set sp_size={pc.cp_size} in parallelism_config "
                         f"(or sp_degree={pc.cp_size}) and cp_size=1")
    replicate, shard, sp = pc.dp_replicate_size, pc.dp_shard_size, pc.sp_size
    if replicate > 1 and shard > 1:
        raise ValueError(
            f"parallelism_config.dp_replicate_size={replicate} with dp_shard_size={shard} (HSDP) has no "
            f"equivalent here: a stage's states shard over all of its DP replicas or over its SP group; "
            f"use dp_shard_size={replicate * shard} (shard='dp' over {replicate * shard} replicas), or "
            f"dp_replicate_size={replicate} with sp_size={shard} and shard='hybrid' (shard over SP, "
            f"replicate over DP)")
    out: dict[str, Any] = {}
    if sp > 1:
        out["sp_degree"] = sp
    if replicate > 1:
        out["dp_degree"] = replicate
    elif shard > 1:
        out.update(dp_degree=shard, shard=sharding_over(("dp", "sp") if sp > 1 else ("dp",)).name)
    return out


def apply_parallelism_config(args) -> None:
    """Map ``args.parallelism_config`` onto ``sp_degree``/``dp_degree``/``shard`` (checked against
    explicit values), warn about its settings that do not apply, and switch accelerate's off."""
    pc = given_parallelism_config(args)
    if pc is None:
        return
    fields = mapped_fields(pc)
    _check_against_explicit(args, pc, fields)
    _warn_ignored(pc)
    for name, value in fields.items():
        setattr(args, name, value)
    # Mapped: Trainer must not hand it (or accelerate launch's copy in the environment) to
    # Accelerator, whose device mesh and DeepSpeed SP groups would fight the pipeline's layout.
    args.parallelism_config = None
    if os.environ.get(ENV_SWITCH):
        os.environ[ENV_SWITCH] = "false"


def _check_against_explicit(args, pc, fields: dict[str, Any]) -> None:
    from infinipipe_hf.trainer.auto_layout import is_auto

    replicate, shard = pc.dp_replicate_size, pc.dp_shard_size
    if is_auto(args) and "dp_degree" in fields:
        raise ValueError(f"pp_degree='auto' chooses the DP degree, so parallelism_config cannot set it "
                         f"(dp_replicate_size={replicate}, dp_shard_size={shard}); set both to 1 (shard='dp' "
                         f"restricts the search to sharding over DP)")
    if "sp_degree" in fields and args.sp_degree not in (1, fields["sp_degree"]):
        raise ValueError(f"parallelism_config.sp_size={pc.sp_size} and sp_degree={args.sp_degree!r} disagree; "
                         f"set one of them")
    if "dp_degree" in fields and args.dp_degree not in (None, fields["dp_degree"]):
        size = "dp_replicate_size" if replicate > 1 else "dp_shard_size"
        raise ValueError(f"parallelism_config.{size}={fields['dp_degree']} and dp_degree={args.dp_degree!r} "
                         f"disagree; set one of them")
    if args.shard == "auto":  # without pp_degree='auto': its own error follows (check_auto_fields)
        fields.pop("shard", None)
    mode = None if args.shard == "auto" else shard_mode(args.shard)
    if mode is None or not mode.sharded or "dp_degree" not in fields:
        return
    over_dp = "dp" in mode.shard_dims
    if replicate > 1 and over_dp:
        raise ValueError(f"parallelism_config.dp_replicate_size={replicate} replicates the states over DP, but "
                         f"shard={args.shard!r} shards them over DP; use dp_shard_size={replicate} instead, or a "
                         f"shard that keeps DP replicas ('none', 'sp', 'hybrid')")
    if shard > 1 and not over_dp:
        raise ValueError(f"parallelism_config.dp_shard_size={shard} shards the states over DP, but "
                         f"shard={args.shard!r} does not; set shard='dp' or 'sp+dp', or use "
                         f"dp_replicate_size={shard} for replicas")
    if shard > 1:
        fields.pop("shard")  # an explicit DP-sharding mode refines dp_shard_size: kept


def _warn_ignored(pc) -> None:
    handler = getattr(pc, "sp_handler", None)
    if pc.sp_size > 1 and handler is not None:
        set_ = {k: getattr(handler, k, None) for k in ("sp_seq_length", "sp_attn_implementation")}
        set_ = {k: v for k, v in set_.items() if v is not None}
        if getattr(handler, "sp_seq_length_is_variable", True) is False:
            set_["sp_seq_length_is_variable"] = False
        if set_:
            notices.warn(f"parallelism_config.sp_handler settings {set_} are ignored: EPPTrainer runs its own "
                         f"Ulysses sequence parallelism inside each stage, for every sequence length, with "
                         f"the attention kernel attention_backend chooses")
