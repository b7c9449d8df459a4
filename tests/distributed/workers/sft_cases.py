"""EPPSFTTrainer under torchrun: ``sft_cases.py REF_DIR OUT_DIR`` (2 ranks, pp 2).

The references (TRL's SFTTrainer, one process) were written to REF_DIR by the test process:
``<kind>.json`` (step losses) and ``<kind>.safetensors`` (trained weights).  Prints
``CASE <name> OK`` per passed case and ``ALL OK``; any failure raises (non-zero exit).
"""
from __future__ import annotations

import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from tests.helpers import sft

warnings.filterwarnings("ignore")
KINDS = ["prompt_completion", "messages_assistant_only"]
"""The formats run here (the test imports them: the arguments are read only when run)."""


def case(kind: str, ref_dir: str, out_dir: str) -> None:
    t0 = time.time()
    with open(os.path.join(ref_dir, f"{kind}.json")) as fh:
        ref_losses = json.load(fh)["losses"]
    ref_w = load_file(os.path.join(ref_dir, f"{kind}.safetensors"))
    tr = sft.epp_sft(kind, os.path.join(out_dir, kind), pp=2)
    tr.train()
    assert len(tr.micro_losses) == len(ref_losses), (tr.micro_losses, ref_losses)
    worst = max(abs(a - b) / abs(b) for a, b in zip(tr.micro_losses, ref_losses))
    assert worst <= 2e-6, (tr.micro_losses, ref_losses)  # TRL's float32 log-probs: see test_sft_world1
    for name, p in tr.engine.named_parameters():
        torch.testing.assert_close(p.detach(), ref_w[name], rtol=1e-5, atol=1e-7, msg=name)
    print(f"[rank {dist.get_rank()}] CASE pp2_{kind} OK loss_rel={worst:.1e} {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    for kind in KINDS:
        case(kind, *sys.argv[1:3])
    print(f"[rank {dist.get_rank()}] ALL OK", flush=True)
