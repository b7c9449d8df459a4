"""Memory of one unit per rank at sp 2 against sp 1: bytes saved for backward and KV store bytes.

``sp_memory.py [OUT.json]`` on 2 ranks (gloo, float32).  Each rank runs the same units twice:
through a plain ``StageRunner`` (sp 1, no communication) and through its ``PipelineEngine``'s SP
runner (sp 2, its half of every unit's tokens), both on the same Llama-shaped model (hidden 256,
8 heads, 4 K/V heads, 4 layers, pp 1).  While a unit's forward runs, ``saved_tensors_hooks``
record every tensor autograd saves; distinct storages count once and parameters not at all
(the counting of ``tests/runtime/test_memory_model_vs_runtime.py``); a checkpointed layer counts
its kept inputs.  The KV store is measured after the first slice's forward (its K/V are kept for
the second slice), by ``KVStore.bytes()`` and by the storages its leaves really hold.
Prints ``MEM <json>`` per measurement and ``ALL OK``.
"""
from __future__ import annotations

import copy
import json
import sys

from common import InfiniPipeConfig, PipelineEngine, dist, init, log, saved_bytes, storage_key, torch

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Segment, Unit
from infinipipe_hf.runtime.stage.module import build_stage
from infinipipe_hf.runtime.stage.runner import StageRunner

T = 512
VOCAB = 512


def model():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688,
                                   num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                   max_position_embeddings=4096)
    return transformers.LlamaForCausalLM(cfg).float()


def kv_storage_bytes(store) -> int:
    keys = {}
    for per_seq in store._entries.values():
        for e in per_seq.values():
            for t in (e.k, e.v):
                keys[storage_key(t)] = storage_key(t)[1]
    return int(sum(keys.values()))


def plan_for(checkpointed: int) -> Plan:
    units = [Unit(0, (Segment(0, 0, T),)), Unit(1, (Segment(0, T, 2 * T),))]
    acts = [Action("F", 0), Action("F", 1), Action("B", 1), Action("B", 0)]
    return Plan("epp", 1, 1, [2 * T], units, {0: [acts]}, {0: {0: checkpointed, 1: checkpointed}}, [4])


def measure(runner: StageRunner, checkpointed: int, batch) -> dict:
    runner.begin_step(plan_for(checkpointed), batch, 2 * T - 1)
    params = list(runner.stage.parameters())
    first = saved_bytes(lambda: runner.forward(0, None), params)
    kv = runner.kv_store.bytes()
    kv_storage = kv_storage_bytes(runner.kv_store)
    second = saved_bytes(lambda: runner.forward(1, None), params)
    runner.backward(1, None)
    runner.backward(0, None)
    runner.end_step()
    return {"first_slice_saved_bytes": first, "second_slice_saved_bytes": second,
            "kv_store_bytes": kv, "kv_store_storage_bytes": kv_storage}


def main() -> None:
    init()
    g = torch.Generator().manual_seed(1)
    batch = [{"input_ids": torch.randint(0, VOCAB, (2 * T,), generator=g).tolist()}]
    base = model()
    plain = StageRunner(build_stage(copy.deepcopy(base), 0, range(4)), loss_chunk_tokens=128)
    engine = PipelineEngine(copy.deepcopy(base), InfiniPipeConfig(sp_degree=2, loss_chunk_tokens=128,
                                                                  p2p_timeout_s=120))
    results = []
    for checkpointed in (0, 2):
        one = measure(plain, checkpointed, batch)
        two = measure(engine.runner, checkpointed, batch)
        row = {"checkpointed_layers": checkpointed, "tokens_per_slice": T, "sp1": one, "sp2": two,
               "ratio": {k: two[k] / one[k] for k in one}}
        results.append(row)
        log("MEM " + json.dumps(row))
    if len(sys.argv) > 1 and dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({"what": "bytes per rank, sp 2 vs sp 1 (same units, float32, gloo)",
                       "model": "Llama hidden 256, 8 heads, 4 K/V heads, 4 layers, vocab 512, pp 1",
                       "rows": results}, f, indent=1)
    dist.barrier()
    log("ALL OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
