"""Which mesh axes a value inside ``shard_map``'s function varies along, and the gradient
rule that follows from it (JAX's device-variance types, JEP 17111).

Inside the function every rank computes on its own blocks. A value is *varying* along a
mesh axis when the ranks of that axis may hold different values (an input split over the
axis, anything computed from one), *invariant* otherwise (an input its spec replicates
over the axis, a value the function closes over, the result of ``psum``). When an op mixes
an invariant operand with one varying along axis ``a``, JAX inserts ``pbroadcast`` (a
no-op whose transpose is a ``psum``) on the invariant one; this module does the same:

    w (invariant) * x (varying along 'dp')  ->  pvary(w, 'dp') * x

so the gradient reaching ``w`` is summed over ``'dp'``: the gradient of the global
computation, as in one process. ``Region`` is the running call's mesh and the axes it
tracks; ``VaryingMode`` (a ``TorchFunctionMode`` active while the function runs) marks
each op's outputs with the union of its operands' axes and inserts ``pvary`` where an
operand with ``requires_grad`` lacks some of them.

Inside a parallelized model the data-parallel axes are not tracked (every rank runs its
own batch there and the optimizer averages gradients over them), and on the local-shard
path a tensor the function closes over counts as varying (a tensor-parallel module's
weight is a local view there, not a replicated value), so only declared inputs get the
rule.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

_VMA = "_meshlab_vma"          # the attribute a tensor inside the function keeps its axes in


@dataclasses.dataclass
class Region:
    """The ``shard_map`` call running now: its DeviceMesh, the axes whose variance is
    tracked, and what a tensor without a mark counts as (``unmarked``: the empty set,
    invariant, or every tracked axis)."""

    dm: Any
    tracked: frozenset
    unmarked: frozenset
    name: str
    suspended: bool = False
    # marks are (token, axes): a mark another call left on a tensor counts as none here
    token: int = dataclasses.field(default_factory=lambda: next(_TOKENS))

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(self.dm.mesh_dim_names)

    def group(self, axis: str):
        return self.dm.get_group(self.axes.index(axis))

    def size(self, axis: str) -> int:
        return self.dm.size(self.axes.index(axis))

    def index(self, axis: str) -> int:
        return self.dm.get_local_rank(self.axes.index(axis))


_TOKENS = itertools.count()
_REGION: contextvars.ContextVar["Region | None"] = contextvars.ContextVar(
    "meshlab_shard_map_region", default=None)


def current_region() -> Region | None:
    return _REGION.get()


def _marked(t: torch.Tensor, region: Region) -> frozenset | None:
    got = getattr(t, _VMA, None)
    return got[1] if got is not None and got[0] == region.token else None


def vma(t: torch.Tensor, region: Region | None = None) -> frozenset:
    """The axes ``t`` varies along in the running function (``region``'s default for a
    tensor it never saw). A view varies along what its base does too: a write into the
    base (or through another view of it) after the view was taken reaches it."""
    region = region or current_region()
    if region is None:
        return frozenset()
    own = _marked(t, region)
    own = region.unmarked if own is None else own
    base = getattr(t, "_base", None)
    if base is not None:
        own = own | (_marked(base, region) or frozenset())
    return own


def mark(t: Any, axes: frozenset, region: Region | None = None) -> Any:
    """Record that tensor ``t`` varies along ``axes`` in the running call; returns ``t``."""
    region = region or current_region()
    if isinstance(t, torch.Tensor) and region is not None:
        try:
            setattr(t, _VMA, (region.token, frozenset(axes)))
        except (AttributeError, RuntimeError):      # a tensor that takes no attributes
            pass
    return t


@contextlib.contextmanager
def suspended():
    """Run collectives' own tensor code without the mode marking it."""
    region = current_region()
    if region is None or region.suspended:
        yield
        return
    region.suspended = True
    try:
        yield
    finally:
        region.suspended = False


