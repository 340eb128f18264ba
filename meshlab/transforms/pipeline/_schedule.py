"""pipeline: split the repeated blocks into stages over a mesh axis.

``split`` assigns blocks to stages and ranks once, in ``bind`` (``Pipeline.decide``): the
bound plan records the result (``PipelineStages``) and ``stages(plan, opt)`` reads it
there. ``bubble(plan)`` gives the expected idle fraction:

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
import functools
import math

from ...core.errors import ConfigError, PlanError
from ...core.placement import local_shape
from ...core.names import ancestors, owner as plan_owner
from ...planning.decisions import register_decision
from ...planning.plan import Plan, dtype_bytes


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pipeline stage: its blocks, the pipeline rank that runs it, whether it holds the
    embeddings (``first``) or the final norm and head (``last``), the bytes of its whole
    parameters and those one rank of it holds (its local shards, ``rank_bytes``)."""

    index: int                 # pipeline stage (chunk) index
    rank: int                  # coordinate on the pipeline axis that runs it
    blocks: tuple[str, ...]
    first: bool
    last: bool
    param_bytes: int
    rank_bytes: int = 0

    def to_json(self) -> list:
        return [self.index, self.rank, list(self.blocks), self.first, self.last,
                self.param_bytes, self.rank_bytes]

    @classmethod
    def from_json(cls, d: list) -> "Stage":
        return cls(d[0], d[1], tuple(d[2]), d[3], d[4], d[5], d[6])


@dataclasses.dataclass(frozen=True)
class PipelineStages:
    """What ``pipeline`` decided in ``bind``: its stages in order (``split``), and the
    modules outside the blocks that the first stage alone holds (``before``: registered
    before the first block, the embeddings) and the last alone (``after``: the final
    norm and the head), from the module order (``_blocks.ends``)."""

    stages: tuple[Stage, ...]
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"stages": [s.to_json() for s in self.stages], "before": list(self.before),
                "after": list(self.after)}

    @classmethod
    def from_json(cls, d: dict) -> "PipelineStages":
        return cls(tuple(Stage.from_json(s) for s in d["stages"]), tuple(d["before"]),
                   tuple(d["after"]))

    def first_holds(self, fqn: str) -> bool:
        """Whether parameter ``fqn`` (outside the blocks) is the first stage's."""
        return plan_owner(fqn, set(self.before)) is not None


register_decision("pipeline.stages", PipelineStages)


def _rank_of(chunk: int, p: int, v: int, schedule: str) -> int:
    if schedule == "zbv":                        # V shape: 0..p-1 then p-1..0
        return chunk if chunk < p else 2 * p - 1 - chunk
    return chunk % p


def stages(plan: Plan, opt) -> list[Stage]:
    """The stages ``bind`` recorded for the bound ``plan`` (``PipelineStages``)."""
    got = plan.decision(PipelineStages)
    if got is None:
        raise PlanError(f"{opt!r}: this plan records no pipeline stages; bind the spec that "
                        f"holds the pipeline with plan.bind(mesh) (or meshlab.plan(model, "
                        f"spec, mesh)), which splits the blocks once")
    return list(got.stages)


def split(plan: Plan, opt) -> PipelineStages:
    """The stages of a bound plan with a pipeline: blocks balanced by their compute (the
    matmul weights each token meets: the blocks', and the head's on the last stage; or
    ``layers_per_stage``), each stage on its rank (``Pipeline.decide``)."""
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
    sides, size, outside, cost, cost_outside = _tallies(plan)
    if opt.layers_per_stage is not None:
        counts = list(opt.layers_per_stage)
        if len(counts) != n or sum(counts) != len(blocks) or min(counts) < 1:
            raise ConfigError(f"layers_per_stage={counts}: give {n} positive counts summing to "
                              f"{len(blocks)}")
    else:
        counts = _balanced([cost[b] for b in blocks], n, cost_outside[0], cost_outside[1])
    out, start = [], 0
    for i, c in enumerate(counts):
        bl = tuple(blocks[start:start + c])
        start += c
        nb = sum(size[b] for b in bl) + (outside[0] if i == 0 else 0) + \
            (outside[1] if i == n - 1 else 0)
        out.append(Stage(i, _rank_of(i, p, v, opt.schedule), bl, i == 0, i == n - 1, nb))
    held = _stages_rank_bytes(plan, out, sides)
    return dataclasses.replace(sides, stages=tuple(
        dataclasses.replace(s, rank_bytes=b) for s, b in zip(out, held)))


