"""Per-unit tensors: ids, positions, labels shifted on the whole sequence, and the segment table.

Design: labels are shifted on the *whole* sequence before it is cut, so the last token of a slice
predicts the first token of the next slice and a sequence contributes exactly the targets it
would unsplit; only each sequence's last token has no target (-100).  Position ids continue from
the segment's start so RoPE matches the unsplit model.  With sequence parallelism each rank keeps
its contiguous shard of the unit's tokens (``UnitTensors.shard``); the segment table stays the
whole unit's, because attention runs over all the unit's tokens.  Tensors are built on CPU from the plain
batch (ids as lists or 1-D tensors); the runner moves them to the stage's device.  A sequence's ids
and shifted labels are converted once per step (``SequenceCache``), not once per unit: a slice of
a 128K-token sequence would otherwise convert the whole list twice per unit on every stage.  On
CUDA the copies to the device are queued from pinned memory (a pageable copy synchronises the
host with the device once per tensor, draining the queue of kernels every unit).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from infinipipe_hf.ir.units import Segment, Unit


def check_batch(batch) -> list[dict]:
    """The global batch as a list of ``{"input_ids": ...}`` dicts, each one non-empty 1-D
    sequence; a clear ``ValueError`` for anything else."""
    if not isinstance(batch, (list, tuple)) or not batch:
        raise ValueError(f"batch must be a non-empty list of {{'input_ids': ...}} dicts, got "
                         f"{type(batch).__name__}{'' if batch else ' (empty)'}")
    out = []
    for i, item in enumerate(batch):
        if not isinstance(item, dict) or "input_ids" not in item:
            raise ValueError(f"batch[{i}] must be a dict with 'input_ids', got {type(item).__name__}")
        ids = item["input_ids"]
        n = int(ids.numel()) if isinstance(ids, torch.Tensor) else len(ids)
        if isinstance(ids, torch.Tensor) and ids.dim() != 1:
            raise ValueError(f"batch[{i}]['input_ids'] must be 1-D (one sequence), got shape "
                             f"{tuple(ids.shape)}; pass one dict per sequence")
        if n < 1:
            raise ValueError(f"batch[{i}] has no tokens; drop empty sequences")
        out.append(item)
    return out


@dataclass
class UnitTensors:
    unit_id: int
    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long
    labels: torch.Tensor  # [1, T] long, -100 where no target
    cu_seqlens_q: torch.Tensor  # [num_segments + 1] int32
    cu_seqlens_k: torch.Tensor  # [num_segments + 1] int32, keys include each segment's context
    segments: tuple[Segment, ...]
    num_label_tokens: int
    label_index: torch.Tensor | None = None
    """Positions of the labels != -100, found on the host: the loss selects them without a sync."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def shard(self, start: int, end: int, local_tokens: int) -> "UnitTensors":
        """Tokens ``[start, end)`` of the unit, padded to ``local_tokens`` with pad tokens (id 0,
        position 0, no label): only a rank owning no token runs one (``sp_shards``)."""
        pad = local_tokens - (end - start)
        assert 0 <= pad and (pad == 0 or start == end), (start, end, local_tokens)

        def cut(x: torch.Tensor, fill: int) -> torch.Tensor:
            x = x[:, start:end]
            return torch.cat([x, x.new_full((1, pad), fill)], dim=1) if pad else x

        labels = cut(self.labels, -100)
        return UnitTensors(self.unit_id, cut(self.input_ids, 0), cut(self.position_ids, 0), labels,
                           self.cu_seqlens_q, self.cu_seqlens_k, self.segments,
                           int((labels != -100).sum()), _label_index(labels))

    def to(self, device: torch.device | str) -> "UnitTensors":
        """Ids, positions and labels on ``device``, queued without a host sync on CUDA; the
        ``cu_seqlens`` stay on the host (attention takes its offsets from the segment table)."""
        device = torch.device(device)
        pin = device.type == "cuda"
        ids, pos, labels = (_to_device(x, device, pin) for x in (self.input_ids, self.position_ids, self.labels))
        index = None if self.label_index is None else _to_device(self.label_index, device, pin)
        return UnitTensors(self.unit_id, ids, pos, labels, self.cu_seqlens_q, self.cu_seqlens_k,
                           self.segments, self.num_label_tokens, index)