def _sum_over(g: torch.Tensor, groups: tuple) -> torch.Tensor:
    g = g.contiguous().clone()
    for grp in groups:
        dist.all_reduce(g, group=grp)
    return g


class _PVary(torch.autograd.Function):
    """``pbroadcast``: the identity, whose transpose sums the cotangent over ``groups``."""

    @staticmethod
    def forward(ctx, x, groups):
        ctx.groups = groups
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _sum_over(g, ctx.groups), None


def pvary(x: torch.Tensor, axes, region: Region | None = None) -> torch.Tensor:
    """``x`` marked varying along ``axes`` as well; its gradient is summed over them."""
    region = region or current_region()
    new = frozenset(axes) - vma(x, region)
    if not new:
        return x
    with suspended():
        groups = tuple(region.group(a) for a in region.axes if a in new)
        out = _PVary.apply(x, groups) if x.requires_grad and torch.is_grad_enabled() else x
    if out is x:
        out = x.view_as(x) if x.requires_grad else x
    return mark(out, vma(x, region) | new, region)


# Functions whose results are not values of the computation (shapes, dtypes, the tensor's
# attributes): no mark, no pbroadcast.
_PASS = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.__len__,
         torch.Tensor.element_size, torch.Tensor.is_contiguous, torch.Tensor.stride,
         torch.Tensor.data_ptr, torch.Tensor.__repr__, torch.Tensor.__format__,
         torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__}


# Python's in-place operators and item assignment: they write their first operand.
_IN_PLACE = {f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow",
                                     "matmul", "and", "or", "xor", "lshift", "rshift")} | \
    {"__setitem__"}


def _written(func, args, kwargs) -> torch.Tensor | None:
    """The tensor an op writes in place (``add_``, ``x += y``, ``x[i] = y``, ``out=``), or
    None for an op that writes nothing."""
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor):
        return out
    name = getattr(func, "__name__", "")
    if (name.endswith("_") and not name.startswith("__")) or name in _IN_PLACE:
        first = args[0] if args else None
        return first if isinstance(first, torch.Tensor) else None
    return None


def _mark_written(t: torch.Tensor, axes: frozenset, region: Region) -> None:
    """``t`` written with values varying along ``axes``: it and every base it views vary
    along them from now on (a view's axes include its base's, see :func:`vma`)."""
    while t is not None:
        mark(t, vma(t, region) | axes, region)
        t = getattr(t, "_base", None)


def _refuse_invariant_write(target: torch.Tensor, new: frozenset, region: Region,
                            name: str) -> None:
    from .errors import SpecError

    axes = tuple(a for a in region.axes if a in new)
    raise SpecError(
        f"shard_map({region.name}): {name} writes values that vary along {axes} in place "
        f"into a tensor that is the same on every rank there and needs a gradient: its "
        f"gradient would not be summed over {axes} (JAX has no in-place writes; its "
        f"functional form sums it). Write it out of place (y = y + x, y = y.index_put(...), "
        f"torch.where(...)), or make the tensor vary first (y = ml.pcast(y, {axes!r}, to='varying'))")


def _broadcast(args, kwargs, leaves, union: frozenset, region: Region, written=None):
    """``(args, kwargs)`` with each operand that needs a gradient and lacks some of
    ``union`` through ``pvary`` (the tensor an op writes in place, and DTensors, kept)."""
    lacking = [t for t in leaves if union - vma(t, region) and t.requires_grad
               and t is not written and not isinstance(t, DTensor)]
    if not lacking:
        return args, kwargs
    swap = {id(t): pvary(t, union, region) for t in lacking}
    return tree_map(lambda v: swap.get(id(v), v) if isinstance(v, torch.Tensor) else v,
                    (args, kwargs))


