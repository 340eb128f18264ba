"""``advise``: search the layouts of a model over ``gpus`` cards and rank those that fit.

The search walks meshes (``pp`` x ``dp`` x ``sp`` x ``tp``, tensor parallelism inside a
node and dividing the heads, Ulysses sequence parallelism from 16k tokens), the ZeRO stage (1, or 3 without a pipeline), ``remat`` (none,
selective, full) and, with a pipeline, the microbatches (2 and 4 per stage), for a global
batch of ``batch`` sequences of ``seq`` tokens. Each layout is planned on a fake mesh
(every room's check runs: what ``parallelize`` would refuse is skipped), its peak memory
(``plan.memory``) compared with the card's, its step time predicted (``plan.time``). The
model is traced once and its tensor-parallel layout applied once per search; the
one-block profiles are shared by every layout with the same remat policy.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ..core.errors import ConfigError, MeshlabError


@dataclasses.dataclass(frozen=True)
class Layout:
    """One layout the search planned: its mesh and transforms, peak memory per rank,
    whether it fits, and its predicted step."""

    mesh: tuple[tuple[str, int], ...]
    zero: int
    remat: str
    microbatches: int | None
    peak: int
    fits: bool
    step: Any          # StepTime
    spec: str

    @property
    def tokens_per_s(self) -> float:
        return self.step.tokens_per_s

    def row(self) -> tuple[str, ...]:
        from ..core.units import fmt_bytes

        mesh = ", ".join(f"{n}={s}" for n, s in self.mesh)
        return (mesh, str(self.zero), self.remat, str(self.microbatches or "-"),
                fmt_bytes(self.peak), f"{self.step.step:.2f} s",
                f"{self.tokens_per_s:,.0f}")


@dataclasses.dataclass(frozen=True)
class Advice:
    """The layouts that fit, fastest first (``best``), and every one planned (``tried``)."""

    model: str
    gpus: int
    gpu: str
    batch: int
    seq: int
    best: tuple[Layout, ...]
    tried: tuple[Layout, ...]
    refused: int
    seconds: float

    HEADER = ("mesh", "zero", "remat", "microbatches", "peak/rank", "step", "tokens/s")

    @property
    def title(self) -> str:
        fit = sum(1 for lay in self.tried if lay.fits)
        return (f"{self.model} on {self.gpus} x {self.gpu}, batch {self.batch} x {self.seq}: "
                f"{fit} of {len(self.tried)} layouts fit ({self.refused} refused by their "
                f"checks), the fastest {len(self.best)} shown; searched in {self.seconds:.1f} s")

    def __rich__(self):
        from rich.table import Table

        t = Table(title=self.title)
        for c in self.HEADER:
            t.add_column(c, justify="right" if c not in ("mesh", "remat") else "left")
        for lay in self.best:
            t.add_row(*lay.row())
        return t

    def __str__(self) -> str:
        from ..planning.view import render_text

        return render_text(self.__rich__())

    def _repr_html_(self) -> str:
        from ..planning.view import html_table

        return html_table(self.HEADER, [lay.row() for lay in self.best], title=self.title)

    def __repr__(self) -> str:
        top = self.best[0].row() if self.best else ("nothing fits",)
        return f"Advice({self.title}; best: {', '.join(top)})"

    def plot(self, ax=None):
        """Predicted tokens/s against peak memory per rank for every layout tried; those
        that fit in colour, the card's memory as a line."""
        import matplotlib.pyplot as plt

        from .machine import machine

        ax = ax or plt.subplots(figsize=(7, 4))[1]
        for fits, colour in ((False, "lightgray"), (True, "tab:blue")):
            pts = [(lay.peak / 2 ** 30, lay.tokens_per_s) for lay in self.tried
                   if lay.fits == fits]
            if pts:
                ax.scatter(*zip(*pts), s=14, c=colour, label="fits" if fits else "does not fit")
        ax.axvline(machine(self.gpu).memory / 2 ** 30, color="tab:red", lw=1,
                   label=f"{self.gpu} memory")
        ax.set_xlabel("peak memory per rank (GiB)")
        ax.set_ylabel("predicted tokens/s")
        ax.set_title(f"{self.model} on {self.gpus} x {self.gpu}")
        ax.legend()
        return ax


def _pow2_divisors(n: int, cap: int) -> list[int]:
    out, k = [], 1
    while k <= min(n, cap):
        if n % k == 0:
            out.append(k)
        k *= 2
    return out


