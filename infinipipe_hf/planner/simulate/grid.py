"""Stage-by-time text grid of one DP replica, with chosen actions marked (for error messages).

Design: the time axis is the slot of each action in a dependency-driven replay with unit
durations and no transfer time (:func:`replay.replay`), so the grid shows what would run together,
not the raw list positions.  Rows are stages, each cell the action string, a marked action is
printed ``[B7]!``.  When the replay gets stuck (a deadlock) the actions that never ran follow a
``|`` on each row, in list order, so the blocked ones are visible and markable too.  With SP
rounds (``sub_groups``) a unit on part of its stage's SP ranks is printed with them, ``F7@r2`` or
``F7@r0-3``; a round's units are consecutive on every row.

Trade-off: a 512-unit plan has over a thousand slots; only a window of ``max_columns`` slots is
printed, centred on the first mark, so the message stays readable where it matters.
"""
from __future__ import annotations

from typing import Collection, Mapping, Sequence

from infinipipe_hf.ir.actions import Action
from infinipipe_hf.ir.sp_rounds import SubGroup
from infinipipe_hf.planner.simulate.replay import ReplayResult, replay


def slot_replay(stage_actions: Sequence[Sequence[Action]]) -> ReplayResult:
    """Replay with every action one slot long and free transfers."""
    return replay(stage_actions, lambda _s, _a: 1.0, lambda _a: 0.0)


def format_grid(stage_actions: Sequence[Sequence[Action]], marks: Collection[tuple[int, int]] = (), *,
                dp_rank: int = 0, max_columns: int = 24, max_waiting: int = 8,
                sub_groups: Mapping[int, SubGroup] | None = None) -> str:
    """Text grid of ``stage_actions`` (one replica); ``marks`` are (stage, action index) pairs;
    ``sub_groups``: unit id -> its SP sub-group, for units not on the whole SP group."""
    marks = set(marks)
    groups = sub_groups or {}

    def name(a: Action) -> str:
        g = groups.get(a.unit)
        if g is None:
            return str(a)
        return f"{a}@r{g.offset}" if g.size == 1 else f"{a}@r{g.offset}-{g.offset + g.size - 1}"

    rep = slot_replay(stage_actions)
    p = len(stage_actions)
    slots: list[dict[int, int]] = [{} for _ in range(p)]  # stage -> slot -> action index
    for s in range(p):
        for i, t in enumerate(rep.start[s]):
            slots[s][int(t)] = i
    num_slots = max((int(e[-1]) for e in rep.end if e), default=0)
    width = max((len(name(a)) for acts in stage_actions for a in acts), default=2) + 3

    def cell(s: int, i: int) -> str:
        text = name(stage_actions[s][i])
        text = f"[{text}]!" if (s, i) in marks else f" {text} "
        return text.ljust(width)

    # Window the time axis around the first mark that ran (or the end, for stuck marks).
    marked_slots = sorted(int(rep.start[s][i]) for s, i in marks if s < p and i < rep.done[s])
    stuck_marked = any(i >= rep.done[s] for s, i in marks if s < p)
    lo, hi = 0, num_slots
    if num_slots > max_columns:
        if marked_slots and not stuck_marked:
            centre = marked_slots[0]
        elif stuck_marked or marks:
            centre = num_slots
        else:
            centre = 0
        lo = max(0, min(centre - max_columns // 2, num_slots - max_columns))
        hi = lo + max_columns
    label_w = len(f"dp{dp_rank} s{p - 1}") + 1
    header = " " * label_w + "|" + "".join(f"t{t}".ljust(width) for t in range(lo, hi))
    lines = [f"stage-by-time grid of dp replica {dp_rank} (slots {lo}..{max(hi - 1, lo)} of {num_slots})"
             + (", earlier slots not shown" if lo > 0 else "") + (", later slots not shown" if hi < num_slots else "")
             + ("; F7@r0-3: unit 7 on SP ranks 0..3 of its stage (a round's units run side by side)" if groups else ""),
             header]
    any_waiting = not rep.complete
    for s in range(p):
        row = f"dp{dp_rank} s{s}".ljust(label_w) + "|"
        row += "".join(cell(s, slots[s][t]) if t in slots[s] else " .".ljust(width) for t in range(lo, hi))
        if any_waiting:
            left = range(rep.done[s], len(stage_actions[s]))
            shown = [cell(s, i).rstrip() for i in list(left)[:max_waiting]]
            more = f" (+{len(left) - max_waiting} more)" if len(left) > max_waiting else ""
            row += " | never ran: " + (" ".join(shown) + more if shown else "-")
        lines.append(row.rstrip())
    return "\n".join(lines)