_TALLIES: list = []     # (params, model, tallies): ``_tallies`` of the last few tables


def _tallies(plan: Plan) -> tuple:
    """``split``'s reading of the parameters, read-only: the modules the first and the
    last stage alone hold (``PipelineStages`` without stages), each block's bytes, the
    bytes outside the blocks on the first and the last stage, each block's compute and
    that outside. A function of the parameter table and the model alone (immutable),
    kept for the last few (the meshes that bind a table alike share it)."""
    for params, model, got in _TALLIES:
        if params is plan.params and model is plan.model:
            return got
    from ._blocks import ends

    blocks = plan.model.blocks
    sides = PipelineStages((), *ends(plan))
    size = {b: 0 for b in blocks}
    outside = [0, 0]
    # compute per token, in matmul weights: a block's products, the head's on the last
    # stage; an embedding is a lookup and a norm or bias is elementwise, so neither
    # weighs (balancing bytes gave the first stage, whose embedding is large and cheap,
    # the fewest blocks and left it idle)
    cost = {b: 0 for b in blocks}
    cost_outside = [0, 0]
    for e in plan.params:
        if e.tied_to:
            continue
        nb = e.numel * dtype_bytes(e.dtype)
        matmul = e.numel if len(e.shape) >= 2 else 0
        owner = plan_owner(e.fqn, size)
        if owner is not None:
            size[owner] += nb
            cost[owner] += matmul
        else:
            last = not sides.first_holds(e.fqn)
            outside[last] += nb
            cost_outside[last] += matmul if last else 0
    got = (sides, size, outside, cost, cost_outside)
    _TALLIES.insert(0, (plan.params, plan.model, got))
    del _TALLIES[4:]
    return got


def rank_rows(plan: Plan, opt, rows: list) -> list:
    """The memory rows of the pipeline rank that holds the most bytes: its stages' blocks,
    the embedding on the first stage's rank, the rest outside the blocks on the last's
    (as ``stages`` places them). Rows of no parameter (a room's own) stay."""
    st = stages(plan, opt)
    sides = plan.decision(PipelineStages)
    blocks = {b: s.rank for s in st for b in s.blocks}
    first = next(s.rank for s in st if s.first)
    last = next(s.rank for s in st if s.last)
    fqns = {e.fqn for e in plan.params}
    if first != last and opt.blocks is None:
        # a head tied to the embeddings: the last stage's rank holds a copy of the weight
        # and its gradient, not its optimizer state (``_runtime.TiedHead``)
        copy = {e.tied_to: e.fqn for e in plan.params if e.tied_to}
        rows = rows + [dataclasses.replace(r, fqn=copy[r.fqn]) for r in rows
                       if r.fqn in copy and r.category in ("params", "grads")]

    def rank_of(fqn: str) -> int | None:
        if fqn not in fqns:
            return None
        owner = plan_owner(fqn, blocks)
        if owner is not None:
            return blocks[owner]
        return first if sides.first_holds(fqn) else last

    by_rank: dict = {}
    rank: dict = {}                 # fqn -> rank_of(fqn): a parameter has several rows
    for r in rows:
        if r.fqn not in rank:
            rank[r.fqn] = rank_of(r.fqn)
        by_rank.setdefault(rank[r.fqn], []).append(r)
    shared = by_rank.pop(None, [])
    if not by_rank:
        return rows
    # Among equals, the rank ``plan.comm()`` counts by default (``busiest_rank``'s order).
    heaviest = max(by_rank, key=lambda k: (sum(r.bytes for r in by_rank[k]),
                                           sum(len(s.blocks) for s in st if s.rank == k),
                                           boundaries(st, k), -k))
    return by_rank[heaviest] + shared


