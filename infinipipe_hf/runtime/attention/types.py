"""The attention problem of one unit and what the attention function needs to run it.

A unit's attention is a set of *segments*: for each, the queries are its own tokens and the
keys/values are its context (K/V of earlier slices of the same sequence, from the stage's
``KVStore``) followed by its own K/V; the causal mask is aligned to the lower right (query i sees
keys 0..start+i).  Segments of one unit never see each other.  Backends compute that from an
``AttentionSegments`` description.

``EPPUnitContext`` rides in the decoder layers' keyword arguments.  It names sequence parallelism
and the ``keep_attn`` store through Protocols, so this package never imports the modules that
implement them (``runtime.parallel``, ``runtime.recompute``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from infinipipe_hf.ir.units import Segment
from infinipipe_hf.runtime.attention.kv_shards import KVGroupExchange
from infinipipe_hf.runtime.attention.kv_store import KVStore


@dataclass
class AttentionSegments:
    """One unit's attention problem: queries of all segments, and each segment's full keys."""

    query: torch.Tensor  # [1, heads, T, d]
    keys: list[torch.Tensor]  # per segment [1, kv_heads, context + length, d]
    values: list[torch.Tensor]
    q_offsets: tuple[int, ...]
    context_lens: list[int]
    scaling: float
    dropout: float
    sliding_window: int | None


AttentionBackend = Callable[[AttentionSegments], torch.Tensor]  # returns [1, T, heads, d]


class SequenceExchange(Protocol):
    """Sequence parallelism on one unit: the two all-to-alls around the attention core."""

    def to_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's token shard of all heads -> all tokens of this rank's heads."""

    def to_sequence(self, out: torch.Tensor, what: str) -> torch.Tensor:
        """The attention output back to this rank's token shard of all heads."""

    def expand_index(self, device: torch.device) -> torch.Tensor | None:
        """One K/V head per query head when this rank's heads do not group evenly, else ``None``."""

    @property
    def kv_group(self) -> KVGroupExchange | None:
        """The ranks sharing this rank's K/V head, which shard the carried K/V store (``None``:
        the store is replicated)."""


class KeptCore(Protocol):
    """The ``keep_attn`` level's store: runs the attention core, keeping its output for the replay."""

    peeking_now: bool
    """Set while an ``offload_pair`` rebuild replays the layer without grad: ``run`` returns the
    kept output and keeps it for the layer's own replay."""

    def run(self, problem: AttentionSegments, layer: int) -> torch.Tensor:
        """The unit's attention output ``[1, T, heads, d]``, as a backend returns it."""


@dataclass
class EPPUnitContext:
    """What the attention function needs to know about the unit being run."""

    unit_id: int
    segments: tuple[Segment, ...]
    q_offsets: tuple[int, ...]  # cu_seqlens of the queries: segment i is tokens [q_offsets[i], q_offsets[i+1])
    continues: tuple[bool, ...]  # segment i's sequence has a later slice that needs its K/V
    store: KVStore
    backend: AttentionBackend
    sp: SequenceExchange | None = None
    """Sequence parallelism: the layer sees this rank's token shard; attention runs on all the
    unit's tokens for this rank's heads between two all-to-alls."""
    kept_attention: KeptCore | None = None
    """Set on the layers checkpointed at ``keep_attn``: runs the attention core and keeps its
    output and log-sum-exp from the forward for the replay (``recompute/keep_attn.py``)."""


def segment_mask(length: int, context: int, sliding_window: int | None, device) -> torch.Tensor:
    """Boolean [length, context + length]: causal aligned to the lower right, optional window."""
    q_pos = torch.arange(context, context + length, device=device).unsqueeze(1)
    k_pos = torch.arange(context + length, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= (q_pos - k_pos) < sliding_window  # HF: kv_idx > q_idx - sliding_window
    return mask


def square_causal(length: int, context: int, sliding_window: int | None) -> bool:
    """A segment with no context and no window narrower than it: plain causal, no mask needed
    (upper-left and lower-right alignment coincide)."""
    return context == 0 and (sliding_window is None or sliding_window >= length)


UNIT_KINDS = ("sequence", "packed", "slice", "hybrid")
"""The attention problems a unit poses, by which the backend is chosen: one whole ``sequence``
(one segment, no context), ``packed`` (several segments, none with context), a ``slice`` (one
segment with context), ``hybrid`` (several segments, one or more with context)."""


def unit_kind(a: AttentionSegments) -> str:
    """The unit kind (:data:`UNIT_KINDS`) of an attention problem.  A first slice (no context)
    poses the same problem as a whole sequence of its length, so it counts as ``sequence``."""
    with_context = any(c > 0 for c in a.context_lens)
    if len(a.keys) == 1:
        return "slice" if with_context else "sequence"
    return "hybrid" if with_context else "packed"
