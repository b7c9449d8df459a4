"""When a posted send is provably complete, from the schedule alone (pure; no torch.distributed).

A pipeline send's buffer (a unit's output, or the gradient of its input) must live until the
peer has received it.  NCCL reports that (``Work.is_completed`` queries its event); gloo does
not: a gloo ``isend`` reports completion only once someone *waits* on it, so an executor that
drops only sends reporting completion holds every buffer it sent until the end of the step, a
full hidden state per unit and direction, the whole batch's worth on a middle stage.  Waiting on
a send the peer has not received yet would stall this rank behind the peer, so the executor
waits on a send only when the schedule proves the peer already took it, and the wait returns at
once:

- the output of unit ``u`` (sent at ``F u`` to the next stage): the next stage ran ``F u``
  before it could send back ``u``'s output gradient, so it is complete once *this* stage has
  received that gradient, at its own ``B u``;
- the input gradient of unit ``u`` (sent at ``B u`` to the previous stage): complete once this
  stage has received the output of a unit ``v`` that the previous stage forwarded after its
  ``B u`` (which consumed the gradient).

Sends no later receive proves (the step's last gradients) are waited at the end of the step.
Trade-off: a proof can come later than the actual completion (a buffer lives a few actions
longer than it must), never earlier, so a wait here never blocks on the peer.
"""
from __future__ import annotations

from typing import Sequence

from infinipipe_hf.ir.actions import Action

SendKey = tuple[str, int]
"""``("F", unit)``: the output sent after the unit's forward; ``("B", unit)``: the input gradient."""


def send_release_points(own: Sequence[Action], previous: Sequence[Action] | None, *,
                        is_last_stage: bool, is_first_stage: bool) -> dict[int, list[SendKey]]:
    """For each index of ``own`` (this stage's actions), the sends proven complete once that
    action's receive is done.  ``previous``: the previous stage's actions (None on stage 0)."""
    release: dict[int, list[SendKey]] = {}
    if not is_last_stage:
        for i, a in enumerate(own):
            if not a.is_forward:
                release.setdefault(i, []).append(("F", a.unit))
    if is_first_stage or previous is None:
        return release
    prev_index = {(a.kind, a.unit): j for j, a in enumerate(previous)}
    own_forwards = [(i, prev_index[("F", a.unit)]) for i, a in enumerate(own) if a.is_forward]
    for i, a in enumerate(own):
        if a.is_forward:
            continue
        consumed_at = prev_index.get(("B", a.unit))
        if consumed_at is None:
            continue
        later = [k for k, j in own_forwards if j > consumed_at and k > i]
        if later:
            release.setdefault(min(later), []).append(("B", a.unit))
    return release
