"""Tiny random HF models and the single-process, unsplit reference every runtime test compares to.

The reference is plain HF: each sequence through the whole model, token losses summed and divided
by the batch's label-token count (the mean token loss over the batch), one ``backward``.
"""
from __future__ import annotations

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def tiny_config(family: str = "llama", *, num_layers: int = 4, tie: bool = False, vocab: int = 97,
                hidden: int = 32, heads: int = 4, kv_heads: int = 2):
    import transformers

    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 8,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=4096, tie_word_embeddings=tie, rms_norm_eps=1e-6,
    )
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, use_sliding_window=False)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=hidden // heads, use_sliding_window=False)
    raise ValueError(family)


def tiny_model(family: str = "llama", *, seed: int = 0, dtype=torch.float64, **kw):
    import transformers

    torch.manual_seed(seed)
    cfg = tiny_config(family, **kw)
    # SDPA, not eager: eager attention computes its softmax in float32 even for float64 models,
    # which caps the reference at ~1e-7 relative error.
    cfg._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.to(dtype)
    # Norm weights away from 1 so a wrong norm gradient cannot hide behind the identity.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def random_batch(lengths, vocab: int = 97, seed: int = 0, with_labels: bool = False):
    g = torch.Generator().manual_seed(seed)
    batch = []
    for n in lengths:
        ids = torch.randint(0, vocab, (n,), generator=g)
        item = {"input_ids": ids.tolist()}
        if with_labels:
            labels = ids.clone()
            labels[torch.rand(n, generator=g) < 0.2] = -100  # some ignored targets
            item["labels"] = labels.tolist()
        batch.append(item)
    return batch


def label_token_count(batch) -> int:
    n = 0
    for item in batch:
        labels = item.get("labels", item["input_ids"])
        n += sum(1 for t in labels[1:] if t != -100)
    return n


def reference_loss_and_grads(model, batch):
    """Mean token loss over the batch of the unsplit model, and every parameter's gradient (on
    the model's device: a CUDA reference for CUDA runs, since HF's rotary tables are float32 and
    differ between CPU and CUDA kernels by float32 rounding)."""
    model.zero_grad(set_to_none=True)
    total = label_token_count(batch)
    loss_sum = 0.0
    device = next(model.parameters()).device
    for item in batch:
        ids = torch.tensor(item["input_ids"], device=device).unsqueeze(0)
        labels = torch.tensor(item.get("labels", item["input_ids"]), device=device).unsqueeze(0)
        logits = model(input_ids=ids).logits
        shift_logits = logits[0, :-1]
        shift_labels = labels[0, 1:]
        loss = torch.nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=-100,
                                                 reduction="sum") / total
        loss.backward()
        loss_sum += loss.item()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss_sum, grads


def assert_grads_close(got: dict, want: dict, rtol: float = 1e-10, atol: float = 1e-12):
    missing = set(want) - set(got)
    assert not missing, f"gradients missing for {sorted(missing)[:5]}"
    worst = 0.0
    for name, g in got.items():
        w = want[name]
        err = (g - w).abs().max().item()
        scale = w.abs().max().item()
        assert err <= atol + rtol * scale, f"{name}: max abs err {err:.3e} (scale {scale:.3e})"
        worst = max(worst, err / max(scale, 1e-30))
    return worst
