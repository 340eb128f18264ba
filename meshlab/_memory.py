"""Per-rank memory and communication estimates of a bound plan.

Memory counts what lives on each rank between steps, by category and dtype:

* parameters: the local shard of every parameter (tied parameters once) in the dtype
  it was built in (``precision`` changes the compute dtype, not the stored one); split
  over the ZeRO axis from stage 2 on (FSDP2 keeps them sharded at rest);
* gradients: like parameters;
* optimizer state: AdamW keeps two moments per element, like the parameter; meshlab's
  ZeRO-1 instead updates an fp32 master slice (its moments, the slice and its reduced
  gradient, all fp32, split over the ZeRO axis).

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
    n_states = _OPT_STATES.get(optimizer)
    if n_states is None:
        raise ValueError(f"optimizer {optimizer!r} unknown; one of {sorted(_OPT_STATES)}")
    cats: dict = {"params": defaultdict(int), "grads": defaultdict(int),
                  "optimizer": defaultdict(int)}
    for e in plan.params:
        if e.tied_to is not None:
            continue
        ls = local_shape(e.shape, e.mesh_spec, sizes)
        pdt = e.dtype                      # parameters stay in the dtype they were built in
        b = dtype_bytes(pdt)
        full = math.prod(ls)
        split = _zero_split(ls, zn)
        # FSDP2 (stages 2 and 3) keeps parameters sharded at rest.
        cats["params"][pdt] += (split if stage >= 2 else full) * b
        if not e.requires_grad:
            continue
        cats["grads"][pdt] += (split if stage >= 2 else full) * b
        if stage == 1:
            # meshlab's ZeRO-1 updates an fp32 master slice: its moments, the slice itself
            # and its reduced gradient are fp32
            cats["optimizer"]["float32"] += (n_states + 1) * split * 4
            cats["grads"]["float32"] += split * 4
        else:                              # torch keeps the moments like the parameter
            cats["optimizer"][pdt] += n_states * (split if stage >= 2 else full) * b
    return MemoryEstimate({k: dict(v) for k, v in cats.items()}, plan.mesh)


def estimate_comm(plan, **kw):
    from ._comm import estimate_comm as _est

    return _est(plan, **kw)
