"""Per-rank memory and communication estimates of a bound plan.

Memory counts what lives on each rank between steps, by category and dtype:

* parameters: the local shard of every parameter (tied parameters once), in the
  parameter dtype chosen by ``precision`` (else the traced dtype); split over the ZeRO
  axis from stage 2 on (FSDP2 keeps them sharded at rest);
* gradients: like parameters, split over the ZeRO axis from stage 2 on;
* optimizer state: AdamW keeps two fp32 moments per element, plus an fp32 master copy
  when parameters are kept in a lower precision; split over the ZeRO axis from stage 1.
  meshlab's ZeRO-1 always keeps an fp32 master slice and its reduced gradient.

ZeRO splits the local shard's first dimension over its axis (as FSDP2 does), so its
per-rank size is ``ceil(local_0 / n) * rest``. Activations are not counted here.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

from ._placement import local_shape
from ._plan import dtype_bytes

_OPT_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}


def _zero_split(shape: tuple[int, ...], n: int) -> int:
    if not shape:
        return 1
    return -(-shape[0] // n) * math.prod(shape[1:]) if n > 1 else math.prod(shape)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank: ``by_category['params'|'grads'|'optimizer'] -> {dtype: bytes}``."""

    by_category: dict
    mesh: tuple

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
        return self.params + self.grads + self.optimizer

    def __rich__(self):
        from rich.table import Table

        from ._plan_view import _fmt_bytes

        t = Table(title="memory per rank (" + ", ".join(f"{n}={s}" for n, s in self.mesh) + ")")
        t.add_column("category")
        t.add_column("dtype")
        t.add_column("bytes", justify="right")
        for cat, per in self.by_category.items():
            for dt, b in sorted(per.items()):
                t.add_row(cat, dt, _fmt_bytes(b))
        t.add_row("[bold]total[/]", "", f"[bold]{_fmt_bytes(self.total)}[/]")
        return t

    def __str__(self) -> str:
        from ._plan_view import render_text

        return render_text(self.__rich__())


def estimate_memory(plan, *, optimizer: str = "adamw") -> MemoryEstimate:
    sizes = plan.mesh_shape
    zero = plan.option("zero") or {}
    stage, zaxes = zero.get("stage", 0), zero.get("axis")
    zaxes = (zaxes,) if isinstance(zaxes, str) else tuple(zaxes or ())
    zn = math.prod(sizes[a] for a in zaxes) if zaxes else 1
    prec = plan.option("precision") or {}
    n_states = _OPT_STATES.get(optimizer)
    if n_states is None:
        raise ValueError(f"optimizer {optimizer!r} unknown; one of {sorted(_OPT_STATES)}")
    cats: dict = {"params": defaultdict(int), "grads": defaultdict(int),
                  "optimizer": defaultdict(int)}
    for e in plan.params:
        if e.tied_to is not None:
            continue
        ls = local_shape(e.shape, e.mesh_spec, sizes)
        pdt = prec.get("param", e.dtype)
        full = math.prod(ls)
        split = _zero_split(ls, zn)
        # FSDP2 (stages 2 and 3) keeps parameters sharded at rest.
        cats["params"][pdt] += (split if stage >= 2 else full) * dtype_bytes(pdt)
        if not e.requires_grad:
            continue
        gdt = prec.get("grad", pdt)
        cats["grads"][gdt] += (split if stage >= 2 else full) * dtype_bytes(gdt)
        onum = split if stage >= 1 else full
        cats["optimizer"]["float32"] += n_states * onum * 4
        if stage == 1:
            # meshlab's ZeRO-1 keeps an fp32 master slice and its reduced gradient
            cats["optimizer"]["float32"] += onum * 4
            cats["grads"]["float32"] += onum * 4
        elif pdt != "float32" and prec.get("master", True):
            cats["optimizer"]["float32"] += onum * 4
    return MemoryEstimate({k: dict(v) for k, v in cats.items()}, plan.mesh)


def estimate_comm(plan, **kw):
    from ._comm import estimate_comm as _est

    return _est(plan, **kw)
