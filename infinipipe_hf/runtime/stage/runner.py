"""``StageRunner``: runs one stage's forwards and backwards of a step's units, in any valid order.

Design: the runner is the single-process core under both the local pipeline (tests, one process)
and the distributed executor (which only moves tensors between ranks).  ``forward`` returns
*detached* outputs ready to send and keeps each unit's graph (input leaf + output) until that
unit's ``backward``, which returns the gradient of the unit's input.  Cross-slice attention state
lives in the stage's ``KVStore``; a sequence's entries are freed once its first slice finished
backward (training) or its last slice finished forward (``forward_only``).  Unit tensors are built
lazily per unit and cached for the step, so a stage only materialises what it runs; each
sequence's ids and labels are converted once per step (``SequenceCache``), and what a unit needs
once (its tensors, attention context, rotary tables) is built once per unit, never per layer.
The trade-off: all per-step state is held in Python dicts keyed by unit id, so a unit id may be
forwarded once per step (a plan never does otherwise; it is checked).

With sequence parallelism (``sequence_parallel=``) the runner is one of its stage's SP ranks:
unit tensors, hidden states, gradients and loss parts cover only this rank's token shard of each
unit (``sp_shards.token_shards``), so ``output_shape`` is ``[1, shard tokens, hidden]`` on both
ends of a pipeline link (SP rank i of stage s talks to SP rank i of stage s + 1).  The loss is
still divided by the step's global label count, so the SP ranks' parts add up to the unit's.
A unit with a sub-group (``plan.sp_groups``) is split over that sub-group's ranks only, and a
sub-group of one runs it whole, like a runner without SP; a rank outside it never runs it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.runtime.attention.kv_store import KVStore
from infinipipe_hf.runtime.attention.select import select_backend
from infinipipe_hf.runtime.attention.types import EPPUnitContext
from infinipipe_hf.runtime.parallel.sequence_parallel import SequenceParallel, SPUnit
from infinipipe_hf.runtime.stage.loss import chunked_lm_loss
from infinipipe_hf.runtime.stage.module import StageModule
from infinipipe_hf.runtime.stage.unit_tensors import SequenceCache, UnitTensors, build_unit_tensors


@dataclass
class _Pending:
    hidden_in: torch.Tensor | None  # leaf whose .grad goes back to the previous stage
    output: torch.Tensor  # hidden out (non-last) or loss part (last), with graph


class StageRunner:
    def __init__(self, stage: StageModule, *, loss_chunk_tokens: int = 4096, attention_backend: str = "auto",
                 label_smoothing: float = 0.0, sequence_parallel: SequenceParallel | None = None,
                 cache_sequences: bool = True, attention_table: dict | None = None):
        """``cache_sequences=False`` converts a unit's sequences from the batch's lists for every
        unit again (the slower path before ``SequenceCache``; kept for the overhead benchmark)."""
        if loss_chunk_tokens < 1:
            raise ValueError(f"loss_chunk_tokens must be >= 1, got {loss_chunk_tokens}")
        self.stage = stage
        self.sp = sequence_parallel
        self.loss_chunk_tokens = loss_chunk_tokens
        self.label_smoothing = label_smoothing
        self.attention_backend = attention_backend
        # "auto" with the profile's measured table routes each unit kind to its fastest backend.
        self.backend = select_backend(attention_backend, stage.device, table=attention_table)
        self.kv_store = KVStore()
        self.cache_sequences = cache_sequences
        self._sequences: SequenceCache | None = None
        self._plan: Plan | None = None
        self._batch: list[dict] | None = None
        self._label_token_count = 0
        self._tensors: dict[int, UnitTensors] = {}
        self._pending: dict[int, _Pending] = {}
        self._forwarded: set[int] = set()
        self._backward_done: set[tuple[int, int]] = set()  # (seq, start) of segments done backward

    # --- step lifecycle --------------------------------------------------------------------
    def begin_step(self, plan: Plan, batch: list[dict], label_token_count: int) -> None:
        if len(batch) != len(plan.sequences):
            raise ValueError(f"the batch has {len(batch)} sequences but the plan was made for "
                             f"{len(plan.sequences)}; plan the batch you run")
        lengths = [len(item["input_ids"]) for item in batch]
        if lengths != list(plan.sequences):
            bad = next(i for i, (a, b) in enumerate(zip(lengths, plan.sequences)) if a != b)
            raise ValueError(f"sequence {bad} of the batch has {lengths[bad]} tokens but the plan was "
                             f"made for {plan.sequences[bad]}; plan the batch you run")
        if label_token_count < 1:
            raise ValueError(f"label_token_count must be >= 1, got {label_token_count}; "
                             f"is every label -100?")
        self._plan, self._batch = plan, batch
        self._sequences = SequenceCache(batch) if self.cache_sequences else None
        self._label_token_count = int(label_token_count)
        self._tensors.clear()
        self._pending.clear()
        self._forwarded.clear()
        self._backward_done.clear()
        self.kv_store.clear()

    def end_step(self) -> None:
        left = sorted(self._pending)
        self._tensors.clear()
        self._pending.clear()
        self._forwarded.clear()
        self._backward_done.clear()
        self.kv_store.clear()
        self._plan = self._batch = self._sequences = None
        if left:
            raise RuntimeError(f"stage {self.stage.stage_index}: units {left} ran forward but never "
                               f"backward this step; every F<unit> of a training step needs its B<unit>")

    # --- helpers ---------------------------------------------------------------------------
    def _require_step(self) -> Plan:
        if self._plan is None:
            raise RuntimeError("call begin_step(plan, batch, label_token_count) before running units")
        return self._plan

    def unit_tensors(self, unit_id: int) -> UnitTensors:
        plan = self._require_step()
        t = self._tensors.get(unit_id)
        if t is None:
            if unit_id not in plan.unit_by_id:
                raise ValueError(f"unit {unit_id} is not in the plan (units "
                                 f"{sorted(plan.unit_by_id)[:10]}...)")
            unit = plan.unit_by_id[unit_id]
            t = build_unit_tensors(unit, self._batch, self._sequences)
            sp = self._sp_of(unit_id)
            if sp is not None:
                shards = sp.tokens(unit.num_tokens)
                t = t.shard(*shards.range(sp.sp_rank), shards.local_sizes[sp.sp_rank])
            t = t.to(self.stage.device)
            self._tensors[unit_id] = t
        return t

    def _sp_of(self, unit_id: int) -> SequenceParallel | None:
        """SP over the unit's sub-group (``plan.sp_groups``; absent: the whole SP group);
        ``None`` without SP or on a sub-group of one rank (all heads here, no all-to-all)."""
        if self.sp is None:
            return None
        group = self._require_step().sp_groups.get(unit_id)
        return self.sp if group is None else self.sp.for_group(group)

    def local_tokens(self, unit_id: int) -> int:
        """Tokens of the unit this rank runs: all of them, or its SP shard (pad included)."""
        n = self._require_step().unit_by_id[unit_id].num_tokens
        sp = self._sp_of(unit_id)
        return n if sp is None else sp.tokens(n).local_sizes[sp.sp_rank]

    def output_shape(self, unit_id: int) -> tuple:
        return (1, self.local_tokens(unit_id), self.stage.hidden_size)

    def _context(self, t: UnitTensors) -> EPPUnitContext:
        plan = self._plan
        offsets = [0]
        for seg in t.segments:  # from the plan, not cu_seqlens_q: no device sync on CUDA
            offsets.append(offsets[-1] + seg.length)
        comm = self._sp_of(t.unit_id)
        sp = None if comm is None else SPUnit(comm, comm.tokens(offsets[-1]))
        return EPPUnitContext(t.unit_id, t.segments, tuple(offsets),
                              tuple(plan.continues_after(s) for s in t.segments),
                              self.kv_store, self.backend, sp)

    def _input(self, t: UnitTensors, hidden_in: torch.Tensor | None, grad: bool) -> tuple:
        st = self.stage
        if st.is_first:
            if hidden_in is not None:
                raise ValueError("stage 0 embeds the unit's input ids itself; pass hidden_in=None")
            return None, st.embed(t.input_ids)
        expect = (1, t.num_tokens, st.hidden_size)
        if hidden_in is None or tuple(hidden_in.shape) != expect:
            got = None if hidden_in is None else tuple(hidden_in.shape)
            raise ValueError(f"stage {st.stage_index} unit {t.unit_id}: hidden_in must have shape "
                             f"{expect}, got {got}")
        x = hidden_in.detach().to(device=st.device, dtype=st.dtype)
        if grad:
            x.requires_grad_(True)
        return x, x

    def _run(self, unit_id: int, hidden_in: torch.Tensor | None, grad: bool):
        t = self.unit_tensors(unit_id)
        leaf, h = self._input(t, hidden_in, grad)
        st = self.stage
        n_ckpt = self._plan.checkpointed(st.stage_index, unit_id) if grad else 0
        finer = self._plan.checkpoint_levels.get(st.stage_index, {}).get(unit_id) if grad else None
        if n_ckpt + sum((finer or {}).values()) > len(st.layer_indices):
            raise ValueError(f"the plan checkpoints {n_ckpt} whole layers and {finer or {}} of unit "
                             f"{unit_id} on stage {st.stage_index}, which has {len(st.layer_indices)} layers")
        h = st.run_layers(h, t.position_ids, self._context(t), n_ckpt, finer,
                          mlp_tile_tokens=self._plan.mlp_tile_tokens.get(unit_id),
                          attention_tile_tokens=self._plan.attention_tile_tokens.get(unit_id))
        if st.is_last:
            h = chunked_lm_loss(st.lm_head, st.final_norm(h), t.labels, self._label_token_count,
                                self.loss_chunk_tokens, self.label_smoothing, label_index=t.label_index)
        return leaf, h

    # --- the API ---------------------------------------------------------------------------
    def forward(self, unit_id: int, hidden_in: torch.Tensor | None) -> torch.Tensor:
        """Run the unit; return the detached hidden out (non-last) or loss part (last stage).

        The runner keeps ``hidden_in``'s storage until the unit's backward (autograd saves it):
        the caller must not write into that buffer again before then (e.g. reuse it for a recv).
        """
        self._require_step()
        if unit_id in self._forwarded:
            raise RuntimeError(f"stage {self.stage.stage_index}: unit {unit_id} already ran forward this step")
        self._forwarded.add(unit_id)
        with torch.enable_grad():
            leaf, out = self._run(unit_id, hidden_in, grad=True)
        self._pending[unit_id] = _Pending(leaf, out)
        return out.detach()

    def backward(self, unit_id: int, grad_out: torch.Tensor | None) -> torch.Tensor | None:
        """Backward of the unit; return the gradient of its input (None on stage 0)."""
        pending = self._pending.get(unit_id)
        if pending is None:
            raise RuntimeError(f"stage {self.stage.stage_index}: backward of unit {unit_id} without a "
                               f"pending forward (B{unit_id} before F{unit_id}, or twice)")
        unit = self._plan.unit_by_id[unit_id]
        for seg in unit.segments:
            # The K/V gradients of a slice are complete only once its successor ran backward.
            if self._plan.continues_after(seg) and (seg.seq, seg.end) not in self._backward_done:
                raise RuntimeError(
                    f"stage {self.stage.stage_index}: backward of unit {unit_id} (sequence {seg.seq} "
                    f"tokens [{seg.start}, {seg.end})) before the backward of the later slice starting "
                    f"at {seg.end}; a sequence's slices must run backward last slice first")
        if self.stage.is_last:
            if grad_out is not None:
                raise ValueError("the last stage backpropagates its own loss; pass grad_out=None")
            grad = None
        else:
            if grad_out is None or grad_out.shape != pending.output.shape:
                got = None if grad_out is None else tuple(grad_out.shape)
                raise ValueError(f"stage {self.stage.stage_index} unit {unit_id}: grad_out must have "
                                 f"shape {tuple(pending.output.shape)}, got {got}")
            grad = grad_out.to(device=pending.output.device, dtype=pending.output.dtype)
        del self._pending[unit_id]
        torch.autograd.backward(pending.output, grad)
        for seg in unit.segments:
            self._backward_done.add((seg.seq, seg.start))
            if seg.start == 0 and self._plan.continues_after(seg):
                self.kv_store.free_sequence(seg.seq)
        self._tensors.pop(unit_id, None)
        if pending.hidden_in is None:
            return None
        g = pending.hidden_in.grad
        return g if g is not None else torch.zeros_like(pending.hidden_in)

    def forward_only(self, unit_id: int, hidden_in: torch.Tensor | None) -> torch.Tensor:
        """Evaluation forward: no graph kept; K/V context is still stored (detached)."""
        self._require_step()
        with torch.no_grad():
            _, out = self._run(unit_id, hidden_in, grad=False)
        for seg in self._plan.unit_by_id[unit_id].segments:
            if not self._plan.continues_after(seg):
                self.kv_store.free_sequence(seg.seq)
        self._tensors.pop(unit_id, None)
        return out
