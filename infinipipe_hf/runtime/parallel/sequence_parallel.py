"""Ulysses sequence parallelism inside a stage: the all-to-alls around the attention backend.

Design (DeepSpeed-Ulysses): the ``sp_degree`` ranks of a stage each hold a contiguous shard of
every unit's tokens (``sp_shards.token_shards``) and run embeddings, norms, projections, RoPE
and the MLP on it alone.  Attention needs every token of a segment, so around the attention
backend two all-to-alls over the stage's SP group re-shard the problem:

- ``to_heads``: post-RoPE Q/K/V go from ``[1, heads, local tokens, d]`` to
  ``[1, my heads, all tokens, d]``; one collective carries Q, K and V together.  Each rank
  sends every peer the heads that peer owns (``sp_shards.head_shards``), K/V heads used by
  several ranks are sent to each of them, and the backward sums their gradients.
- ``to_sequence``: the attention output goes back from ``[1, all tokens, my heads, d]`` to
  ``[1, local tokens, heads, d]`` for ``o_proj``.

Each is an autograd ``Function`` whose backward is the inverse all-to-all, so gradients are
exact; neither saves a tensor for backward (only split sizes).  The collective is one 1-D
``all_to_all_single`` with explicit split sizes, so uneven token shards and uneven head ranges
need no padding.  Every rank of a stage runs the same actions in the same order, and a
checkpointed layer's recompute replays the same collectives on every SP rank, so the calls
always match.

Sub-groups (``ir.rounds``): a unit may run on an aligned sub-group of the stage's SP ranks; its
all-to-alls then run over that sub-group's process group (``ParallelLayout.sub_group_of``), with
token and head shards cut for the sub-group's size.  ``for_group`` gives the object of each
sub-group (one per size, built on first use, sharing the deadline and step number); a sub-group
of one has none: its unit runs with every head on its rank.  Only the ranks of a sub-group run
its units, so the calls match there too.

Waits: on CPU (gloo) every all-to-all waits with the step's deadline and a timeout names the SP
ranks, the unit and the layer (a dead or stuck peer is an error, never a hang).  On CUDA the
collective is only ordered on the stream (a host-side wait per layer would stall the GPU
queue); a stuck peer is then ended by the NCCL watchdog at the process group's timeout.

Sharded K/V store: when ``sp_degree`` is a larger multiple of the K/V heads, each rank gets one
K/V head and ``r = sp_degree // kv_heads`` consecutive ranks (a *K/V group*, ``kv_group.py``) get
the same one, so a replicated store would hold ``r`` copies of every carried K/V.  Units of the
whole SP group then store only the rank's chunk of each slice's tokens and gather the context
over the K/V group (``attention/kv_shards.py``); the to-heads backward sums the group's chunk
gradients as it sums the replicas' gradients.  Sub-group units (which carry no context) and
other head counts keep the replicated store.

Cost: per layer and unit, each rank sends ``(sp - 1) / sp`` of its Q, K, V and attention output
(4 hidden-size tensors of its tokens with MHA; K/V are smaller with GQA, larger by the
replication factor when ``kv_heads < sp``), forward and again in backward.  A sharded K/V store
adds, per context read of ``c`` tokens, one all-to-all over the K/V group moving ``(r - 1) / r``
of the context's K and V each way (forward, a recompute's forward, and the gradients in backward).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from infinipipe_hf.ir.model_spec import kv_head_sharers
from infinipipe_hf.ir.sp_rounds import SubGroup
from infinipipe_hf.runtime.parallel.kv_group import KVGroup, all_to_all
from infinipipe_hf.runtime.parallel.sp_shards import (
    HeadShard,
    TokenShards,
    head_shards,
    token_shards,
)


@dataclass
class _Clock:
    """Settings one stage's SP objects share (the whole group's and its sub-groups')."""

    timeout_s: float
    step: int = 0