def meshes(gpus: int, *, heads: int, blocks: int, tp_max: int = 8, pp_max: int = 64,
           sp_max: int = 1):
    """``(pp, dp, sp, tp)`` with ``pp * dp * sp * tp == gpus``, ``tp * sp`` dividing the
    heads (Ulysses splits them over sp inside attention), no sp with a pipeline."""
    out = []
    for tp in _pow2_divisors(gpus, tp_max):
        if heads % tp:
            continue
        for sp in _pow2_divisors(gpus // tp, sp_max):
            if heads % (tp * sp):
                continue
            for pp in _pow2_divisors(gpus // (tp * sp), 1 if sp > 1 else min(pp_max, blocks)):
                out.append((pp, gpus // (tp * sp * pp), sp, tp))
    return out


def advise(model, *, gpus: int, gpu="h200", batch: int | None = None, seq: int = 4096,
           memory: int | None = None, top: int = 5, tp_max: int = 8,
           remats=("none", "selective", "full"), progress: bool = False) -> Advice:
    """Search the layouts of ``model`` (a module, on the meta device for large ones) over
    ``gpus`` cards of kind ``gpu`` (module docstring). ``batch`` is the global batch in
    sequences (default: one per data-parallel rank of the widest layout, ``gpus``);
    ``memory`` overrides the card's bytes."""
    from .. import policies
    from .machine import machine
    from ..core.mesh import Mesh
    from ..planning.trace import trace
    from ..transforms import pipeline, remat, sequence, shard, zero_shard

    if not isinstance(gpus, int) or gpus < 1:
        raise ConfigError(f"advise(gpus={gpus!r}): the number of cards, an integer >= 1")
    card = machine(gpu)
    cap = memory if memory is not None else card.memory
    batch = batch or gpus
    t0 = time.perf_counter()
    traced = shard(policies.auto)(trace(model))
    info = traced.model
    heads = info.config_get("num_attention_heads") or info.config_get("n_head") or 1
    L = len(info.blocks)
    tried, refused = [], 0
    cands = []
    sp_max = 8 if seq >= 16384 else 1          # long sequences: Ulysses is searched too
    for pp, dp, sp, tp in meshes(gpus, heads=heads, blocks=L, tp_max=tp_max, sp_max=sp_max):
        if batch % dp:
            continue
        per_dp = batch // dp
        mbs = sorted({k for k in (pp, 2 * pp, 4 * pp, per_dp) if k >= pp and per_dp % k == 0}) \
            if pp > 1 else [None]
        for zero in ((1,) if pp > 1 else (1, 3)):
            for mb in mbs:
                cands.append((pp, dp, sp, tp, zero, mb, per_dp))
    bar = _progress(progress, len(cands) * len(remats))
    for pp, dp, sp, tp, zero, mb, per_dp in cands:
        axes = {k: v for k, v in (("pp", pp), ("dp", dp), ("sp", sp), ("tp", tp))
                if v > 1} or {"dp": 1}
        parts = [zero_shard(zero, "dp")] if "dp" in axes else []
        parts += [pipeline("pp", microbatches=mb)] if mb is not None else []
        parts += [sequence("sp", "all_to_all")] if sp > 1 else []
        try:
            base = traced
            for t in parts:
                base = t(base)
            base = base.bind(Mesh(**axes, fake=True))
        except MeshlabError:
            refused += len(remats)
            continue
        if base.not_runnable:
            refused += len(remats)
            continue
        for pol in remats:
            bar()
            p = base if pol == "none" else _with(base, remat(pol))
            mem = p.memory(batch=per_dp, seq=seq)
            st = p.time(batch=per_dp, seq=seq, gpu=card)
            spec = " | ".join(repr(t) for t in p.options if t.kind != "shard") or "-"
            tried.append(Layout(tuple(axes.items()), zero, pol, mb, mem.peak, mem.peak <= cap,
                                st, spec))
    fits = sorted((t for t in tried if t.fits), key=lambda t: -t.tokens_per_s)
    name = info.model_type or info.cls
    return Advice(name, gpus, card.name, batch, seq, tuple(fits[:top]), tuple(tried), refused,
                  time.perf_counter() - t0)


def _with(plan, t):
    """The bound ``plan`` with ``t`` added, for a transform that claims no axis (``remat``):
    what binding ``plan``'s spec ``| t`` again gives, its check run on the result."""
    assert not t.claims(plan), t
    rooms = tuple(sorted(plan.rooms + (t,), key=lambda r: r.phase))
    out = plan.replace(options=plan.options + (t,), transforms=plan.transforms + (repr(t),),
                       rooms=rooms)
    t.check(out)
    return out


def _progress(on: bool, total: int):
    if not on:
        return lambda: None
    from tqdm import tqdm

    bar = tqdm(total=total, desc="advise: layouts", unit="layout", leave=False)
    return lambda: bar.update(1)

