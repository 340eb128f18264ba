"""Per-rank memory estimate of a bound plan: the sum of what each transform says.

The core counts what lives on each rank between steps without any transform: the local
shard of every parameter (tied parameters once) in the dtype it was built in, a gradient
like it, and the optimizer's states like it (AdamW: two). Each room of the plan then
rewrites those rows (``zero_shard`` splits them over its axis; ZeRO-1 keeps fp32
slices) or adds its own (``Transform.memory``). Given a batch and a sequence length,
the activations saved for backward and the step's peak come from ``meshlab.estimate.activations``:

* forward/backward peak = parameters + optimizer state + the activation peak (the other
  blocks' saved activations, one block's backward, the loss, the gradients made so far)
  + the rooms' transients (ZeRO's gathered parameters);
* step peak = parameters + optimizer state + every gradient;
* ``peak`` is the larger; ``fits(gpu)`` compares it with a card's memory.
"""

from __future__ import annotations

from ..planning.rows import OPTIMIZER_STATES, MemRow as MemRow, base_rows as base_rows, rank_params as rank_params, room_rows as room_rows

import dataclasses
import math
from collections import defaultdict

from ..core.placement import local_shape
from ..core.units import dtype_bytes
from ..core.errors import PlanError
from ..core.names import owner



@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank: ``by_category['params'|'grads'|'optimizer'] -> {dtype: bytes}`` on
    the device; ``host_by_category`` the same for what ``offload`` keeps in host memory.
    ``total`` is the device's, ``host`` the host's."""

    by_category: dict
    mesh: tuple
    host_by_category: dict = dataclasses.field(default_factory=dict)
    activations: object = None          # an ActivationEstimate, given batch and seq
    transients: tuple = ()              # the rooms' ActRows at the peak

    @property
    def persistent(self) -> int:
        """Device bytes held across steps, except gradients (freed by ``zero_grad``)."""
        return self.total - self.grads

    @property
    def peak(self) -> int:
        """The step's highest device bytes (module docstring); needs batch and seq."""
        if self.activations is None:
            raise PlanError("the peak needs the activations: plan.memory(batch=, seq=)")
        fb = self.persistent + self.activations.peak + int(sum(r.total for r in self.transients))
        return max(fb, self.persistent + self.grads)

    def fits(self, gpu="h200") -> bool:
        """Whether ``peak`` fits the memory of ``gpu`` (a preset name, a ``Machine``, or
        bytes)."""
        from .machine import machine

        cap = gpu if isinstance(gpu, (int, float)) else machine(gpu).memory
        return self.peak <= cap

    @property
    def host(self) -> int:
        return sum(sum(v.values()) for v in self.host_by_category.values())

    @property
    def params(self) -> int:
        return sum(self.by_category["params"].values())

    @property
    def grads(self) -> int:
        return sum(self.by_category["grads"].values())

    @property
    def optimizer(self) -> int:
        return sum(self.by_category["optimizer"].values())

    @property
    def total(self) -> int:
        return sum(sum(v.values()) for v in self.by_category.values())

    @property
    def title(self) -> str:
        return "memory per rank (" + ", ".join(f"{n}={s}" for n, s in self.mesh) + ")"

    def rows(self) -> list[tuple[str, str, str]]:
        """``(category, dtype, bytes)`` per row, bytes in B/KiB/MiB/GiB, then the total."""
        from ..core.units import fmt_bytes

        out = [(cat, dt, fmt_bytes(b)) for cat, per in self.by_category.items()
               for dt, b in sorted(per.items())]
        if self.host_by_category:
            out += [(f"host {cat}", dt, fmt_bytes(b))
                    for cat, per in self.host_by_category.items() for dt, b in sorted(per.items())]
            out.append(("host total", "", fmt_bytes(self.host)))
        if self.activations is None:
            return out + [("total", "", fmt_bytes(self.total))]
        a = self.activations
        out += [("activations saved", f"b={a.batch} s={a.seq}", fmt_bytes(a.saved)),
                ("activations at peak", "", fmt_bytes(a.peak))]
        out += [(f"transient {r.module}", "", fmt_bytes(r.total)) for r in self.transients]
        return out + [("total", "", fmt_bytes(self.total)), ("peak", "", fmt_bytes(self.peak))]

    def __rich__(self):
        from rich.table import Table

        t = Table(title=self.title)
        t.add_column("category")
        t.add_column("dtype")
        t.add_column("bytes", justify="right")
        for row in self.rows():
            bold = row[0] in ("total", "peak")
            t.add_row(*(f"[bold]{c}[/]" if bold and c else c for c in row))
        return t

    def __repr__(self) -> str:
        """One line: each category's bytes (all dtypes) and the total, in binary units."""
        from ..core.units import fmt_bytes

        cats = ", ".join(f"{c} {fmt_bytes(sum(per.values()))}"
                         for c, per in self.by_category.items())
        mesh = ", ".join(f"{n}={s}" for n, s in self.mesh)
        host = f"; host {fmt_bytes(self.host)}" if self.host_by_category else ""
        acts = "" if self.activations is None else \
            (f"; activations {fmt_bytes(self.activations.saved)}; peak "
             f"{fmt_bytes(self.peak)}")
        return (f"MemoryEstimate(per rank on {mesh}: {cats}; total {fmt_bytes(self.total)}"
                f"{host}{acts})")

    def _repr_html_(self) -> str:
        from ..planning.view import html_table

        return html_table(("category", "dtype", "bytes"), self.rows(), title=self.title,
                          bold_last=True)

    def bars(self) -> list[tuple[str, int]]:
        """What :meth:`plot` stacks on the device bar, bottom up: ``(label, bytes)`` for
        the parameters, gradients and optimizer state (their sum is ``total``), and with
        activations what the step's peak adds to them (saved activations, one block's
        backward, the loss, the rooms' transients): the bar's top is ``peak``."""
        out = [(cat, int(sum(per.values()))) for cat, per in self.by_category.items()]
        if self.activations is not None:
            out.append(("activations at the peak", self.peak - self.total))
        return out

    def plot(self, ax=None, gpu=None):
        """A stacked bar of the device bytes per rank (:meth:`bars`, each labelled with
        its size) and, where ``offload`` keeps some, one of the host's; ``gpu`` (a preset
        name or bytes) draws the card's memory as a line. Returns the axes."""
        from ..core.log import require
        from ..core.units import fmt_bytes

        plt = require("matplotlib.pyplot", "plot", "MemoryEstimate.plot")
        ax = ax or plt.subplots(figsize=(5, 4))[1]
        gib = 2 ** 30
        columns = [("device", self.bars())]
        if self.host_by_category:
            columns.append(("host", [(f"host {c}", int(sum(per.values())))
                                     for c, per in self.host_by_category.items()]))
        for x, (_, parts) in enumerate(columns):
            bottom = 0.0
            for label, b in parts:
                if b <= 0:
                    continue
                bar = ax.bar(x, b / gib, bottom=bottom / gib, label=label, width=0.6)
                bar[0].meshlab_bytes = b            # what the bar stands for, exactly
                ax.text(x, (bottom + b / 2) / gib, f"{label}: {fmt_bytes(b)}",
                        ha="center", va="center", fontsize=7)
                bottom += b
        if gpu is not None:
            from .machine import machine

            cap = gpu if isinstance(gpu, (int, float)) else machine(gpu).memory
            ax.axhline(cap / gib, color="tab:red", lw=1, label=f"{gpu} memory")
        ax.set_xticks(range(len(columns)), [name for name, _ in columns])
        ax.set_ylabel("GiB per rank")
        ax.set_title(self.title, fontsize=9)
        return ax

    def __str__(self) -> str:
        from ..planning.view import render_text

        return render_text(self.__rich__())