class SequenceParallel:
    """This rank's place in its stage's SP group (or in an aligned sub-group of it, ``ir.rounds``),
    and the all-to-alls over it.  ``for_group`` gives the object of a unit's sub-group."""

    def __init__(self, layout, *, num_heads: int, num_kv_heads: int, timeout_s: float,
                 sub_group: SubGroup | None = None, _clock: _Clock | None = None) -> None:
        g = sub_group if sub_group is not None else SubGroup(0, layout.sp_degree)
        if g.size < 2:
            raise ValueError(f"SequenceParallel needs a group of >= 2 ranks, got sp_degree "
                             f"{layout.sp_degree} and a sub-group of {g.size}")
        self.layout = layout
        self.sub_group = g
        self.group, self.ranks = layout.sub_group_of(g.offset, g.size)
        self.sp_rank = layout.sp_rank - g.offset
        """This rank's place inside its (sub-)group."""
        self.sp_degree = g.size
        """Ranks of the (sub-)group."""
        self.heads: tuple[HeadShard, ...] = head_shards(num_heads, num_kv_heads, self.sp_degree)
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self._clock = _clock if _clock is not None else _Clock(float(timeout_s))
        self._subs: dict[int, SequenceParallel] = {}
        self._expand_index: dict[torch.device, torch.Tensor] = {}
        self._finished: tuple = ()
        self.kv_group: KVGroup | None = self._kv_group(sub_group)
        """The ranks sharing this rank's K/V head, which shard the carried K/V store (the whole
        SP group's units only); ``None``: a replicated store.  Set it to ``None`` to turn the
        sharding off (tests compare both)."""

    def _kv_group(self, sub_group: SubGroup | None) -> KVGroup | None:
        r = kv_head_sharers(self.sp_degree, self.num_kv_heads)
        if sub_group is not None and sub_group.size != self.layout.sp_degree or r == 1:
            return None
        if self.layout.kv_group is None or self.layout.kv_group_size != r:
            return None  # a layout built without the model's K/V heads (or without groups)
        assert all(h.num_kv == 1 and h.kv_start == i // r for i, h in enumerate(self.heads)), self.heads
        return KVGroup(self.layout, self._clock)

    @property
    def timeout_s(self) -> float:
        """Deadline of one all-to-all (CPU); the engine sets it from ``p2p_timeout_s``; shared
        with the sub-groups' objects."""
        return self._clock.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self._clock.timeout_s = float(value)

    @property
    def step(self) -> int:
        """Step number for error messages; the engine sets it before each step (shared)."""
        return self._clock.step

    @step.setter
    def step(self, value: int) -> None:
        self._clock.step = int(value)

    def for_group(self, group: SubGroup) -> "SequenceParallel | None":
        """The object of sub-group ``group`` of this rank's stage (``None`` for one rank: the unit
        runs with all heads locally); built once per size and shared."""
        if not group.contains(self.layout.sp_rank):
            raise ValueError(f"{self.layout.describe()} is not in SP sub-group (offset {group.offset}, "
                             f"size {group.size}); a rank runs only the units of its sub-groups")
        if group.size == 1:
            return None
        if group == self.sub_group:
            return self
        sub = self._subs.get(group.size)
        if sub is None:
            sub = self._subs[group.size] = SequenceParallel(
                self.layout, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                timeout_s=self.timeout_s, sub_group=group, _clock=self._clock)
        assert sub.sub_group == group, (sub.sub_group, group)
        return sub

    @property
    def head(self) -> HeadShard:
        return self.heads[self.sp_rank]

    def tokens(self, num_tokens: int) -> TokenShards:
        return token_shards(num_tokens, self.sp_degree)

    def expand_index(self, device: torch.device) -> torch.Tensor | None:
        """Local K/V head of each local query head, when the kernel cannot group them itself."""
        if self.head.expand is None:
            return None
        idx = self._expand_index.get(device)
        if idx is None:
            idx = self._expand_index[device] = torch.tensor(self.head.expand, device=device)
        return idx

    # --- the collective ------------------------------------------------------------------
    def exchange(self, per_peer: list[list[torch.Tensor]], recv_splits: list[int],
                 what: str) -> torch.Tensor:
        """Send the tensors ``per_peer[j]`` (back to back) to SP rank ``j``; return the flat
        concatenation, in rank order, of what every rank sent here (``recv_splits`` elements each).

        The views are copied straight into one send buffer (no intermediate concatenation)."""
        ref = per_peer[self.sp_rank][0]
        send_splits = [sum(p.numel() for p in parts) for parts in per_peer]
        send = torch.empty(sum(send_splits), dtype=ref.dtype, device=ref.device)
        offset = 0
        for parts in per_peer:
            for p in parts:
                send[offset:offset + p.numel()].view(p.shape).copy_(p)
                offset += p.numel()
        recv, work = all_to_all(send, send_splits, recv_splits, group=self.group, layout=self.layout,
                                ranks=self.ranks, timeout_s=self.timeout_s, step=self.step,
                                what=f"sequence-parallel all-to-all ({what})")
        # gloo's worker thread may hold the last reference to the buffers of a finished
        # collective, so their memory would be freed on that thread, where a CPU allocator probe
        # does not see it; holding them until the next exchange frees them on this one.
        self._finished = (work, send)
        return recv

    # --- the two re-shardings, differentiable ----------------------------------------------
    def to_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tokens: TokenShards,
                 what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[1, H, t_local, d]`` (and K/V heads) -> ``[1, my heads, num_tokens, d]``, pads dropped."""
        if not q.shape[-1] == k.shape[-1] == v.shape[-1]:
            raise ValueError(f"sequence parallelism needs equal query/key/value head sizes, got "
                             f"{q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}")
        qh, kh, vh = _ToHeads.apply(q, k, v, self, tokens, what)
        if tokens.padded_total != tokens.num_tokens:  # pads are the last shards
            n = tokens.num_tokens
            qh, kh, vh = qh[:, :, :n], kh[:, :, :n], vh[:, :, :n]
        return qh, kh, vh

    def to_sequence(self, out: torch.Tensor, tokens: TokenShards, what: str) -> torch.Tensor:
        """``[1, num_tokens, my heads, d]`` -> ``[1, t_local, H, d]``."""
        pad = tokens.padded_total - tokens.num_tokens
        if pad:
            out = F.pad(out, (0, 0, 0, 0, 0, pad))  # pad tokens attend nothing: zero output
        return _ToSequence.apply(out, self, tokens, what)


def _token_offsets(tokens: TokenShards) -> list[int]:
    offsets = [0]
    for n in tokens.local_sizes:
        offsets.append(offsets[-1] + n)
    return offsets


class _ToHeads(torch.autograd.Function):
    """Sequence-sharded Q/K/V -> head-sharded over all (padded) tokens; backward: the inverse."""

    @staticmethod
    def forward(ctx, q, k, v, group: SequenceParallel, tokens: TokenShards, what: str):
        ctx.group, ctx.tokens, ctx.what = group, tokens, what
        me, heads, sizes = group.sp_rank, group.heads, tokens.local_sizes
        d = q.shape[-1]
        assert q.shape[2] == sizes[me] and q.shape[1] == group.num_heads, (q.shape, sizes, me)
        q0, k0, v0 = q[0], k[0], v[0]
        views = [[q0[h.q_start:h.q_end], k0[h.kv_start:h.kv_end], v0[h.kv_start:h.kv_end]]
                 for h in heads]
        mine = heads[me]
        rows = mine.num_q + 2 * mine.num_kv
        flat = group.exchange(views, [rows * n * d for n in sizes], f"{what}, Q/K/V to heads")
        chunks, offset = [], 0
        for n in sizes:
            chunks.append(flat[offset:offset + rows * n * d].view(rows, n, d))
            offset += rows * n * d
        a, b = mine.num_q, mine.num_q + mine.num_kv
        qh = torch.cat([c[:a] for c in chunks], dim=1).unsqueeze(0)
        kh = torch.cat([c[a:b] for c in chunks], dim=1).unsqueeze(0)
        vh = torch.cat([c[b:] for c in chunks], dim=1).unsqueeze(0)
        return qh, kh, vh

    @staticmethod
    def backward(ctx, gq, gk, gv):
        group, tokens = ctx.group, ctx.tokens
        me, heads, sizes = group.sp_rank, group.heads, tokens.local_sizes
        mine = heads[me]
        ref = next(g for g in (gq, gk, gv) if g is not None)
        d = ref.shape[-1]
        total = tokens.padded_total

        def full(g, n_heads):
            return g[0] if g is not None else ref.new_zeros(n_heads, total, d)

        gq0, gk0, gv0 = full(gq, mine.num_q), full(gk, mine.num_kv), full(gv, mine.num_kv)
        off = _token_offsets(tokens)
        views = [[gq0[:, off[j]:off[j + 1]], gk0[:, off[j]:off[j + 1]], gv0[:, off[j]:off[j + 1]]]
                 for j in range(group.sp_degree)]
        n = sizes[me]
        rows = [h.num_q + 2 * h.num_kv for h in heads]
        flat = group.exchange(views, [r * n * d for r in rows], f"{ctx.what}, Q/K/V gradients")
        gq_parts = []
        gk_local = ref.new_zeros(group.num_kv_heads, n, d)
        gv_local = ref.new_zeros(group.num_kv_heads, n, d)
        offset = 0
        for h, r in zip(heads, rows):
            c = flat[offset:offset + r * n * d].view(r, n, d)
            offset += r * n * d
            gq_parts.append(c[:h.num_q])
            # A K/V head sent to several ranks collects the gradient of each.
            gk_local[h.kv_start:h.kv_end] += c[h.num_q:h.num_q + h.num_kv]
            gv_local[h.kv_start:h.kv_end] += c[h.num_q + h.num_kv:]
        return (torch.cat(gq_parts).unsqueeze(0), gk_local.unsqueeze(0), gv_local.unsqueeze(0),
                None, None, None)


class _ToSequence(torch.autograd.Function):
    """Head-sharded attention output over all tokens -> this rank's tokens, every head."""

    @staticmethod
    def forward(ctx, out, group: SequenceParallel, tokens: TokenShards, what: str):
        ctx.group, ctx.tokens, ctx.what = group, tokens, what
        me, heads, sizes = group.sp_rank, group.heads, tokens.local_sizes
        o0 = out[0]  # [padded tokens, my heads, d]
        d = o0.shape[-1]
        off = _token_offsets(tokens)
        views = [[o0[off[j]:off[j + 1]]] for j in range(group.sp_degree)]
        n = sizes[me]
        flat = group.exchange(views, [n * h.num_q * d for h in heads],
                           f"{what}, attention output to sequence")
        parts, offset = [], 0
        for h in heads:
            parts.append(flat[offset:offset + n * h.num_q * d].view(n, h.num_q, d))
            offset += n * h.num_q * d
        return torch.cat(parts, dim=1).unsqueeze(0)

    @staticmethod
    def backward(ctx, g):
        group, tokens = ctx.group, ctx.tokens
        me, heads, sizes = group.sp_rank, group.heads, tokens.local_sizes
        g0 = g[0]  # [my tokens, H, d]
        d = g0.shape[-1]
        views = [[g0[:, h.q_start:h.q_end]] for h in heads]
        mine = heads[me].num_q
        flat = group.exchange(views, [n * mine * d for n in sizes],
                           f"{ctx.what}, attention output gradients")
        return flat.view(tokens.padded_total, mine, d).unsqueeze(0), None, None, None


@dataclass(frozen=True)
class SPUnit:
    """What the attention function needs for SP on one unit: the group and the token split."""

    comm: SequenceParallel
    tokens: TokenShards

    def to_heads(self, q, k, v, what: str):
        return self.comm.to_heads(q, k, v, self.tokens, what)

    def to_sequence(self, out, what: str):
        return self.comm.to_sequence(out, self.tokens, what)

    def expand_index(self, device: torch.device) -> torch.Tensor | None:
        return self.comm.expand_index(device)

    @property
    def kv_group(self) -> KVGroup | None:
        """The K/V group the carried K/V store is sharded over (``None``: replicated)."""
        return self.comm.kv_group
