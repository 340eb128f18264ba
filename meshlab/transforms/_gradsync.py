"""Gradient synchronization from the backward itself: bucketed and overlapped.

Rooms say what a parameter's gradient needs (``Reduction``: a sum over a process group,
optionally averaged); ``GradSync`` carries it out the way DDP's reducer does, so the
model is correct under any optimizer (``torch.optim.AdamW(model.parameters())``
included) and the communication overlaps the rest of the backward:

* parameters with the same reductions, dtype and device are packed into buckets of at
  most ``bucket_mb`` MiB, in reverse registration order (about the order the backward
  produces their gradients);
* a post-accumulate-grad hook marks each gradient ready; when a bucket's last one
  arrives, its flat buffer's first reduction is launched asynchronously, buckets always
  in their order: one waits for those before it, so every rank launches the same
  reductions in the same order even where the ranks' gradients arrive differently (a
  branch only one rank's batch used: its bucket is ready there in the backward, on the
  others only at the end);
* at the end of the backward (an autograd callback) every remaining reduction runs,
  then the results are copied back into ``.grad``.

Each bucket carries one "has a gradient" flag per parameter, reduced with it: a
parameter that no rank used keeps ``grad=None`` (as in one process), and one that only
some ranks used gets the reduced value on every rank. ``enabled=False`` (``no_sync``)
lets gradients accumulate locally over microbatches; the next enabled backward, or
``flush()``, reduces the sums.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import torch
import torch.distributed as dist

from ..core.tensors import local as _local


@dataclasses.dataclass(frozen=True)
class Reduction:
    """Sum the gradients of ``names`` (None: every parameter) over the mesh ``axes``,
    then divide by their size if ``average``; a parameter's reductions run in ``order``.
    A room declares these from the plan alone (``Transform.reductions``), so ``plan.comm``
    counts exactly the buckets the backward will send."""

    axes: tuple[str, ...]
    average: bool
    names: frozenset | None = None
    order: int = 0

    def covers(self, name: str) -> bool:
        return self.names is None or name in self.names


def routes(reductions: list[Reduction], sizes: Mapping[str, int], names) -> dict:
    """``{name: (Reduction, ...)}`` in order, for the parameters some reduction covers
    (reductions over axes of size 1 dropped)."""
    live = sorted((r for r in reductions if math.prod(sizes[a] for a in r.axes) > 1),
                  key=lambda r: r.order)
    out = {}
    for n in names:
        route = tuple(r for r in live if r.covers(n))
        if route:
            out[n] = route
    return out


def layout(items: list, route_of: Mapping[str, tuple], cap_bytes: float) -> list:
    """Buckets ``[(route, [name, ...], numel, dtype)]`` of ``items`` (``(name, numel,
    dtype, itemsize)`` in registration order): reversed (about the order the backward
    produces gradients), grouped by route and dtype, at most ``cap_bytes`` each."""
    open_: dict = {}
    out: list = []
    for name, numel, dtype, size in reversed(items):
        route = route_of.get(name)
        if route is None:
            continue
        key = (route, dtype)
        cur = open_.get(key)
        if cur is None or (cur[2] + numel) * size > cap_bytes:
            cur = open_[key] = [route, [], 0, dtype]
            out.append(cur)
        cur[1].append(name)
        cur[2] += numel
    return [tuple(b) for b in out]


BUCKET_MB = 25.0


def bucket_mb(plan) -> float:
    """The bucket size of ``plan``'s gradient all-reduces: its data-parallel room's
    ``bucket_mb`` (DDP's ``bucket_cap_mb``), else ``BUCKET_MB``."""
    for t in plan.rooms:
        b = getattr(t, "bucket_mb", None)
        if b is not None:
            return b
    return BUCKET_MB


def reduce_dtype(plan) -> torch.dtype | None:
    """The dtype ``precision(reduce=...)`` reduces gradients over the data axes in, or None
    (float32: the gradients' own)."""
    from .precision import Precision

    prec = plan.get(Precision)
    if prec is None or prec.reduce == "float32":
        return None
    return getattr(torch, prec.reduce)


class _Bucket:
    def __init__(self, params: list, groups: list, divide: int, dtype=None):
        self.params = params                    # [(fqn, parameter)]
        self.groups = groups                    # one process group per reduction
        self.divide = divide
        self.dtype = dtype                      # the dtype reduced in (None: the gradients')
        self.ready: set[int] = set()
        self.flat: torch.Tensor | None = None
        self.work = None

    def launch(self) -> None:
        """Flatten (zeros and flag 0 where this rank has no gradient) and start the
        first reduction asynchronously."""
        p0 = self.params[0][1]
        parts, flags = [], []
        for _, p in self.params:
            g = p.grad
            parts.append(_local(g).reshape(-1) if g is not None else
                         torch.zeros(_local(p).numel(), dtype=p.dtype, device=_local(p).device))
            flags.append(1.0 if g is not None else 0.0)
        parts.append(torch.tensor(flags, dtype=p0.dtype, device=parts[0].device))
        self.flat = torch.cat(parts)
        if self.dtype is not None and self.dtype != self.flat.dtype:
            # reduced in a narrower dtype (``precision(reduce=...)``): the average's division
            # comes first, so a float16 sum of many ranks stays in range (torch's
            # fp16_compress_hook divides first too); the flags count exactly
            n = len(self.params)
            self.flat[:-n].div_(self.divide)
            self.flat = self.flat.to(self.dtype)
        self.work = dist.all_reduce(self.flat, group=self.groups[0], async_op=True)

    def finish(self) -> None:
        """The remaining reductions, then the copy back into ``.grad``."""
        self.work.wait()
        for g in self.groups[1:]:
            dist.all_reduce(self.flat, group=g)
        n = len(self.params)
        narrow = self.dtype is not None and self.dtype != self.params[0][1].dtype
        flat = self.flat.to(self.params[0][1].dtype) if narrow else self.flat
        vals, flags = flat[:-n], flat[-n:].tolist()
        if self.divide != 1 and not narrow:
            vals.div_(self.divide)
        off = 0
        for (_, p), used in zip(self.params, flags):
            k = _local(p).numel()
            if used > 0:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                g = _local(p.grad)
                g.copy_(vals[off:off + k].view_as(g))
            off += k
        self.flat, self.work = None, None
        self.ready.clear()


class GradSync:
    """The backward hooks that run every ``Reduction`` (see the module doc)."""

    def __init__(self, params: list, reductions: list[Reduction], ctx,
                 bucket_mb: float = BUCKET_MB, reduce_dtype=None):
        """``params``: ``[(fqn, parameter)]`` of this rank; ``ctx`` finds groups by axis;
        ``reduce_dtype``: the dtype the buckets that reduce over a data axis are summed in
        (``precision(reduce=...)``; None: the gradients' own)."""
        by_name = dict(params)
        route_of = routes(reductions, ctx.plan.mesh_shape, by_name)
        items = [(n, _local(p).numel(), p.dtype, p.element_size()) for n, p in params]
        self.buckets: list[_Bucket] = []
        for route, names, _, _ in layout(items, route_of, bucket_mb * 2 ** 20):
            divide = math.prod(ctx.size(*r.axes) for r in route if r.average)
            data = any(a in ctx.roles.data for r in route for a in r.axes)
            self.buckets.append(_Bucket([(n, by_name[n]) for n in names],
                                        [ctx.group(*r.axes) for r in route], divide,
                                        reduce_dtype if data else None))
        self.enabled = True
        self.launched = {"in_backward": 0, "at_end": 0}   # buckets, since construction
        self._queued = False
        self._next = 0                    # the first bucket of this backward not launched
        self._handles = []
        for b in self.buckets:
            for i, (_, p) in enumerate(b.params):
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook(b, i)))

    @property
    def names(self) -> set[str]:
        return {n for b in self.buckets for n, _ in b.params}

    def _hook(self, b: _Bucket, i: int):
        def hook(_p):
            if not self.enabled:
                return
            if not self._queued:
                self._queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            if b.work is not None:        # a second gradient in one backward: redo at the end
                b.work.wait()
                b.work, b.flat = None, None
            b.ready.add(i)
            # launch, in order, the buckets whose gradients are all in
            while self._next < len(self.buckets):
                nb = self.buckets[self._next]
                if len(nb.ready) < len(nb.params):
                    break
                if nb.work is None:
                    nb.launch()
                    self.launched["in_backward"] += 1
                self._next += 1
        return hook

    def _finish(self) -> None:
        self._queued = False
        self._next = 0
        for b in self.buckets:            # the same order on every rank
            if b.work is None:
                b.launch()
                self.launched["at_end"] += 1
        for b in self.buckets:
            b.finish()

    def flush(self) -> None:
        """Reduce the gradients accumulated so far now (after a ``no_sync`` stretch)."""
        self._next = 0
        for b in self.buckets:
            b.launch()
        for b in self.buckets:
            b.finish()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


