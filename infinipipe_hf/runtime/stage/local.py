"""Run a whole plan in one process: every stage in memory, tensors passed directly.

Design: a tiny dataflow interpreter over the plan's per-stage action lists.  It repeatedly runs
the next action of the lowest-indexed stage whose input is ready (``F<u>`` needs the previous
stage's output of ``u``; ``B<u>`` needs the next stage's input-gradient of ``u``, or on the last
stage its own forward), so it executes any order a real pipeline could, and reports a plan that
would hang as an error instead.  It is the reference executor for tests (exact gradients against
the unsplit model without processes) and for debugging plans; it has no overlap and no
communication, which is the trade-off against the distributed executor.  DP replicas run one
after another on the same stages, so gradients accumulate and loss parts sum as an all-reduce
would.
"""
from __future__ import annotations

from typing import Sequence

import torch

from infinipipe_hf.ir.plan import Plan
from infinipipe_hf.runtime.stage.module import StageModule
from infinipipe_hf.runtime.stage.runner import StageRunner
from infinipipe_hf.runtime.stage.unit_tensors import label_token_count


def _run_replica(runners: list[StageRunner], plan: Plan, dp_rank: int) -> float:
    pp = len(runners)
    lists = [plan.stage_actions(dp_rank, s) for s in range(pp)]
    ptr = [0] * pp
    hidden: dict[tuple[int, int], torch.Tensor] = {}  # (stage, unit) -> output of stage for unit
    grads: dict[tuple[int, int], torch.Tensor] = {}  # (stage, unit) -> grad of stage's input
    done_f: set[tuple[int, int]] = set()
    loss = 0.0
    while any(ptr[s] < len(lists[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            if ptr[s] >= len(lists[s]):
                continue
            a = lists[s][ptr[s]]
            if a.is_forward:
                if s > 0 and (s - 1, a.unit) not in hidden:
                    continue
                x = hidden.pop((s - 1, a.unit)) if s > 0 else None
                out = runners[s].forward(a.unit, x)
                done_f.add((s, a.unit))
                if s == pp - 1:
                    loss += float(out)
                else:
                    hidden[(s, a.unit)] = out
            else:
                if s == pp - 1:
                    if (s, a.unit) not in done_f:
                        continue
                    g_in = None
                elif (s + 1, a.unit) not in grads:
                    continue
                else:
                    g_in = grads.pop((s + 1, a.unit))
                g = runners[s].backward(a.unit, g_in)
                if s > 0:
                    grads[(s, a.unit)] = g
            ptr[s] += 1
            progressed = True
            break
        if not progressed:
            stuck = ", ".join(f"stage {s}: {lists[s][ptr[s]]}" for s in range(pp) if ptr[s] < len(lists[s]))
            raise ValueError(f"plan deadlocks on dp replica {dp_rank}: no stage can run its next action "
                             f"({stuck})")
    return loss


def run_plan_locally(stages: Sequence[StageModule], plan: Plan, batch: list[dict], *,
                     loss_chunk_tokens: int = 4096, attention_backend: str = "auto") -> float:
    """Run one training step of ``plan``; gradients accumulate in ``.grad``; return the mean token loss."""
    if len(stages) != plan.pp_degree:
        raise ValueError(f"got {len(stages)} stages for a plan with pp_degree={plan.pp_degree}; "
                         f"build one stage per pipeline rank")
    for i, st in enumerate(stages):
        if st.stage_index != i:
            raise ValueError(f"stages[{i}] has stage_index={st.stage_index}; pass stages in order")
    runners = [StageRunner(st, loss_chunk_tokens=loss_chunk_tokens, attention_backend=attention_backend)
               for st in stages]
    count = label_token_count(batch)
    for r in runners:
        r.begin_step(plan, batch, count)
    loss = 0.0
    for dp_rank in sorted(plan.actions):
        loss += _run_replica(runners, plan, dp_rank)
    for r in runners:
        r.end_step()
    return loss
