"""Hand-built planner inputs the checkpointing tests share: a tiny and a Llama-3-8B-shaped model
spec, and an EPP-shaped plan (long sequences sliced, short ones packed, 1F1B with EPP's warm-up)."""
from __future__ import annotations

from infinipipe_hf.ir.actions import B, F
from infinipipe_hf.ir.model_spec import ModelSpec
from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.ir.units import Segment, Unit

TINY = ModelSpec(model_type="llama", num_layers=6, hidden_size=512, intermediate_size=1408,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=1000,
                 tie_word_embeddings=False)
LLAMA8B = ModelSpec(model_type="llama", num_layers=32, hidden_size=4096, intermediate_size=14336,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                    tie_word_embeddings=False)


def epp_plan(lengths, pp, slice_tokens, unit_tokens, dp=1):
    """EPP-shaped plan: long sequences sliced, short ones packed, 1F1B with EPP warm-up.

    Longest sequence first, slices consecutive; backward last slice first, FIFO across sequences.
    Sequences are dealt round-robin to DP replicas.
    """
    units, actions, uid = [], {}, 0
    for r in range(dp):
        mine = sorted((s for s in range(len(lengths)) if s % dp == r), key=lambda s: -lengths[s])
        groups, pack, tok = [], [], 0
        for s in mine:
            n = lengths[s]
            if n > slice_tokens:
                g = []
                for st in range(0, n, slice_tokens):
                    units.append(Unit(uid, (Segment(s, st, min(n, st + slice_tokens)),), dp_rank=r))
                    g.append(uid)
                    uid += 1
                groups.append(g)
                continue
            if pack and tok + n > unit_tokens:
                units.append(Unit(uid, tuple(Segment(q, 0, lengths[q]) for q in pack), dp_rank=r))
                groups.append([uid])
                uid, pack, tok = uid + 1, [], 0
            pack.append(s)
            tok += n
        if pack:
            units.append(Unit(uid, tuple(Segment(q, 0, lengths[q]) for q in pack), dp_rank=r))
            groups.append([uid])
            uid += 1
        fwd = [u for g in groups for u in g]
        bwd = [u for g in groups for u in reversed(g)]
        stages = []
        for st in range(pp):
            warm = min(len(fwd), (pp - 1 - st) + (len(groups[0]) - 1))
            acts, done, fi, bi = [F(u) for u in fwd[:warm]], set(fwd[:warm]), warm, 0
            while bi < len(bwd):
                if fi < len(fwd):
                    acts.append(F(fwd[fi]))
                    done.add(fwd[fi])
                    fi += 1
                while bi < len(bwd) and bwd[bi] in done:
                    acts.append(B(bwd[bi]))
                    bi += 1
                    if fi < len(fwd):
                        break
            stages.append(acts)
        actions[r] = stages
    return Plan("epp", pp, dp, list(lengths), units, actions, {})
