"""Builds an EPPTrainer with ``pp_degree`` from argv; run by a launcher to see what it started."""
from __future__ import annotations

import sys
import tempfile

from infinipipe_hf import EPPTrainer, EPPTrainingArguments
from tests.distributed.workers.trainer_common import token_dataset
from tests.helpers.reference import tiny_model

args = EPPTrainingArguments(output_dir=tempfile.mkdtemp(), pp_degree=int(sys.argv[1]), report_to=[],
                            use_cpu=True, max_steps=1)
EPPTrainer(model=tiny_model("llama", num_layers=2), args=args, train_dataset=token_dataset())
print("CONSTRUCTED", flush=True)
