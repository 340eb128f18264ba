"""``plan.diff(other)``: what changes between two plans, per FQN and per rank."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from ..core.errors import MeshlabError
from ..core.placement import mesh_repr

# ``Plan`` in annotations is meshlab.planning.plan.Plan, which imports this module.


def diff_plans(a_plan, b_plan) -> "PlanDiff":
    """What changes from ``a_plan`` to ``b_plan`` (``PlanDiff``'s doc)."""
    a = {e.fqn: e for e in a_plan.params}
    b = {e.fqn: e for e in b_plan.params}
    changed = []
    for fqn in a.keys() & b.keys():
        ea, eb = a[fqn], b[fqn]
        fields = [f for f in ("shape", "dtype", "spec", "mesh_spec", "tags", "tied_to")
                  if getattr(ea, f) != getattr(eb, f)]
        if fields:
            changed.append((fqn, tuple((f, getattr(ea, f), getattr(eb, f)) for f in fields)))
    order = {f: i for i, f in enumerate(list(a) + [f for f in b if f not in a])}
    # A transform whose whole effect is the table (shard) differs where the table does.
    before = {t.kind: t for t in a_plan.options if not getattr(t, "in_table", False)}
    after = {t.kind: t for t in b_plan.options if not getattr(t, "in_table", False)}
    opts = tuple((k, before.get(k), after.get(k)) for k in dict.fromkeys([*before, *after])
                 if before.get(k) != after.get(k))
    local, memory = _rank_diff(a_plan, b_plan, list(order))
    return PlanDiff(
        removed=tuple(f for f in a if f not in b),
        added=tuple(f for f in b if f not in a),
        changed=tuple(sorted(changed, key=lambda c: order[c[0]])),
        options=opts,
        mesh=(a_plan.mesh, b_plan.mesh) if a_plan.mesh != b_plan.mesh else None,
        local=local,
        memory=memory,
    )


@dataclasses.dataclass(frozen=True)
class PlanDiff:
    """What changes between two plans. ``changed``: per FQN, the entry fields that differ;
    ``options``: the transforms that differ; ``mesh``: both meshes where they differ.
    Between two bound plans also what one rank holds: ``local`` has ``(fqn, local shape
    before, after, bytes per rank before, after)`` for every parameter whose per-rank shape
    or bytes differ after every room's share of the memory (``meshlab.estimate.memory.room_rows``,
    category ``params``; a shape is None where the rank does not hold the parameter), and
    ``memory`` ``(category, bytes per rank before, after)`` for params, grads and optimizer
    state where any of them differs."""

    removed: tuple[str, ...]
    added: tuple[str, ...]
    changed: tuple[tuple[str, tuple], ...]
    options: tuple = ()
    mesh: tuple | None = None
    local: tuple[tuple[str, tuple | None, tuple | None, int, int], ...] = ()
    memory: tuple[tuple[str, int, int], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.removed or self.added or self.changed or self.options or self.mesh
                    or self.local or self.memory)

    HEADER = ("fqn / option", "field", "before", "after")

    def rows(self) -> list[tuple[str, str, str, str]]:
        """The diff as text cells ``(fqn / option, field, before, after)``; the per-rank
        rows fold block indices into ``*`` where every block changes alike."""
        from ..core.units import fmt_bytes

        out = []
        if self.mesh:
            out.append(("(mesh)", "", mesh_repr(dict(self.mesh[0] or ())),
                        mesh_repr(dict(self.mesh[1] or ()))))
        out += [(f, "", "present", "removed") for f in self.removed]
        out += [(f, "", "", "added") for f in self.added]
        out += [(fqn, name, repr(x), repr(y)) for fqn, fields in self.changed
                for name, x, y in fields]
        out += [(f"option {k}", "", repr(x), repr(y)) for k, x, y in self.options]

        def held(shape, nbytes):
            return "not held" if shape is None else f"{tuple(shape)} {fmt_bytes(nbytes)}"

        for name, n, sa, sb, ba, bb in _fold_local(self.local):
            label = f"{name} (×{n})" if n > 1 else name
            out.append((label, "local shape, bytes/rank", held(sa, ba), held(sb, bb)))
        out += [(f"(per rank) {cat}", "bytes/rank", fmt_bytes(x), fmt_bytes(y))
                for cat, x, y in self.memory]
        return out

    def __rich__(self):
        from rich.table import Table

        t = Table(title="plan diff")
        for c in self.HEADER:
            t.add_column(c)
        for label, field, before, after in self.rows():
            if after in ("removed", "added") and not field:
                after = "[red]removed[/]" if after == "removed" else "[green]added[/]"
            t.add_row(label, field, before, after)
        return t

    def _repr_html_(self) -> str:
        from .view import html_table

        return html_table(self.HEADER, self.rows(), title="plan diff")

    def __str__(self) -> str:
        from .view import render_text

        return render_text(self.__rich__())


def _fold_local(local) -> list[tuple]:
    """``local`` rows with the block index folded into ``*`` where the shapes and bytes
    are the same: ``(fqn pattern, count, shape before, after, bytes before, after)``."""
    from .view import _INDEX

    groups: dict = {}
    for fqn, sa, sb, ba, bb in local:
        key = (_INDEX.sub(".*.", fqn, count=1), sa, sb, ba, bb)
        groups.setdefault(key, []).append(fqn)
    out = []
    for (pattern, sa, sb, ba, bb), fqns in groups.items():
        out.append((pattern if len(fqns) > 1 else fqns[0], len(fqns), sa, sb, ba, bb))
    return out


def _per_rank(plan: Plan):
    """``({fqn: (local shape, device bytes)}, {category: device bytes})`` of what one rank
    of a bound plan holds, after every room (``room_rows``); None for an unbound plan or
    one whose memory cannot be estimated."""
    if plan.mesh is None:
        return None
    from .rows import room_rows

    try:
        rows = room_rows(plan)
    except MeshlabError:
        return None
    params: dict = {}
    totals = {"params": 0, "grads": 0, "optimizer": 0}
    for r in rows:
        device = r.bytes if r.where == "device" else 0
        if r.category in totals:
            totals[r.category] += device
        if r.category == "params":
            shape, nb = params.get(r.fqn, (tuple(r.shape), 0))
            params[r.fqn] = (shape, nb + device)
    return params, totals


def _rank_diff(a: Plan, b: Plan, order: Sequence[str]) -> tuple[tuple, tuple]:
    """``PlanDiff.local`` and ``PlanDiff.memory`` between two bound plans."""
    pa, pb = _per_rank(a), _per_rank(b)
    if pa is None or pb is None:
        return (), ()
    (la, ta), (lb, tb) = pa, pb
    local = []
    for fqn in order:
        if fqn not in la and fqn not in lb:
            continue
        sa, ba = la.get(fqn, (None, 0))
        sb, bb = lb.get(fqn, (None, 0))
        if (sa, ba) != (sb, bb):
            local.append((fqn, sa, sb, ba, bb))
    memory = tuple((c, ta[c], tb[c]) for c in ta)
    return tuple(local), memory if ta != tb else ()