def boundaries(st: list, rank: int) -> int:
    """The boundaries between stages on two different ranks that ``rank`` sits on."""
    return sum(1 for a, b in zip(st, st[1:]) if a.rank != b.rank and rank in (a.rank, b.rank))


def stage_rank_bytes(plan: Plan, s: Stage, sides: PipelineStages | None = None) -> int:
    """The parameter bytes one rank of stage ``s`` holds: the local shards of its blocks'
    parameters, of the modules before the blocks on the first stage and of those after on
    the last (tied parameters once), as ``sides`` (default: the plan's decision) says."""
    sides = sides if sides is not None else plan.decision(PipelineStages)
    return _stages_rank_bytes(plan, [s], sides)[0]


def _stages_rank_bytes(plan: Plan, st: list[Stage], sides: PipelineStages) -> list[int]:
    """``stage_rank_bytes`` of every stage of ``st``, in one pass over the parameters: each
    parameter's local bytes counted on the stages holding a block it lies under, or,
    outside the blocks, on the first stage or the last (as ``sides`` says); tied
    parameters once."""
    sizes = plan.mesh_shape
    blocks = set(plan.model.blocks)
    holding: dict[str, list[int]] = {}          # block -> the stages that hold it
    for i, s in enumerate(st):
        for b in s.blocks:
            holding.setdefault(b, []).append(i)
    first = [i for i, s in enumerate(st) if s.first]
    last = [i for i, s in enumerate(st) if s.last]
    totals = [0] * len(st)
    for e in plan.params:
        if e.tied_to:
            continue
        under = [a for a in ancestors(e.fqn) if a in blocks]
        if under:
            on = {i for a in under for i in holding.get(a, ())}
        else:
            on = first if sides.first_holds(e.fqn) else last
        if on:
            nb = math.prod(local_shape(e.shape, e.mesh_spec, sizes)) * dtype_bytes(e.dtype)
            for i in on:
                totals[i] += nb
    return totals


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
    """A rich table: each stage's rank, blocks and the parameter bytes one rank of it holds
    (its local shards, ``Stage.rank_bytes``), and the bubble."""
    from rich.table import Table

    from ...core.units import fmt_bytes

    t = Table(title=f"pipeline: {opt.schedule}, {opt.microbatches} microbatches, expected "
                    f"idle fraction {bubble(plan, opt):.1%}")
    for c in ("stage", "rank", "blocks", "params per rank"):
        t.add_column(c, justify="left" if c == "blocks" else "right")
    for s in stages(plan, opt):
        extra = (" + embeddings" if s.first else "") + (" + norm, head" if s.last else "")
        span = f"{s.blocks[0]} .. {s.blocks[-1].rsplit('.', 1)[-1]} ({len(s.blocks)}){extra}"
        t.add_row(str(s.index), str(s.rank), span, fmt_bytes(s.rank_bytes))
    return t


def _actions(schedule: str, p: int, m: int, v: int) -> tuple:
    """Per-rank sequences of (kind, stage, microbatch): meshlab's own for GPipe and 1F1B,
    torch's schedule generator for the others."""
    return _schedule_actions(schedule, p, m, v)


# Keyed on the schedule's name and sizes, which alone decide its actions; the answer is
# made of tuples (immutable), read by every layout with that pipeline.
@functools.lru_cache(maxsize=256)
def _schedule_actions(schedule: str, p: int, m: int, v: int) -> tuple:
    return tuple(tuple(row) for row in _make_actions(schedule, p, m, v))


def _make_actions(schedule: str, p: int, m: int, v: int) -> list[list[tuple[str, int, int]]]:
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


