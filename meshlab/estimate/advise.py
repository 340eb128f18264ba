"""``advise``: search the layouts of a model over ``gpus`` cards and rank those that fit.

The search walks meshes (``pp`` x ``dp`` x ``sp`` x ``tp``, tensor parallelism inside a
node and dividing the heads, Ulysses sequence parallelism from 16k tokens), the ZeRO stage (1, or 3 without a pipeline), ``remat`` (none,
selective, full) and, with a pipeline, the microbatches (2 and 4 per stage), for a global
batch of ``batch`` sequences of ``seq`` tokens. Each layout is planned on a fake mesh
(every room's check runs: what ``parallelize`` would refuse is skipped), its peak memory
(``plan.memory``) compared with the card's, its step time predicted (``plan.time``). The
model is traced once and its tensor-parallel layout applied once per search; the
one-block profiles are shared by every layout with the same remat policy.

A Hugging Face model is laid out by its policy (``policies.auto``); a model of your own by
the specs you would give ``shard`` (``specs=`` and ``rules=``: a dict of FQN globs, a spec
tree or a ``Policy``), and profiled on the example step ``inputs=`` / ``loss=``
(``meshlab.estimate.example``). The search's meshes name only the axes of size > 1, so
rules for them end in a fallback where an axis may be missing (``batch=('dp', None)``).
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
        from ..core.log import require

        plt = require("matplotlib.pyplot", "plot", "Advice.plot")
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


def meshes(gpus: int, *, heads: int | None, blocks: int, tp_max: int = 8, pp_max: int = 64,
           sp_max: int = 1):
    """``(pp, dp, sp, tp)`` with ``pp * dp * sp * tp == gpus``, ``tp * sp`` dividing the
    heads (Ulysses splits them over sp inside attention; ``heads=None``: a count not
    known, left to each plan's checks), no sp with a pipeline."""
    out = []
    for tp in _pow2_divisors(gpus, tp_max):
        if heads is not None and heads % tp:
            continue
        for sp in _pow2_divisors(gpus // tp, sp_max):
            if heads is not None and heads % (tp * sp):
                continue
            for pp in _pow2_divisors(gpus // (tp * sp), 1 if sp > 1 else min(pp_max, blocks)):
                out.append((pp, gpus // (tp * sp * pp), sp, tp))
    return out


def advise(model, *, gpus: int, gpu="h200", batch: int | None = None, seq: int = 4096,
           memory: int | None = None, top: int = 5, tp_max: int = 8,
           remats=("none", "selective", "full"), progress: bool = False, specs=None,
           rules=None, inputs=None, loss=None) -> Advice:
    """Search the layouts of ``model`` (a module, on the meta device for large ones) over
    ``gpus`` cards of kind ``gpu`` (module docstring). ``batch`` is the global batch in
    sequences (default: one per data-parallel rank of the widest layout, ``gpus``);
    ``memory`` overrides the card's bytes. ``specs`` and ``rules`` are what ``shard``
    takes (default: the model's policy, ``policies.auto``); ``inputs`` and ``loss`` the
    example step of a model not called with token ids (``plan.memory``'s).

    >>> advise(model, gpus=8, seq=1024, specs={'blocks.*.attn.q.weight': P('heads', None)},
    ...        rules=Rules(heads='tp', batch=('dp', None)),
    ...        inputs=lambda b, s: torch.randint(0, 96, (b, s)))   # doctest: +SKIP
    """
    from .machine import machine
    from ..planning.trace import trace

    if not isinstance(gpus, int) or gpus < 1:
        raise ConfigError(f"advise(gpus={gpus!r}): the number of cards, an integer >= 1")
    card = machine(gpu)
    cap = memory if memory is not None else card.memory
    batch = batch or gpus
    t0 = time.perf_counter()
    traced = _laid_out(trace(model), specs, rules, gpus)
    info = traced.model
    heads = _heads(info)
    L = len(info.blocks)
    example = {"inputs": inputs, "loss": loss}
    sp_max = 8 if seq >= 16384 else 1          # long sequences: Ulysses is searched too
    tried, refused, why = _search(traced, cands_of(gpus, heads, L, tp_max, sp_max, batch),
                                  remats, cap, card, seq, example, progress)
    fits = sorted((t for t in tried if t.fits), key=lambda t: -t.tokens_per_s)
    if not tried and why:
        raise ConfigError(f"advise: every layout of {info.model_type or info.cls} over {gpus} "
                          f"cards was refused by its plan's checks; the first said: {why}")
    name = info.model_type or info.cls
    return Advice(name, gpus, card.name, batch, seq, tuple(fits[:top]), tuple(tried), refused,
                  time.perf_counter() - t0)


def _laid_out(plan, specs, rules, gpus: int):
    """The traced ``plan`` laid out by ``shard(specs, rules)`` (the model's policy where
    no specs are given); a model with no policy is told to pass its specs."""
    from .. import policies
    from ..core.errors import PolicyError
    from ..transforms import shard

    if specs is not None:
        return shard(specs, rules)(plan)
    try:
        return shard(policies.auto, rules)(plan)
    except PolicyError as e:
        raise PolicyError(
            f"advise: {plan.model.cls or 'this model'} has no policy (policies.auto needs a "
            f"Hugging Face config with model_type), so advise needs the specs you would give "
            f"shard(...): advise(model, gpus={gpus}, specs={{'blocks.*.attn.q.weight': "
            f"P('heads', None), ...}}, rules=Rules(heads='tp', batch=('dp', None), ...)), or "
            f"specs=<a Policy>") from e


def _heads(info) -> int | None:
    """The attention heads tensor parallelism must divide: the config's, else an integer
    attribute the model's modules name them by (``n_heads``), else None (not known)."""
    got = info.config_get("num_attention_heads") or info.config_get("n_head")
    if got:
        return got
    if info.model_type is not None:
        return 1
    names = ("num_attention_heads", "num_heads", "n_heads", "n_head")
    return next((m.get(k) for m in info.modules for k in names if m.get(k)), None)


def cands_of(gpus: int, heads, blocks: int, tp_max: int, sp_max: int, batch: int) -> list:
    """The candidate layouts: ``(pp, dp, sp, tp, zero, microbatches, per_dp)``."""
    cands = []
    for pp, dp, sp, tp in meshes(gpus, heads=heads, blocks=blocks, tp_max=tp_max,
                                 sp_max=sp_max):
        if batch % dp:
            continue
        per_dp = batch // dp
        mbs = sorted({k for k in (pp, 2 * pp, 4 * pp, per_dp) if k >= pp and per_dp % k == 0}) \
            if pp > 1 else [None]
        for zero in ((1,) if pp > 1 else (1, 3)):
            for mb in mbs:
                cands.append((pp, dp, sp, tp, zero, mb, per_dp))
    return cands


def _search(traced, cands, remats, cap, card, seq, example, progress):
    """Plan every candidate on a fake mesh, each remat policy on it: the layouts planned,
    the count refused by their checks, and the first refusal's message."""
    from ..core.progress import bar

    # rank 0's only; MESHLAB_PROGRESS=0 hides it (core.progress)
    with bar(len(cands) * len(remats), "advise: layouts", unit="layout", on=bool(progress),
             leave=False) as b:
        return _each(traced, cands, remats, cap, card, seq, example, b.update)


def _each(traced, cands, remats, cap, card, seq, example, bar):
    """``_search``'s loop; ``bar(n)`` advances the progress by ``n`` layouts, planned or
    refused, so it reaches its total."""
    from ..core.mesh import Mesh
    from ..planning.rows import shared_rows
    from ..transforms import pipeline, remat, sequence, zero_shard

    tried, refused, why = [], 0, ""
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
        except MeshlabError as e:
            bar(len(remats))
            refused += len(remats)
            why = why or f"{e} (on {axes})"
            continue
        if base.not_runnable:
            bar(len(remats))
            refused += len(remats)
            why = why or f"{base.not_runnable[0]} (on {axes})"
            continue
        # The rooms' memory rows and gradient reductions are computed once per mesh and
        # read by every remat policy's memory, comm and time: remat changes neither
        # (``_keeps_rows``).
        with shared_rows() as shared:
            for pol in remats:
                bar(1)
                p = base if pol == "none" else _with(base, remat(pol))
                if p is not base and _keeps_rows(p.rooms, base.rooms):
                    shared.same(p, base)
                mem = p.memory(batch=per_dp, seq=seq, **example)
                st = p.time(batch=per_dp, seq=seq, gpu=card, **example)
                spec = " | ".join(repr(t) for t in p.options if t.kind != "shard") or "-"
                tried.append(Layout(tuple(axes.items()), zero, pol, mb, mem.peak,
                                    mem.peak <= cap, st, spec))
    return tried, refused, why


def _keeps_rows(rooms, base_rooms) -> bool:
    """Whether a plan with ``rooms`` keeps the memory rows and gradient reductions of one
    with ``base_rooms``: the rooms it adds are remat's, which leaves both as they are (its
    ``memory`` and ``reductions`` are the protocol's, and no other room's reads it)."""
    from ..transforms import Remat
    from ..transforms._protocol import Transform

    kept = [t for t in rooms if any(t is b for b in base_rooms)]
    added = [t for t in rooms if not any(t is b for b in base_rooms)]
    return len(kept) == len(base_rooms) and \
        all(type(t) is Remat and type(t).memory is Transform.memory and
            type(t).reductions is Transform.reductions for t in added)


def _with(plan, t):
    """The bound ``plan`` with ``t`` added, for a transform that claims no axis (``remat``):
    what binding ``plan``'s spec ``| t`` again gives, its check run on the result."""
    assert not t.claims(plan), t
    rooms = tuple(sorted(plan.rooms + (t,), key=lambda r: r.phase))
    out = plan.replace(options=plan.options + (t,), transforms=plan.transforms + (repr(t),),
                       rooms=rooms)
    t.check(out)
    return out