class VaryingMode(TorchFunctionMode):
    """Active while ``shard_map``'s function runs: every op's tensor outputs are marked
    with the union of its operands' axes, and an operand that needs a gradient and lacks
    some of them goes through ``pvary`` first (see the module doc). An op that writes a
    tensor in place (``add_``, ``x[i] = y``, ``out=``) marks that tensor, and the bases it
    views, with the union; its other operands get ``pvary`` as any op's do, and a written
    tensor that needs a gradient and lacks some of the axes is refused (its own gradient
    could not be summed)."""

    def __init__(self, region: Region):
        super().__init__()
        self.region = region

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        region = self.region
        if region.suspended or func in _PASS:
            return func(*args, **kwargs)
        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not leaves:
            return func(*args, **kwargs)
        axes = [vma(t, region) for t in leaves]
        union = frozenset().union(*axes) & region.tracked
        written = _written(func, args, kwargs)
        grad = torch.is_grad_enabled()
        if union and grad and written is not None and written.requires_grad and \
                not isinstance(written, DTensor) and union - vma(written, region):
            _refuse_invariant_write(written, union - vma(written, region), region,
                                    getattr(func, "__name__", str(func)))
        if union and grad:
            args, kwargs = _broadcast(args, kwargs, leaves, union, region, written)
        out = func(*args, **kwargs)
        if written is not None:
            _mark_written(written, union, region)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t is not written:
                mark(t, union, region)
        return out


_APPLY = torch.autograd.Function.__dict__["apply"].__func__
_PATCHED = [0]        # regions that have torch.autograd.Function.apply patched


def _apply(cls, *args, **kwargs):
    """``torch.autograd.Function.apply`` while a region runs: a custom autograd function
    is one op to the rule, its operands that need a gradient and lack some of the others'
    axes go through ``pvary`` (its forward runs without gradients, where the mode would
    insert none), and its outputs are marked with the union."""
    region = current_region()
    if region is None or region.suspended or not torch.is_grad_enabled():
        return _APPLY(cls, *args, **kwargs)
    leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    union = frozenset().union(*(vma(t, region) for t in leaves)) & region.tracked
    args, kwargs = _broadcast(args, kwargs, leaves, union, region)
    out = _APPLY(cls, *args, **kwargs)
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            mark(t, union | vma(t, region), region)
    return out


@contextlib.contextmanager
def _custom_functions():
    """``torch.autograd.Function.apply`` follows the rule while a region runs (a
    ``TorchFunctionMode`` does not see it); put back when the last region ends."""
    if _PATCHED[0] == 0:
        torch.autograd.Function.apply = classmethod(_apply)
    _PATCHED[0] += 1
    try:
        yield
    finally:
        _PATCHED[0] -= 1
        if _PATCHED[0] == 0:
            torch.autograd.Function.apply = classmethod(_APPLY)


_ONE_DEVICE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "meshlab_one_device", default=None)


@contextlib.contextmanager
def one_device(name: str):
    """Run a ``shard_map`` function that found no mesh anywhere: one device holds every
    block, and each axis a collective names has one rank there."""
    token = _ONE_DEVICE.set(name)
    try:
        yield
    finally:
        _ONE_DEVICE.reset(token)


def on_one_device() -> str | None:
    """The name of the ``shard_map`` function running on one device (``one_device``),
    or None (inside a region, or outside any function)."""
    return _ONE_DEVICE.get() if _REGION.get() is None else None


@contextlib.contextmanager
def reenter(r: Region):
    """Run code of region ``r``'s function: ``r`` is current and its mode on. Also for a
    part of it the backward recomputes after the function returned, whose values then get
    the marks (and the pvary calls) of the first run."""
    token = _REGION.set(r)
    try:
        with _custom_functions(), VaryingMode(r):
            yield r
    finally:
        _REGION.reset(token)


@contextlib.contextmanager
def region(dm, tracked, *, unmarked_varying: bool, name: str):
    """Run a ``shard_map`` function: the region is current and the mode is on."""
    tracked = frozenset(tracked)
    with reenter(Region(dm, tracked, tracked if unmarked_varying else frozenset(), name)) as r:
        yield r