def torch_actions(schedule: str, p: int, m: int, v: int) -> dict:
    """``_actions`` as torch's schedule runtime reads them: rank -> ``_Action`` list."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    return {r: [_Action(st, _ComputationType[kind], mb) for kind, st, mb in row]
            for r, row in enumerate(_actions(schedule, p, m, v))}


def simulate(plan: Plan, opt, forward: float = 1.0, backward: float = 2.0, costs=None):
    """Replay the schedule's per-rank action lists (the ones the runtime runs) with the
    stage dependencies: returns ``[(rank, start, end, 'F'|'B'|'I'|'W', microbatch,
    stage)]``. Every stage costs ``forward`` and ``backward`` per microbatch, or stage
    ``s`` costs ``costs[s] = (forward, backward)`` (``stage_costs``); a split backward's
    input and weight halves cost half the backward each."""
    p, m, v = plan.mesh_shape[opt.axis], opt.microbatches, opt.v
    rows = _actions(opt.schedule, p, m, v)
    n = p * v
    cost = costs or [(forward, backward)] * n

    def action(kind: str, st: int, mb: int) -> tuple:
        """(what it waits for, its cost, its tag, what it marks done) of one action."""
        f, b = cost[st]
        if kind == "FORWARD":
            dep = [("F", st - 1, mb)] if st > 0 else []
            c, tag = f, "F"
        elif kind == "BACKWARD_WEIGHT":
            dep, c, tag = [("I", st, mb)], b / 2, "W"
        else:   # FULL_BACKWARD, or BACKWARD_INPUT (the input-gradient half)
            dep = [("F", st, mb)] + ([("I", st + 1, mb)] if st < n - 1 else [])
            c = b / 2 if kind == "BACKWARD_INPUT" else b
            tag = "I" if kind == "BACKWARD_INPUT" else "B"
        return dep, c, tag, (tag if tag != "B" else "I", st, mb)

    done: dict = {}
    clock = [0.0] * p
    pos = [0] * p
    out = []
    made = [[None] * len(row) for row in rows]      # each action's ``action()``, once
    left = sum(len(row) for row in rows)            # actions not yet run
    while left:
        progressed = False
        for r in range(p):
            if pos[r] >= len(rows[r]):
                continue
            kind, st, mb = rows[r][pos[r]]
            got = made[r][pos[r]]
            if got is None:
                got = made[r][pos[r]] = action(kind, st, mb)
            dep, c, tag, key = got
            if any(d not in done for d in dep):
                continue
            t0 = max([clock[r]] + [done[d] for d in dep])
            clock[r] = t0 + c
            done[key] = clock[r]
            out.append((r, t0, clock[r], tag, mb, st))
            pos[r] += 1
            left -= 1
            progressed = True
        if not progressed:
            raise ConfigError(f"the {opt.schedule} schedule cannot make progress for "
                              f"p={p}, m={m}, v={v}")
    return out


def idle(plan: Plan, opt, costs) -> dict:
    """The schedule replayed at per-stage ``costs``: ``{'mean': the ranks' mean idle
    fraction of the step, 'busiest': the idle fraction of the rank with the most work,
    'per_rank': [...], 'step': the step's length in the costs' unit}``."""
    events = simulate(plan, opt, costs=costs)
    p = plan.mesh_shape[opt.axis]
    end = max(e[2] for e in events)
    busy = [0.0] * p
    for r, t0, t1, *_ in events:
        busy[r] += t1 - t0
    per = [1 - b / end for b in busy]
    top = max(range(p), key=lambda r: busy[r])
    return {"mean": sum(per) / p, "busiest": per[top], "per_rank": per, "step": end}


def stage_costs(plan: Plan, opt, seconds: dict) -> list[tuple[float, float]]:
    """Each stage's (forward, backward) seconds for one microbatch, from the whole batch's
    ``seconds``: ``{'block': (fwd, bwd) of one block, 'embed': (fwd, bwd) of the
    embeddings, 'head': (fwd, bwd) of the rest, the final norm, head and loss}``. The
    first stage adds the embeddings, the last the head and loss."""
    m = opt.microbatches
    bf, bb = seconds["block"]
    ef, eb = seconds.get("embed", (0.0, 0.0))
    hf, hb = seconds.get("head", (0.0, 0.0))
    out = []
    for s in stages(plan, opt):
        k = len(s.blocks)
        f = k * bf + (ef if s.first else 0.0) + (hf if s.last else 0.0)
        b = k * bb + (eb if s.first else 0.0) + (hb if s.last else 0.0)
        out.append((f / m, b / m))
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


def in_flight(plan: Plan, opt) -> dict[int, dict[int, int]]:
    """Pipeline rank -> stage -> the most microbatches whose forward on that stage has
    run and whose backward has not (weight-gradient steps included) at any one time."""
    flight = _in_flight(opt.schedule, plan.mesh_shape[opt.axis], opt.microbatches, opt.v)
    return {r: dict(most) for r, most in flight}


# Keyed on the schedule's name and sizes, which alone decide it; kept as tuples (immutable),
# each caller given dicts of its own.
@functools.lru_cache(maxsize=256)
def _in_flight(schedule: str, p: int, m: int, v: int) -> tuple:
    out: dict[int, dict[int, int]] = {}
    for r, row in enumerate(_actions(schedule, p, m, v)):
        live: dict[int, set] = {}
        most: dict[int, int] = {}
        for kind, st, mb in row:
            if kind == "FORWARD":
                live.setdefault(st, set()).add(mb)
                most[st] = max(most.get(st, 0), len(live[st]))
            elif kind in ("FULL_BACKWARD", "BACKWARD_WEIGHT"):   # the input half keeps them
                live.get(st, set()).discard(mb)
        out[r] = most
    return tuple((r, tuple(most.items())) for r, most in out.items())


def rank_activations(plan: Plan, opt, rows: list, head_modules: set[str]) -> list:
    """The activation rows of the pipeline rank that holds the most: each row of the
    block (profiled at the whole batch) once per block of each of its stages and per
    microbatch in flight there, at a microbatch's size; the embedding side on the first
    stage's rank, the head and loss on the last's (as ``stages`` places them)."""
    m = opt.microbatches
    st = stages(plan, opt)
    flight = in_flight(plan, opt)
    L = len(plan.model.blocks)
    first = next(s.rank for s in st if s.first)
    last = next(s.rank for s in st if s.last)
    head = [_head_side(row.module, head_modules) for row in rows]

    def held(r: int) -> list:
        """``(row, bytes, copies, note)`` for each row rank ``r`` holds, in order."""
        blocks = sum(len(s.blocks) * flight[r].get(s.index, 0) for s in st if s.rank == r)
        out = []
        for row, h in zip(rows, head):
            if row.in_block:
                out.append((row, row.bytes / m, row.copies * blocks / L,
                            f"{blocks} block-microbatches in flight"))
            elif h:
                if r == last:
                    out.append((row, row.bytes / m, row.copies, row.note))
            elif r == first:
                out.append((row, row.bytes / m, max(flight[r].values(), default=1), row.note))
        return out

    # A rank's total is its rows' ``bytes * copies`` summed in order, as the rows it holds
    # would sum them; only the busiest rank's rows are made.
    best, best_total = None, -1.0
    for r in sorted({s.rank for s in st}):
        total = sum(b * c for _, b, c, _ in held(r))
        if total > best_total:
            best, best_total = r, total
    if best is None:
        return rows
    return [dataclasses.replace(row, bytes=b, copies=c, note=note)
            for row, b, c, note in held(best)]


def _head_side(module: str, head_modules: set[str]) -> bool:
    return module == "" or any(module == h or module.startswith(h + ".") for h in head_modules)
