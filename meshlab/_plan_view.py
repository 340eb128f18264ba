"""Rich rendering of plans: one row per parameter, repeated blocks collapsed."""

from __future__ import annotations

import math
import re

from ._placement import local_shape
from ._spec import P
from ._visualize import type_string

_INDEX = re.compile(r"\.(\d+)\.")


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def plan_rows(plan, *, collapse: bool = True):
    """Rows (fqn pattern, count, entry) with block indices folded into ``*``."""
    groups: dict = {}
    for e in plan.params:
        key_fqn = _INDEX.sub(".*.", e.fqn, count=1) if collapse else e.fqn
        key = (key_fqn, e.shape, e.dtype, e.spec, e.mesh_spec, e.tied_to is not None, e.tags)
        if key in groups:
            groups[key][1] += 1
        else:
            groups[key] = [e, 1]
    return [(k[0], n, e) for k, (e, n) in groups.items()]


def plan_table(plan, *, collapse: bool = True, max_rows: int = 200):
    import torch
    from rich.table import Table

    bound = plan.mesh is not None
    title = "meshlab plan"
    if plan.model.cls:
        title += f": {plan.model.cls}"
    if bound:
        title += "  on Mesh(" + ", ".join(f"{n}={s}" for n, s in plan.mesh) + ")"
    caption = " | ".join(plan.transforms)
    for why in plan.not_runnable:
        caption += f"\nparallelize cannot run this layout: {why}"
    t = Table(title=title, caption=caption.strip() or None)
    t.add_column("parameter", no_wrap=True)
    t.add_column("×", justify="right")
    t.add_column("type (global)")
    t.add_column("spec")
    if bound:
        t.add_column("local shape")
        t.add_column("bytes/rank", justify="right")
    rows = plan_rows(plan, collapse=collapse)
    for fqn, n, e in rows[:max_rows]:
        spec = e.mesh_spec if bound else e.spec
        dtype = getattr(torch, e.dtype)
        shown_spec = repr(e.spec) if e.mesh_spec is None or e.spec == e.mesh_spec \
            else f"{e.spec!r} → {e.mesh_spec!r}"
        tied = f"  (tied to {e.tied_to})" if e.tied_to else ""
        cells = [fqn + tied, str(n), type_string(e.shape, dtype, spec if bound else P()),
                 shown_spec]
        if bound:
            ls = local_shape(e.shape, spec, plan.mesh_shape)
            nbytes = 0 if e.tied_to else math.prod(ls) * dtype.itemsize
            cells += [str(tuple(ls)), _fmt_bytes(nbytes * n)]
        t.add_row(*cells)
    if len(rows) > max_rows:
        t.add_row(f"… {len(rows) - max_rows} more rows", *[""] * (len(t.columns) - 1))
    return t


def render_text(renderable, width: int = 200) -> str:
    import io

    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=width, force_terminal=False, color_system=None).print(renderable)
    return buf.getvalue()
