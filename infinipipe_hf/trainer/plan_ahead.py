"""Planning the next global batch in a planner process while the current one trains.

Design ("plan one step ahead", see docs/architecture.md): the training loader calls ``submit`` for
each batch one batch *before* yielding it, which starts ``engine.make_plan`` on a worker thread;
``take`` in ``training_step`` returns that plan (and its simulation), waiting only if planning is
slower than a step.  Plans are a pure function of the batch's lengths, so planning early changes
nothing in the result, only when it is computed.  Batches are consumed in the order they are
submitted, so a FIFO suffices; a batch that was not submitted (after a resume, the Trainer
rebuilds the loader without the look-ahead) or does not match the queue head is planned
synchronously and the queue is dropped.

Collectives never run on the worker thread (they would race the step's own communication):
the thread only plans locally; ``take`` (main thread) checks that all ranks planned the same
(one small all-reduce with a deadline: the engine's ``PlanAgreement``) and otherwise returns
``None`` so the engine plans
the step itself, with its fall-back to rank 0's plan (a solver with a wall-clock limit can make
ranks disagree).  With ``seed_plan_on_rank0`` every step is planned by the engine.

The engine's default planner runs in a separate process (``planner/worker.py``) fed the same
``plan_step`` request the engine would make, so planning never holds the training loop's GIL and
the plan is the one the engine would have made.  An injected planner (a callable that may hold the
engine) runs on a worker thread instead.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from infinipipe_hf.planner.worker import PlannerProcess, reraise_warnings
from infinipipe_hf.runtime.engine.planning import plan_from_result


def batch_lengths(batch) -> tuple[int, ...]:
    return tuple(len(item["input_ids"]) for item in batch)


class PlanAhead:
    """FIFO of plans being computed for upcoming batches of one engine."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.enabled = not engine.config.seed_plan_on_rank0
        self._queue: deque[tuple[tuple[int, ...], Future]] = deque()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="epp-plan") if self.enabled else None
        self._process = None
        """The planner process, started at the first batch planned with the default planner."""
        self.hits = 0
        """Batches whose plan came from the look-ahead (for tests and logs)."""

    @property
    def in_process(self) -> bool:
        """Whether plans are being made in a planner process (the default planner), not a thread."""
        return self._process is not None

    def submit(self, batch) -> None:
        if self._pool is None:
            return
        key = batch_lengths(batch)
        if self.engine.planner is None:
            if self._process is None:
                self._process = PlannerProcess()
            request = self.engine.default_planner.request(self.engine)
            self._queue.append((key, self._process.submit(list(key), request)))
        else:  # local planning only: no collective on this thread
            self._queue.append((key, self._pool.submit(lambda: (self.engine.planner(list(key), self.engine), []))))

    def take(self, batch) -> tuple[Any, Any] | None:
        """``(plan, simulation)`` for ``batch`` if it was submitted, else ``None``."""
        key = batch_lengths(batch)
        if not (self._queue and self._queue[0][0] == key):
            self.clear()
            return None
        _, future = self._queue.popleft()
        try:
            plan, sim = self._planned(future.result(), key)
        except ValueError:  # e.g. infeasible: the engine re-plans and reports it on every rank
            plan, sim = None, None
        if not self.engine.plan_agreement.all_agree(plan, step=self.engine.step_count):
            return None  # every rank gets the same answer, so all re-plan in the engine together
        self.hits += 1
        return plan, sim

    @staticmethod
    def _planned(answer, key) -> tuple[Any, Any]:
        """``(plan, simulation)`` from a planner's ``(result, warnings it raised elsewhere)``."""
        result, caught = answer
        reraise_warnings(caught)
        return plan_from_result(result, list(key))

    def drop(self, batch) -> None:
        """Forget ``batch``'s plan (the batch is not run, e.g. it has no label token)."""
        if self._queue and self._queue[0][0] == batch_lengths(batch):
            _, future = self._queue.popleft()
            future.cancel() or future.exception()

    def clear(self) -> None:
        # Finish (and ignore) queued work so no planner thread outlives its batch's relevance.
        while self._queue:
            _, future = self._queue.popleft()
            future.cancel() or future.exception()

    def close(self) -> None:
        self.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._process is not None:
            self._process.close()
            self._process = None
