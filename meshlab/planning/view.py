"""How plans show: a rich table (one row per parameter, repeated blocks collapsed), a
one-line ``repr`` and an HTML view for notebooks. Estimates (memory, communication)
build their HTML from ``html_table`` here."""

from __future__ import annotations

import math
import re

from ..core.errors import MeshlabError
from ..core.placement import local_shape
from ..core.spec import P
from ..core.units import fmt_bytes
from .rows import room_rows
from ..core.visualize import type_string

_INDEX = re.compile(r"\.(\d+)\.")


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


def plan_cells(plan, *, collapse: bool = True, max_rows: int = 200):
    """The parameter table as text: ``(header, rows, hidden)``, ``hidden`` the number of
    collapsed rows past ``max_rows``. The rich table and the HTML view both show these."""
    import torch

    bound = plan.mesh is not None
    header = ["parameter", "×", "type (global)", "spec"]
    if bound:
        header += ["local shape", "bytes/rank"]
    rows = plan_rows(plan, collapse=collapse)
    held = _held(plan) if bound else {}
    from ..core.units import PACKED_4BIT
    out = []
    for fqn, n, e in rows[:max_rows]:
        spec = e.mesh_spec if bound else e.spec
        # a packed 4-bit base weight (lora(quantize=...)) has no torch dtype: its name
        dtype = e.dtype if e.dtype in PACKED_4BIT else getattr(torch, e.dtype)
        shown_spec = repr(e.spec) if e.mesh_spec is None or e.spec == e.mesh_spec \
            else f"{e.spec!r} → {e.mesh_spec!r}"
        tied = f"  (tied to {e.tied_to})" if e.tied_to else ""
        cells = [fqn + tied, str(n), type_string(e.shape, dtype, spec if bound else P()),
                 shown_spec]
        if bound:
            ls, nbytes = held.get(e.fqn, (local_shape(e.shape, spec, plan.mesh_shape), 0))
            cells += [str(tuple(ls)), fmt_bytes(nbytes * n)]
        out.append(cells)
    return header, out, max(0, len(rows) - max_rows)


def _held(plan) -> dict:
    """FQN -> (local shape, bytes) of each parameter one rank keeps on its device after
    every room's share (ZeRO-3 splits them further, offload moves them to the host: 0
    bytes there), as ``plan.memory()`` counts them; tied parameters count once."""
    out: dict = {}
    for r in room_rows(plan, 0):
        if r.category == "params":
            nbytes = r.bytes if r.where == "device" else 0
            if r.fqn in out:     # a second row of one parameter (a 4-bit weight's scales)
                out[r.fqn] = (out[r.fqn][0], out[r.fqn][1] + nbytes)
            else:
                out[r.fqn] = (r.shape, nbytes)
    return out


def _title(plan) -> str:
    title = "meshlab plan"
    if plan.model.cls:
        title += f": {plan.model.cls}"
    if plan.mesh is not None:
        title += "  on Mesh(" + ", ".join(f"{n}={s}" for n, s in plan.mesh) + ")"
    return title


def plan_table(plan, *, collapse: bool = True, max_rows: int = 200):
    """The plan as a rich table; the caption lists the transforms, what the rooms decided
    at bind that they describe (what ``fuse()`` left, what ``offload`` chose) and, in red,
    every reason ``parallelize`` would refuse the layout."""
    from rich.table import Table
    from rich.text import Text

    caption = Text(" | ".join(plan.transforms), style="table.caption")
    for d in plan.decisions:
        if hasattr(d, "describe"):
            caption.append(("\n" if caption else "") + d.describe())
    for why in plan.not_runnable:
        caption.append(("\n" if caption else "") + f"parallelize cannot run this layout: {why}",
                       style="bold red")
    t = Table(title=_title(plan), caption=caption if caption else None)
    header, rows, hidden = plan_cells(plan, collapse=collapse, max_rows=max_rows)
    for name in header:
        t.add_column(name, no_wrap=name == "parameter",
                     justify="right" if name in _RIGHT else "left")
    for cells in rows:
        t.add_row(*cells)
    if hidden:
        t.add_row(f"… {hidden} more rows", *[""] * (len(t.columns) - 1))
    return t


