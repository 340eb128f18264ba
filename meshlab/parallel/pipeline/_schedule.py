"""pipeline: split the repeated blocks into stages over a mesh axis.

The plan only records the choice; ``stages(plan)`` (on a bound plan) assigns blocks to
stages and ranks and ``bubble(plan)`` gives the expected idle fraction:

* GPipe and 1F1B:           (p - 1) / (m + p - 1)
* interleaved 1F1B (v > 1): (p - 1) / (v m + p - 1)
* zero-bubble and ZB-V (backward split into input and weight gradients, the weight
  work filling warm-up and cool-down): no closed form is used; the plan replays torch's
  own action lists with forward = 1, backward = 2 units (``simulate``), which gives the
  two formulas above exactly for the other schedules

with p pipeline ranks, m microbatches and v stages per rank.
"""

from __future__ import annotations

import dataclasses
import math

from ..._errors import ConfigError
from ..._plan import Plan, dtype_bytes

@dataclasses.dataclass(frozen=True)
class Stage:
    index: int                 # pipeline stage (chunk) index
    rank: int                  # coordinate on the pipeline axis that runs it
    blocks: tuple[str, ...]
    first: bool
    last: bool
    param_bytes: int


def _rank_of(chunk: int, p: int, v: int, schedule: str) -> int:
    if schedule == "zbv":                        # V shape: 0..p-1 then p-1..0
        return chunk if chunk < p else 2 * p - 1 - chunk
    return chunk % p


def stages(plan: Plan, opt) -> list[Stage]:
    """The stages of a bound plan with a pipeline: blocks balanced by parameter bytes."""
    p = plan.mesh_shape.get(opt.axis)
    if p is None:
        raise ConfigError(f"pipeline axis {opt.axis!r} is not a mesh axis "
                          f"{tuple(plan.mesh_shape)}")
    v = opt.v
    n = p * v
    blocks = plan.model.blocks
    if len(blocks) < n:
        raise ConfigError(f"pipeline: {len(blocks)} blocks cannot fill {n} stages "
                          f"({p} ranks x {v}); use fewer stages")
    size = {b: 0 for b in blocks}
    outside = [0, 0]
    for e in plan.params:
        if e.tied_to:
            continue
        nb = e.numel * dtype_bytes(e.dtype)
        owner = next((b for b in blocks if e.fqn.startswith(b + ".")), None)
        if owner is not None:
            size[owner] += nb
        else:
            outside["embed" not in e.fqn and "wte" not in e.fqn] += nb
    if opt.layers_per_stage is not None:
        counts = list(opt.layers_per_stage)
        if len(counts) != n or sum(counts) != len(blocks) or min(counts) < 1:
            raise ConfigError(f"layers_per_stage={counts}: give {n} positive counts summing to "
                              f"{len(blocks)}")
    else:
        counts = _balanced([size[b] for b in blocks], n, outside[0], outside[1])
    out, start = [], 0
    for i, c in enumerate(counts):
        bl = tuple(blocks[start:start + c])
        start += c
        nb = sum(size[b] for b in bl) + (outside[0] if i == 0 else 0) + \
            (outside[1] if i == n - 1 else 0)
        out.append(Stage(i, _rank_of(i, p, v, opt.schedule), bl, i == 0, i == n - 1, nb))
    return out


def rank_rows(plan: Plan, opt, rows: list) -> list:
    """The memory rows of the pipeline rank that holds the most bytes: its stages' blocks,
    the embedding on the first stage's rank, the rest outside the blocks on the last's
    (as ``stages`` places them). Rows of no parameter (a room's own) stay."""
    st = stages(plan, opt)
    blocks = {b: s.rank for s in st for b in s.blocks}
    first = next(s.rank for s in st if s.first)
    last = next(s.rank for s in st if s.last)
    fqns = {e.fqn for e in plan.params}

    def rank_of(fqn: str) -> int | None:
        if fqn not in fqns:
            return None
        owner = next((b for b in blocks if fqn.startswith(b + ".")), None)
        if owner is not None:
            return blocks[owner]
        return first if ("embed" in fqn or "wte" in fqn) else last

    by_rank: dict = {}
    for r in rows:
        by_rank.setdefault(rank_of(r.fqn), []).append(r)
    shared = by_rank.pop(None, [])
    if not by_rank:
        return rows
    heaviest = max(by_rank, key=lambda k: (sum(r.bytes for r in by_rank[k]), -k))
    return by_rank[heaviest] + shared


def _balanced(weights: list[int], n: int, head: int, tail: int) -> list[int]:
    """Contiguous split of ``weights`` into ``n`` non-empty parts minimizing the heaviest
    part, with ``head`` added to the first part and ``tail`` to the last (binary search on
    the capacity, greedy packing)."""

    def pack(cap: int) -> list[int] | None:
        counts, acc, cnt = [], head, 0
        for i, w in enumerate(weights):
            left = len(weights) - i                 # blocks still to place, this one included
            need = n - len(counts) - 1               # stages still to open after this one
            if cnt and (acc + w > cap or left <= need):
                counts.append(cnt)
                acc, cnt = 0, 0
            acc += w
            cnt += 1
        counts.append(cnt)
        if len(counts) != n or acc + tail > cap:
            return None
        return counts

    lo, hi = max(weights), sum(weights) + head + tail
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        got = pack(mid)
        if got is not None:
            best, hi = got, mid - 1
        else:
            lo = mid + 1
    if best is None:   # cannot happen with len(weights) >= n: one block per stage fits hi
        raise ConfigError(f"pipeline: cannot split {len(weights)} blocks into {n} stages")
    return best