# -- what a plain torch optimizer cannot do ---------------------------------------------
_CHECKED = None       # a weakref.WeakSet of the optimizers already found fine


def require_mesh_optimizer(params, why: str) -> None:
    """Make a plain torch optimizer over any of ``params`` refuse its first step with a
    ``ConfigError`` saying ``why`` (ZeRO-1's sharded state lives in ``meshlab.optimizer``;
    a plain optimizer would keep every moment whole and skip the reduce-scatter)."""
    global _CHECKED
    import weakref

    for p in params:
        p._meshlab_needs_optimizer = why
    if _CHECKED is None:
        _CHECKED = weakref.WeakSet()
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_refuse_plain)


def mark_mesh_optimizer(opt) -> None:
    """Mark ``opt`` as an optimizer ``meshlab.optimizer`` drives (its inner one, or
    offload's device half): it may step parameters ``require_mesh_optimizer`` marked."""
    opt._meshlab_inner = True


def _refuse_plain(opt, args, kwargs) -> None:
    from ..core.errors import ConfigError

    if opt in _CHECKED:
        return
    if not getattr(opt, "_meshlab_inner", False):
        for g in opt.param_groups:
            for p in g["params"]:
                why = getattr(p, "_meshlab_needs_optimizer", None)
                if why:
                    raise ConfigError(
                        f"{type(opt).__name__} steps a model that {why}; build it with "
                        f"meshlab.optimizer(model, torch.optim.{type(opt).__name__}, ...) "
                        f"instead of passing model.parameters() to torch directly")
    _CHECKED.add(opt)


def plan_reductions(plan) -> list[Reduction]:
    """Every room's ``Transform.reductions`` of a bound plan."""
    return [r for t in plan.rooms for r in t.reductions(plan)]