_RIGHT = frozenset({"×", "bytes/rank", "bytes", "count"})


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"


def _fmt_count(n: int) -> str:
    for unit, k in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= k:
            return f"{n / k:.2f}{unit}"
    return str(n)


def plan_repr(plan) -> str:
    """One line: model, mesh, parameter count, transforms (each clipped) and refusals.

    The full table is ``str(plan)``; this stays short so a plan echoed in a REPL or a
    notebook's plain-text output does not print every entry."""
    mesh = "unbound" if plan.mesh is None else \
        "{" + ", ".join(f"{n}:{s}" for n, s in plan.mesh) + "}"
    numel = sum(e.numel for e in plan.params if e.tied_to is None)
    transforms = _clip(" | ".join(_clip(t, 60) for t in plan.transforms), 240) or "none"
    refused = str(len(plan.not_runnable))
    if plan.not_runnable:
        refused += f" ({_clip(plan.not_runnable[0], 100)})"
    return (f"Plan(model={plan.model.cls or '?'}, mesh={mesh}, {len(plan.params)} params "
            f"({_fmt_count(numel)} elements), transforms: {transforms}, refused: {refused})")


def html_table(header, rows, *, title: str | None = None, bold_last: bool = False) -> str:
    """A plain HTML table of text cells (escaped); right-aligns the numeric columns."""
    from html import escape

    def row(cells, tag, bold=False):
        out = []
        for name, c in zip(header, cells):
            align = ' style="text-align:right"' if name in _RIGHT else ""
            text = escape(str(c), quote=False)
            out.append(f"<{tag}{align}>{f'<b>{text}</b>' if bold and text else text}</{tag}>")
        return "<tr>" + "".join(out) + "</tr>"

    cap = f"<caption><b>{escape(title)}</b></caption>" if title else ""
    body = [row(r, "td", bold_last and i == len(rows) - 1) for i, r in enumerate(rows)]
    return (f"<table>{cap}<thead>{row(header, 'th')}</thead>"
            f"<tbody>{''.join(body)}</tbody></table>")


def plan_html(plan, *, max_rows: int = 200) -> str:
    """The plan for a notebook: refusals first (a plan ``parallelize`` would refuse says
    so before anything else), then the transforms, the parameter table with specs and
    per-rank shapes and, for a bound plan, the per-rank memory summary."""
    from html import escape

    numel = sum(e.numel for e in plan.params if e.tied_to is None)
    parts = [f"<p><b>{escape(_title(plan), quote=False)}</b>: {len(plan.params)} parameter "
             f"tensors, {_fmt_count(numel)} elements</p>"]
    if plan.not_runnable:
        items = "".join(f"<li>{escape(w, quote=False)}</li>" for w in plan.not_runnable)
        parts.append('<div style="border:2px solid #c62828;background:#fdecea;color:#000;'
                     'padding:4px 10px;margin:6px 0"><b>⚠ parallelize cannot run this '
                     f"layout</b><ul>{items}</ul></div>")
    transforms = " | ".join(f"<code>{escape(t, quote=False)}</code>" for t in plan.transforms)
    parts.append(f"<p>transforms: {transforms or 'none'}</p>")
    header, rows, hidden = plan_cells(plan, max_rows=max_rows)
    if hidden:
        rows = rows + [[f"… {hidden} more rows"] + [""] * (len(header) - 1)]
    parts.append(html_table(header, rows))
    if plan.mesh is not None:
        try:
            parts.append(plan.memory()._repr_html_())
        except MeshlabError as e:      # the table still shows; say why the estimate does not
            parts.append(f"<p>memory per rank: not estimated ({escape(str(e), quote=False)})</p>")
    return '<div class="meshlab-plan">' + "".join(parts) + "</div>"


def render_text(renderable, width: int = 200) -> str:
    """``renderable`` as plain text. Not Jupyter-aware on purpose: a console that detects
    a notebook displays instead of writing, and ``str(plan)`` there would come back empty."""
    import io

    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=width, force_terminal=False, force_jupyter=False,
            color_system=None).print(renderable)
    return buf.getvalue()
