"""The distributed action loop: run this rank's action list of a plan on its ``StageRunner``.

Design: a forward receives the unit's hidden states from the previous stage, runs the stage and
sends its output on; a backward receives the gradient of its output from the next stage, runs
backward and sends the input gradient back.  Receives are posted ``lookahead`` actions ahead so
the transfer overlaps the current action's compute; sends are fire-and-forget until the end of
the step, except that completed ones are reaped as we go to bound buffer memory (reported
complete by the backend, or proven complete by the schedule: ``send_release.py``, which gloo
needs).  Shapes come from the plan via ``StageRunner.output_shape`` (``[1, unit tokens,
hidden]``, the same on both sides of every link), so no metadata crosses the wire.  With SP
sub-groups a rank runs only its units' actions (``rounds.rank_actions``), as its peers do.

Trade-off: a deeper lookahead overlaps more but keeps more receive buffers alive (each is a full
hidden-state tensor of a unit); 2 covers the 1F1B steady state, where the next action's input is
the one that matters.  The executor never reorders actions: the plan's order is the schedule.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from infinipipe_hf.runtime.engine.sp_rounds import rank_actions
from infinipipe_hf.runtime.engine.timeline import Timeline, TimelineEvent
from infinipipe_hf.runtime.parallel.comm import GRAD, HIDDEN, StageComm, Transfer
from infinipipe_hf.runtime.parallel.mesh import ParallelLayout
from infinipipe_hf.runtime.parallel.send_release import send_release_points


@dataclass
class ExecutorResult:
    loss_part: float
    """Sum of the loss parts this rank produced (non-zero only on last stages)."""
    timeline: Timeline
    nonfinite_units: tuple[int, ...] = ()
    """Units whose loss part on this rank is NaN or infinite (looked up only when the sum is)."""


class PipelineExecutor:
    """Executes ``plan.stage_actions(dp_rank, stage_index)`` for one rank."""

    def __init__(self, runner, layout: ParallelLayout, comm: StageComm | None, *,
                 lookahead: int = 2, host_tier=None) -> None:
        if lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {lookahead}")
        assert comm is not None or layout.pp_degree == 1, "pp > 1 needs a StageComm"
        self.runner = runner
        self.layout = layout
        self.comm = comm
        self.lookahead = lookahead
        self.host_tier = host_tier
        """Where offloaded activations wait: a unit's first is prefetched when its backward starts."""

    def _recv_kind(self, action) -> int | None:
        if action.is_forward:
            return None if self.layout.is_first_stage else HIDDEN
        return None if self.layout.is_last_stage else GRAD

    def _post_receives(self, actions, i: int, next_post: int, pending: dict[int, Transfer]) -> int:
        """Post receives for action ``i`` and the next ``lookahead`` ones before computing, so the
        peer's data lands while we work; returns the next action to post for."""
        while next_post < len(actions) and next_post <= i + self.lookahead:
            a = actions[next_post]
            kind = self._recv_kind(a)
            if kind is not None:
                pending[next_post] = self.comm.post_recv(
                    self.runner.output_shape(a.unit), kind, a.unit)
            next_post += 1
        return next_post

    def _reap_sends(self, sends: list[Transfer], proven_by_action, *, step: int,
                    label: str) -> tuple[list[Transfer], list[Transfer]]:
        """``(finished, still in flight)`` of ``sends`` after an action.

        The caller keeps ``finished`` for one more action, so that this thread, not gloo's worker
        thread (which may still hold a reference when the send reports completion), frees their
        buffers; a CPU allocator probe sees only this thread's frees (profiling/memory_events.py).
        gloo never reports a send complete until it is waited on: wait on those this action's
        receive proved the peer took (send_release.py; returns at once)."""
        proven = set(proven_by_action)
        done = []
        for s in sends:
            if ("F" if s.kind == HIDDEN else "B", s.unit_id) in proven:
                self.comm.wait(s, step=step, action=label)
                done.append(True)
            else:
                done.append(s.work.is_completed())  # asked once: a send may finish meanwhile
        return [s for s, d in zip(sends, done) if d], [s for s, d in zip(sends, done) if not d]

    def run(self, plan, *, step: int, train: bool = True) -> ExecutorResult:
        """Run the actions (``train=False``: only the forwards, without autograd graphs).

        The caller has called ``runner.begin_step`` and calls ``runner.end_step`` afterwards.
        """
        lay = self.layout
        actions = rank_actions(plan, lay.dp_rank, lay.stage_index, lay.sp_rank)
        if not train:
            actions = [a for a in actions if a.is_forward]
        timeline = Timeline(step=step)
        pending: dict[int, Transfer] = {}
        sends: list[Transfer] = []
        next_post = 0
        loss_parts: list[torch.Tensor] = []
        loss_units: list[int] = []
        finished: list[Transfer] = []
        previous = (rank_actions(plan, lay.dp_rank, lay.stage_index - 1, lay.sp_rank)
                    if train and not lay.is_first_stage else None)
        release = send_release_points(actions, previous, is_last_stage=lay.is_last_stage,
                                      is_first_stage=lay.is_first_stage) if train else {}

        for i, action in enumerate(actions):
            next_post = self._post_receives(actions, i, next_post, pending)
            start = time.time()
            cpu0 = time.thread_time()
            waited0 = self.comm.wait_time_s if self.comm else 0.0
            label = str(action)
            data = self.comm.wait(pending.pop(i), step=step, action=label) if i in pending else None
            if action.is_forward:
                out = (self.runner.forward(action.unit, data) if train
                       else self.runner.forward_only(action.unit, data))
                if lay.is_last_stage:
                    loss_parts.append(out.detach())
                    loss_units.append(action.unit)
                else:
                    sends.append(self.comm.post_send(out, HIDDEN, action.unit))
            else:
                if self.host_tier is not None:
                    self.host_tier.prefetch_tag(action.unit)  # CUDA: copies back overlap the backward
                grad_in = self.runner.backward(action.unit, data)
                if not lay.is_first_stage:
                    assert grad_in is not None, f"stage {lay.stage_index} returned no input grad"
                    sends.append(self.comm.post_send(grad_in, GRAD, action.unit))
            waited = (self.comm.wait_time_s if self.comm else 0.0) - waited0
            timeline.add(TimelineEvent(lay.rank, lay.stage_index, lay.dp_rank, label, start,
                                       time.time(), waited, time.thread_time() - cpu0))
            # ``finished`` holds the sends that went out until the next action (``_reap_sends``).
            finished, sends = self._reap_sends(sends, release.get(i, ()), step=step, label=label)

        assert not pending, f"receives posted but never consumed: {sorted(pending)}"
        for s in sends:
            self.comm.wait(s, step=step, action=f"end of step (send of unit {s.unit_id})")
        loss = float(torch.stack(loss_parts).sum().item()) if loss_parts else 0.0
        bad = () if math.isfinite(loss) else tuple(
            u for u, part in zip(loss_units, torch.stack(loss_parts).tolist()) if not math.isfinite(part))
        return ExecutorResult(loss_part=loss, timeline=timeline, nonfinite_units=bad)