def _label_index(labels: torch.Tensor) -> torch.Tensor | None:
    """Flat positions of ``labels != -100`` of a host tensor (``None`` elsewhere: found on use)."""
    return (labels.reshape(-1) != -100).nonzero(as_tuple=True)[0] if labels.device.type == "cpu" else None


def _to_device(x: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    """``x`` on ``device``; from pinned memory and non-blocking when ``pin`` (the caching host
    allocator keeps the pinned buffer until the copy has run)."""
    if x.device == device:
        return x
    if pin and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


class SequenceCache:
    """Each sequence's ids and shifted labels as tensors, converted on first use within a step."""

    def __init__(self, batch: Sequence[dict]) -> None:
        self.batch = batch
        self._ids: dict[int, torch.Tensor] = {}
        self._labels: dict[int, torch.Tensor] = {}

    def ids(self, seq: int) -> torch.Tensor:
        t = self._ids.get(seq)
        if t is None:
            t = self._ids[seq] = _as_long(self.batch[seq]["input_ids"], "input_ids", seq)
        return t

    def labels(self, seq: int) -> torch.Tensor:
        t = self._labels.get(seq)
        if t is None:
            t = self._labels[seq] = shifted_labels(self.batch[seq], seq, ids=self.ids(seq))
        return t


def _as_long(x, what: str, i: int) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.dim() != 1:
        raise ValueError(f"batch[{i}][{what!r}] must be a 1-D list or tensor of token ids, got shape "
                         f"{tuple(t.shape)}")
    return t.to(torch.long).cpu()


def shifted_labels(item: dict, i: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Targets per position of the whole sequence: ``labels_or_ids[t + 1]``, -100 at the end
    (``ids``: the sequence's ids already converted)."""
    if "input_ids" not in item:
        raise ValueError(f"batch[{i}] has no 'input_ids'; got keys {sorted(item)}")
    if ids is None:
        ids = _as_long(item["input_ids"], "input_ids", i)
    src = _as_long(item["labels"], "labels", i) if item.get("labels") is not None else ids
    if src.shape != ids.shape:
        raise ValueError(f"batch[{i}]: labels have {src.shape[0]} tokens but input_ids {ids.shape[0]}; "
                         f"give one label per token (use -100 for tokens without a target)")
    out = torch.full_like(ids, -100)
    out[:-1] = src[1:]
    return out


def label_token_count(batch: Sequence[dict]) -> int:
    """Global number of targets != -100 after shifting: the loss is divided by it."""
    return int(sum(int((shifted_labels(item, i) != -100).sum()) for i, item in enumerate(batch)))


def build_unit_tensors(unit: Unit, batch: Sequence[dict], cache: SequenceCache | None = None) -> UnitTensors:
    """The unit's tensors on CPU; ``cache`` (the step's ``SequenceCache``) converts each sequence once."""
    cache = SequenceCache(batch) if cache is None else cache
    ids, pos, labels, cu_q, cu_k = [], [], [], [0], [0]
    seen: set[int] = set()
    for seg in unit.segments:
        if not 0 <= seg.seq < len(batch):
            raise ValueError(f"unit {unit.id} refers to sequence {seg.seq} but the batch has "
                             f"{len(batch)} sequences; plan and batch do not match")
        if seg.seq in seen:
            raise ValueError(f"unit {unit.id} holds two segments of sequence {seg.seq}; segments of one "
                             f"unit never attend to each other, so put them in different units")
        seen.add(seg.seq)
        seq_ids = cache.ids(seg.seq)
        if seg.end > seq_ids.shape[0]:
            raise ValueError(f"unit {unit.id} segment {seg.to_list()} ends past sequence {seg.seq}'s "
                             f"{seq_ids.shape[0]} tokens; plan and batch do not match")
        ids.append(seq_ids[seg.start:seg.end])
        pos.append(torch.arange(seg.start, seg.end, dtype=torch.long))
        labels.append(cache.labels(seg.seq)[seg.start:seg.end])
        cu_q.append(cu_q[-1] + seg.length)
        cu_k.append(cu_k[-1] + seg.end)
    lab = torch.cat(labels).unsqueeze(0)
    return UnitTensors(
        unit_id=unit.id,
        input_ids=torch.cat(ids).unsqueeze(0),
        position_ids=torch.cat(pos).unsqueeze(0),
        labels=lab,
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32),
        segments=tuple(unit.segments),
        num_label_tokens=int((lab != -100).sum()),
        label_index=_label_index(lab),
    )