def bubble(plan: Plan, opt) -> float:
    """Expected idle fraction of the pipeline schedule (module docstring)."""
    p, m, v = plan.mesh_shape[opt.axis], opt.microbatches, opt.v
    if opt.schedule in ("zero_bubble", "zbv"):
        events = simulate(plan, opt)
        end = max(e[2] for e in events)
        return 1 - sum(e[2] - e[1] for e in events) / (p * end)
    return (p - 1) / (v * m + p - 1)


def stage_table(plan: Plan, opt):
    """A rich table: each stage's rank, blocks and parameter bytes, and the bubble."""
    from rich.table import Table

    from ..._plan_view import _fmt_bytes

    t = Table(title=f"pipeline: {opt.schedule}, {opt.microbatches} microbatches, expected "
                    f"idle fraction {bubble(plan, opt):.1%}")
    for c in ("stage", "rank", "blocks", "params"):
        t.add_column(c, justify="right" if c in ("stage", "rank", "params") else "left")
    for s in stages(plan, opt):
        extra = (" + embeddings" if s.first else "") + (" + norm, head" if s.last else "")
        span = f"{s.blocks[0]} .. {s.blocks[-1].rsplit('.', 1)[-1]} ({len(s.blocks)}){extra}"
        t.add_row(str(s.index), str(s.rank), span, _fmt_bytes(s.param_bytes))
    return t


def _actions(schedule: str, p: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
    """Per-rank (kind, stage, microbatch) lists: meshlab's own for GPipe and 1F1B, torch's
    schedule generator for the others."""
    if schedule == "gpipe":
        return [[("FORWARD", r, i) for i in range(m)] + [("FULL_BACKWARD", r, i) for i in range(m)]
                for r in range(p)]
    if schedule == "1f1b":
        rows = []
        for r in range(p):
            warm = min(p - 1 - r, m)
            row = [("FORWARD", r, i) for i in range(warm)]
            f, b = warm, 0
            while b < m:
                if f < m:
                    row.append(("FORWARD", r, f))
                    f += 1
                row.append(("FULL_BACKWARD", r, b))
                b += 1
            rows.append(row)
        return rows
    from torch.distributed.pipelining import schedules as S
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    cls = {"interleaved": S.ScheduleInterleaved1F1B, "zero_bubble": S.ScheduleInterleavedZeroBubble,
           "zbv": S.ScheduleZBVZeroBubble}[schedule]
    ops = get_schedule_ops(cls, p, m, num_stages_per_rank=v)
    out = []
    for row in ops:
        acts = []
        for a in row:
            kind = str(a.computation_type).rsplit(".", 1)[-1] if a is not None else None
            if kind in ("FORWARD", "FULL_BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT"):
                acts.append((kind, a.stage_index, a.microbatch_index))
        out.append(acts)
    return out


def simulate(plan: Plan, opt, forward: float = 1.0, backward: float = 2.0):
    """Replay the schedule's per-rank action lists (torch's own) with unit costs and the
    stage dependencies: returns ``[(rank, start, end, 'F'|'B', microbatch, stage)]``."""
    p, m, v = plan.mesh_shape[opt.axis], opt.microbatches, opt.v
    rows = _actions(opt.schedule, p, m, v)
    n = p * v
    done: dict = {}
    clock = [0.0] * p
    pos = [0] * p
    out = []
    while any(pos[r] < len(rows[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if pos[r] >= len(rows[r]):
                continue
            kind, st, mb = rows[r][pos[r]]
            if kind == "FORWARD":
                dep = [("F", st - 1, mb)] if st > 0 else []
                cost, tag = forward, "F"
            elif kind == "BACKWARD_WEIGHT":
                dep, cost, tag = [("I", st, mb)], backward / 2, "W"
            else:   # FULL_BACKWARD, or BACKWARD_INPUT (the input-gradient half)
                dep = [("F", st, mb)] + ([("I", st + 1, mb)] if st < n - 1 else [])
                cost = backward / 2 if kind == "BACKWARD_INPUT" else backward
                tag = "I" if kind == "BACKWARD_INPUT" else "B"
            if any(d not in done for d in dep):
                continue
            t0 = max([clock[r]] + [done[d] for d in dep])
            clock[r] = t0 + cost
            done[(tag if tag != "B" else "I", st, mb)] = clock[r]
            out.append((r, t0, clock[r], tag, mb, st))
            pos[r] += 1
            progressed = True
        if not progressed:
            raise ConfigError(f"the {opt.schedule} schedule cannot make progress for "
                              f"p={p}, m={m}, v={v}")
    return out


def draw_schedule(plan: Plan, opt) -> str:
    """A text picture of the schedule: one row per pipeline rank, one column per unit of
    time (a forward is 1 unit, a backward 2), the microbatch number in each busy cell
    (``F``orward rows above, ``b``ackward lowercase), ``.`` where the rank waits."""
    events = simulate(plan, opt)
    p = plan.mesh_shape[opt.axis]
    end = int(round(max(e[2] for e in events)))
    grid = [["." for _ in range(end)] for _ in range(p)]
    for r, t0, t1, tag, mb, _ in events:
        for t in range(int(round(t0)), int(round(t1))):
            grid[r][t] = str(mb % 10) if tag == "F" else "abcdefghijklmnopqrstuvwxyz"[mb % 26]
    busy = sum(e[2] - e[1] for e in events) / (p * end)
    lines = [f"rank {r}: " + "".join(row) for r, row in enumerate(grid)]
    lines.append(f"(digits: forward of microbatch k; letters: its backward; idle {1 - busy:.1%})")
    return "\n".join(lines)