def estimate_memory(plan, *, optimizer: str = "adamw", batch: int | None = None,
                    seq: int | None = None, inputs=None, loss=None) -> MemoryEstimate:
    """The rows of every room (module docstring); with ``batch`` and ``seq`` the
    activations of the example step ``inputs`` / ``loss`` (``meshlab.estimate.example``)."""
    from .example import check_example

    check_example("plan.memory", inputs, loss, batch)
    n_states = OPTIMIZER_STATES.get(optimizer)
    if n_states is None:
        raise ValueError(f"optimizer {optimizer!r} unknown; one of {sorted(OPTIMIZER_STATES)}")
    rows = room_rows(plan, n_states)
    cats: dict = {"params": defaultdict(int), "grads": defaultdict(int),
                  "optimizer": defaultdict(int)}
    host: dict = {}
    for r in rows:
        into = cats if r.where == "device" else host
        per = into.get(r.category)
        if per is None:
            per = into[r.category] = defaultdict(int)
        per[r.dtype] += r.bytes
    acts, extra = None, ()
    if batch is not None:
        from .activations import estimate_activations

        grads: dict[str, int] = {}
        for r in rows:
            if r.category == "grads" and r.where == "device":
                grads.setdefault(r.fqn, r.bytes)
        acts = estimate_activations(plan, batch, seq, grads, inputs, loss)
        extra = tuple(r for t in plan.rooms for r in t.transients(plan, batch=batch, seq=seq))
    return MemoryEstimate({k: dict(v) for k, v in cats.items()}, plan.mesh,
                          {k: dict(v) for k, v in host.items()}, acts, extra)


