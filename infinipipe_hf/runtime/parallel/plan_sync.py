"""Cross-rank plan agreement: every rank must run the same plan, or shapes mismatch and hang.

Design: plans are a pure function of the batch's lengths, so normally every rank plans locally
and one tiny all-reduce of a digest checks that they agree (``digest`` hashes the plan without
its free-form ``info``).  A planner with a wall-clock limit (the MILP solver) can make ranks
disagree; then everyone takes rank 0's plan through ``broadcast_object_list``, and a planning
failure on rank 0 is broadcast as well so no rank waits for a plan that never comes.  Every
collective here has a deadline (``wait_collective``).

The engine and the trainer's plan-ahead worker share this class, so the digest and the fall-back
exist once.  Only the main thread may call it (collectives must not race the step's own).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Callable

import torch

from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.runtime.parallel.comm import wait_collective
from infinipipe_hf.runtime.parallel.mesh import ParallelLayout
from infinipipe_hf.runtime.parallel.peer_watch import verdict_of, watching


def plan_digest(plan: Plan | None) -> int:
    """A 56-bit hash of everything in ``plan`` that decides the run (not ``info``); 0 for None."""
    if plan is None:
        return 0
    body = {k: v for k, v in plan.to_dict().items() if k != "info"}
    return 1 + int.from_bytes(hashlib.sha256(json.dumps(body, sort_keys=True).encode()).digest()[:7], "big")


def start_status_exchange(layout: ParallelLayout) -> None:
    """Beat this rank's heartbeat in the launcher's store, so a rank that loses a peer can tell a
    stopped or killed rank by name (``failures.py``) and a wait on a stopped peer ends within
    seconds (``peer_watch.py``); nothing to do in a world of one."""
    if layout.world_size > 1:
        from infinipipe_hf.runtime.parallel import peer_watch

        peer_watch.start(layout.rank)


class PlanAgreement:
    """Checks that all ranks hold the same plan, and distributes rank 0's when they do not."""

    def __init__(self, layout: ParallelLayout, device: torch.device, timeout_s: float) -> None:
        self.layout = layout
        self.device = device
        self.timeout_s = timeout_s
        start_status_exchange(layout)

    def all_agree(self, plan: Plan | None, *, step: int) -> bool:
        """True when every rank holds the same, non-None plan (one all-reduce of a digest)."""
        if self.layout.world_size == 1:
            return plan is not None
        import torch.distributed as dist

        h = plan_digest(plan)
        t = torch.tensor([h, -h], dtype=torch.int64, device=self.device)
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
        wait_collective(work, timeout_s=self.timeout_s, layout=self.layout,
                        ranks=list(range(self.layout.world_size)), what="plan agreement check",
                        step=step)
        return h != 0 and int(t[0]) == -int(t[1])

    def from_rank0(self, make_plan: Callable[[], tuple[Plan, Any]], *, step: int) -> tuple[Plan, Any]:
        """Rank 0 calls ``make_plan``; its plan (or its ``ValueError``) reaches every rank."""
        import torch.distributed as dist

        box: list[Any] = [None]
        if self.layout.rank == 0:
            try:
                plan, sim = make_plan()
                box[0] = ("ok", plan.to_dict(), sim)
            except ValueError as exc:  # every rank must learn of the failure, not hang
                box[0] = ("error", str(exc), None)
        # broadcast_object_list has no async form: bounded by the process group's own timeout,
        # ended earlier by the peer watch when a rank has stopped.
        ranks = list(range(self.layout.world_size))
        watch = None
        try:
            with watching(ranks, None, self.layout.describe) as watch:
                dist.broadcast_object_list(box, src=0)
        except Exception as exc:
            verdict = verdict_of(watch)
            if not verdict:
                raise
            raise RuntimeError(f"{self.layout.describe()}: step {step}, plan broadcast from rank 0: "
                               f"{verdict}") from exc
        status, payload, sim = box[0]
        if status != "ok":
            raise ValueError(payload)
        return Plan.from_dict(payload), sim
