"""``compile_layers=True`` with Ulysses SP (sp_degree 2), unsharded and FSDP2-sharded over the SP
group (``shard="sp"``), against the unsplit float64 reference; 2 ranks.

HF's RMSNorm computes in float32 even for float64 models and inductor reorders that reduction, so
the norm classes get a float64 forward here, in the reference too (``tests/runtime/stage/test_compile.py``).
"""
from __future__ import annotations

from common import (
    CKPT,
    LENGTHS,
    UNITS_DP2,
    InfiniPipeConfig,
    PipelineEngine,
    dist,
    init,
    log,
    make_plan,
    random_batch,
    reference,
    tiny_model,
    torch,
)
from sharded_grads import check_full_grads, close

from tests.helpers.reference import assert_grads_close


def _float64_rms_norm(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def main() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    LlamaRMSNorm.forward = _float64_rms_norm
    for name, shard in [("sp2_compiled", "none"), ("sp2_compiled_fsdp_sp", "sp")]:
        batch = random_batch(LENGTHS, seed=9, with_labels=True)
        (want_loss,), want, _ = reference("llama", True, [batch])
        engine = PipelineEngine(tiny_model("llama", tie=True), InfiniPipeConfig(
            sp_degree=2, shard=shard, p2p_timeout_s=300, compile_layers=True))
        plan = make_plan(LENGTHS, [UNITS_DP2[0] + UNITS_DP2[1]], 1, engine.layers_per_stage,
                         checkpoint=CKPT["mixed"])
        out = engine.train_step(batch, plan=plan)
        close(out.loss, want_loss, f"{name} loss")
        names = set(want) - {"lm_head.weight"}  # pp 1, tied: the head is the embedding
        if shard == "none":
            got = {n: p.grad for n, p in engine.named_parameters() if n in names}
            worst = assert_grads_close(got, {n: want[n] for n in got})
        else:
            worst = check_full_grads(engine, want, names=names)
        log(f"CASE {name} OK worst_rel={worst:.2e}")


if __name__ == "__main__":
    init()
    main()
    dist.barrier()
    log("ALL OK")
    dist.destroy_process_group()
