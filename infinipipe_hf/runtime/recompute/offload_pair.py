"""The ``offload_pair`` level: ``offload_attn`` in pairs of consecutive layers whose second layer
keeps no input.

An ``offload_attn`` layer keeps three things in the host tier: its input, its attention output
and the log-sum-exp.  In a pair (first, second) the second layer's input is the first layer's
output, which the first layer can reproduce from what it keeps anyway: its input and its kept
attention output (the core skipped).  So the second layer keeps only its attention output and
log-sum-exp, and when its backward needs its input (the checkpoint's recompute unpacks it) the
first layer's forward replays once without grad, from its host input read with ``keep=True`` and
its kept attention output read without consuming it (``KeptAttention.peeking``): both stay for
the first layer's own replay, next in the backward (the log-sum-exp is not read: a forward does
not need it).  Per pair one hidden state less in host memory and one copy out fewer (about a
quarter of ``offload_attn``'s bytes), for one more forward of the first layer but its attention
core and two more copies back (its input and attention output).

Design: :class:`HostSavedInputs` gives each host-level layer of one unit call the saved-tensor
hooks of its input (``offload/activation_hooks.py``); a pair's first layer's hooks record its
packed input, its second layer's pack a ``_Rebuilt`` whose replay goes through the very call
and keyword arguments (unit context, kept store) the forward used: the K/V store's puts stay
idempotent, the context reads and SP all-to-alls run the same on every SP rank (all ranks run the
same backward), and the attention core is skipped.  The layers of ``layer_levels``'s contiguous
``offload_pair`` run pair up in order; an odd last one keeps its input, as ``offload_attn``.
No randomness is replayed: the level runs only without attention dropout (``runnable_levels``),
and the decoder layers it runs have no other dropout.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import torch

from infinipipe_hf.ir.levels import OFFLOAD_PAIR
from infinipipe_hf.runtime.offload.activation_hooks import offload_saved, rebuild_saved
from infinipipe_hf.runtime.offload.host_tier import HostTier
from infinipipe_hf.runtime.recompute.keep_attn import KeptAttention


def pair_partners(per_layer: Sequence[str | None]) -> dict[int, int]:
    """Second layer -> first layer of each ``offload_pair`` pair, by position in ``per_layer``
    (consecutive ``offload_pair`` layers pair up in order; an odd last one has no partner)."""
    run = [i for i, level in enumerate(per_layer) if level == OFFLOAD_PAIR]
    if run and run != list(range(run[0], run[0] + len(run))):
        raise ValueError(f"offload_pair layers must be consecutive (CheckpointMix.layer_levels); got {per_layer}")
    return {run[k + 1]: run[k] for k in range(0, len(run) - 1, 2)}


def _replay(call: Callable, kwargs: dict, store: KeptAttention) -> Callable[[torch.Tensor], torch.Tensor]:
    """The first layer's forward from its input, without grad and its attention core read from
    ``store`` without consuming it: the second layer's input."""

    def replay(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), store.peeking():
            out = call(x, **kwargs)
        return out[0] if isinstance(out, tuple) else out  # older decoder layers return tuples

    return replay


class HostSavedInputs:
    """Where the host-level layers of one unit call keep the input their checkpoint saves: the
    tier (``offload``, ``offload_attn``, a pair's first layer, an odd last ``offload_pair``
    layer), or nowhere (a pair's second layer: rebuilt)."""

    def __init__(self, per_layer: Sequence[str | None], tier: HostTier, tag: object) -> None:
        self.tier, self.tag = tier, tag
        self._first_of = pair_partners(per_layer)
        self._firsts = set(self._first_of.values())
        self._first = None  # the current pair's first layer: (packed input, replay)

    @contextmanager
    def saved(self, index: int, layer_input: torch.Tensor, call: Callable, kwargs: dict) -> Iterator[None]:
        """Hooks for the checkpoint of the layer at ``index`` (its position in ``per_layer``) run
        inside, as ``call(layer_input, **kwargs)``."""
        if index in self._first_of:
            source, replay = self._first
            self._first = None
            with rebuild_saved(layer_input, source, replay, self.tier, self.tag):
                yield
            return
        record = [] if index in self._firsts else None
        with offload_saved(self.tier, self.tag, record):
            yield
        if record is not None:
            if len(record) != 1:
                raise RuntimeError(f"an offload_pair layer's checkpoint saved {len(record)} tensors through "
                                   f"the hooks; the pair's rebuild expects only the layer input")
            store = kwargs["epp_unit"].kept_attention
            self._first = (record[0], _replay(call, kwargs, store))
