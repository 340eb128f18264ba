"""Collectives by mesh axis name, for code inside ``shard_map``'s function (JAX's
``jax.lax.psum``, ``all_gather``, ...), each differentiable with JAX's transpose.

Every function takes the axis name (or a tuple of names, major first, where JAX takes
one) of the running ``shard_map`` call and works on this rank's local tensor:

=================  =====================================  ==================  ==============
collective         what it computes                        varies along after  gradient
=================  =====================================  ==================  ==============
``psum``           the sum over the axes                   the axes dropped    identity
``pmean``          the mean over the axes                  the axes dropped    1/n
``pmax``/``pmin``  the max / min over the axes             the axes dropped    none (as JAX)
``all_gather``     every rank's block, stacked or tiled    the axes kept       ``psum_scatter``
``psum_scatter``   this rank's block of the sum            the axes kept       ``all_gather``
``ppermute``       the block of the rank ``perm`` names    the axis kept       inverse perm
``all_to_all``     blocks exchanged between two dims       the axis kept       ``all_to_all``
``axis_index``     this rank's position on the axes        the axes            none
``axis_size``      the number of ranks on the axes         (a Python int)
=================  =====================================  ==================  ==============

An input that is the same on every rank of a named axis (invariant, see
``meshlab.core.varying``) is treated as JAX treats it: broadcast first, so ``psum`` of an
invariant ``x`` over an axis of size n is ``n * x`` and its gradient is summed back.
Outside a ``shard_map`` function each raises ``ConfigError`` naming the fix. In a
``shard_map`` function that found no mesh anywhere (one process, no parallelized model:
one device holds every block) each named axis has one rank, and each collective returns
what it returns over an axis of size 1, so a model written with them runs unchanged there.

>>> import meshlab as ml
>>> ml.axis_size  # doctest: +ELLIPSIS
<function axis_size at ...>
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .collectives import all_gather_into, reduce_scatter_into
from .errors import ConfigError, SpecError
from .varying import Region, current_region, mark, on_one_device, pvary, suspended, vma


def _region(fn: str, axis_name) -> tuple[Region, tuple[str, ...]]:
    """The running call and the named axes, each checked."""
    r = current_region()
    if r is None:
        raise ConfigError(
            f"{fn}(..., {axis_name!r}): collectives by axis name run inside the function "
            f"shard_map calls (ml.shard_map(f, in_specs, out_specs, mesh=mesh)), where axis "
            f"names mean mesh axes; call {fn} there. A part of that function the backward "
            f"recomputes (activation checkpointing) runs it again outside: wrap that part "
            f"with ml.remat(f) instead of torch.utils.checkpoint")
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name) \
        if isinstance(axis_name, (tuple, list)) else None
    if not axes or not all(isinstance(a, str) for a in axes):
        raise ConfigError(f"{fn}(..., {axis_name!r}): give a mesh axis name or a tuple of "
                          f"them, e.g. {fn}(x, 'dp') or {fn}(x, ('dp', 'tp'))")
    for a in axes:
        if a not in r.axes:
            raise SpecError(f"{fn}(..., {axis_name!r}) in shard_map({r.name}): {a!r} is not an "
                            f"axis of this call's mesh {r.axes}; name one of those")
    if len(set(axes)) != len(axes):
        raise ConfigError(f"{fn}(..., {axis_name!r}): each axis once")
    return r, axes


def _alone(fn: str, axis_name) -> bool:
    """Whether ``fn`` runs in a ``shard_map`` function on one device (the module doc):
    every axis ``axis_name`` names has one rank there."""
    if current_region() is not None or on_one_device() is None:
        return False
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name) \
        if isinstance(axis_name, (tuple, list)) else None
    if not axes or not all(isinstance(a, str) for a in axes) or len(set(axes)) != len(axes):
        raise ConfigError(f"{fn}(..., {axis_name!r}): give a mesh axis name or a tuple of "
                          f"them, each once, e.g. {fn}(x, 'dp') or {fn}(x, ('dp', 'tp'))")
    return True


def _no_axes(axis_name) -> bool:
    """``axis_name`` is ``()``: JAX's ``psum``, ``pmean``, ``all_gather``,
    ``psum_scatter`` and ``axis_index`` over no axis return their input (0)."""
    return isinstance(axis_name, (tuple, list)) and len(axis_name) == 0


def _groups(r: Region, axes) -> tuple:
    return tuple(r.group(a) for a in axes)


def _tensor(fn: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ConfigError(f"{fn}: expected a torch.Tensor (a local block), got "
                          f"{type(x).__name__}")
    return x


def _sum(x: torch.Tensor, groups, op=dist.ReduceOp.SUM) -> torch.Tensor:
    x = x.contiguous().clone()
    for g in groups:
        dist.all_reduce(x, op=op, group=g)
    return x


class _PSum(torch.autograd.Function):
    """Varying -> invariant; the transpose is ``pbroadcast``: the cotangent as it is."""

    @staticmethod
    def forward(ctx, x, groups):
        return _sum(x, groups)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _NoGrad(torch.autograd.Function):
    """``pmax``/``pmin``: JAX defines no derivative for them; neither does this."""

    @staticmethod
    def forward(ctx, x, groups, op, name):
        ctx.name = name
        return _sum(x, groups, op)

    @staticmethod
    def backward(ctx, g):
        raise ConfigError(f"{ctx.name} has no gradient (as in JAX): compute the max outside "
                          f"the differentiated path (under torch.no_grad()), or use a smooth "
                          f"reduction such as psum of a logsumexp")


def _one_state(fn: str, x: torch.Tensor, r: Region, axes, axis_name) -> None:
    """A sum (``psum``, ``pmean``, ``psum_scatter``) over axes some of which ``x`` varies
    along and some not is refused, as JAX refuses it."""
    have = vma(x, r)
    tracked = [a for a in axes if a in r.tracked]
    varying = [a for a in tracked if a in have]
    if varying and len(varying) != len(tracked):
        same = tuple(a for a in tracked if a not in have)
        raise SpecError(
            f"{fn}(..., {axis_name!r}) in shard_map({r.name}): x varies along "
            f"{tuple(varying)} and is the same on every rank of {same}; a sum over axes in "
            f"both states is refused, as JAX's lax.{fn} refuses it (its sum over {same} "
            f"would count each rank's copy). Sum over {tuple(varying)!r} alone, or make x "
            f"vary along all of them first: {fn}(ml.pcast(x, {same!r}, to='varying'), "
            f"{axis_name!r})")


def _prepared(fn: str, x, axis_name, *, one_state: bool = False):
    """(region, axes, ``x`` broadcast over the axes it does not vary along, the axes it
    varies along then); ``one_state``: see :func:`_one_state`."""
    x = _tensor(fn, x)
    r, axes = _region(fn, axis_name)
    if one_state:
        _one_state(fn, x, r, axes, axis_name)
    return r, axes, pvary(x, axes, r), vma(x, r) | frozenset(axes)


def _counted(x: torch.Tensor) -> torch.Tensor:
    """A bool tensor as int32, as ``lax.psum`` sums it: the count of ranks holding True
    (an all-reduce of bools would compute their OR)."""
    return x.to(torch.int32) if x.dtype == torch.bool else x


def psum(x: torch.Tensor, axis_name) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``axis_name`` (JAX's ``lax.psum``; a bool
    ``x`` is summed as int32, counting the ranks that hold True)."""
    if _no_axes(axis_name) or _alone("psum", axis_name):
        return _counted(_tensor("psum", x))
    r, axes, x, before = _prepared("psum", _counted(_tensor("psum", x)), axis_name,
                                   one_state=True)
    with suspended():
        out = _PSum.apply(x, _groups(r, axes))
    return mark(out, before - frozenset(axes), r)


def pmean(x: torch.Tensor, axis_name) -> torch.Tensor:
    """The mean of ``x`` over the ranks of ``axis_name`` (``lax.pmean``)."""
    if _no_axes(axis_name) or _alone("pmean", axis_name):   # a mean of ints is a float
        x = _counted(_tensor("pmean", x))
        return x if x.is_floating_point() or x.is_complex() else x / 1
    r, axes = _region("pmean", axis_name)
    n = math.prod(r.size(a) for a in axes)
    _one_state("pmean", _tensor("pmean", x), r, axes, axis_name)
    out = psum(x, axes)
    with suspended():
        res = out / n
    return mark(res, vma(out, r), r)


def _pextreme(fn: str, op, x, axis_name) -> torch.Tensor:
    if _alone(fn, axis_name):
        return _tensor(fn, x)
    r, axes, x, before = _prepared(fn, x, axis_name)
    with suspended():
        out = _NoGrad.apply(x, _groups(r, axes), op, fn)
    return mark(out, before - frozenset(axes), r)


def pmax(x: torch.Tensor, axis_name) -> torch.Tensor:
    """The elementwise max of ``x`` over the ranks of ``axis_name`` (``lax.pmax``)."""
    return _pextreme("pmax", dist.ReduceOp.MAX, x, axis_name)


def pmin(x: torch.Tensor, axis_name) -> torch.Tensor:
    """The elementwise min of ``x`` over the ranks of ``axis_name`` (``lax.pmin``)."""
    return _pextreme("pmin", dist.ReduceOp.MIN, x, axis_name)


# -- gathers and scatters on dim 0, one axis group at a time ----------------------------
def _gather0(x: torch.Tensor, groups) -> torch.Tensor:
    """Every rank's ``x`` concatenated on dim 0, the major axis first (inner groups are
    gathered first, so the outer axis ends up major)."""
    for g in reversed(groups):
        n = dist.get_world_size(g)
        x = x.contiguous()
        out = x.new_empty((n * x.shape[0],) + tuple(x.shape[1:]))
        all_gather_into(out, x, g)
        x = out
    return x


def _scatter0(x: torch.Tensor, groups) -> torch.Tensor:
    """This rank's dim-0 block of the sum over ``groups`` (the inverse of ``_gather0``)."""
    for g in groups:
        n = dist.get_world_size(g)
        x = x.contiguous()
        out = x.new_empty((x.shape[0] // n,) + tuple(x.shape[1:]))
        reduce_scatter_into(out, x, g)
        x = out
    return x


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, groups):
        ctx.groups = groups
        return _gather0(x, groups)

    @staticmethod
    def backward(ctx, g):
        return _scatter0(g, ctx.groups), None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, groups):
        ctx.groups = groups
        return _scatter0(x, groups)

    @staticmethod
    def backward(ctx, g):
        return _gather0(g, ctx.groups), None


def _dim(fn: str, x: torch.Tensor, d: int, extra: int = 0) -> int:
    nd = x.dim() + extra
    if not -nd <= d < nd:
        raise ConfigError(f"{fn}: dimension {d} is out of range for a {x.dim()}-d block")
    return d % nd


def all_gather(x: torch.Tensor, axis_name, *, axis: int = 0, tiled: bool = False):
    """Every rank's block of ``axis_name``, stacked on a new dimension ``axis`` (or, with
    ``tiled``, concatenated along ``axis``), as ``lax.all_gather``."""
    if _no_axes(axis_name):
        return _tensor("all_gather", x)
    if _alone("all_gather", axis_name):
        x = _tensor("all_gather", x)
        return x if tiled else x.unsqueeze(_dim("all_gather", x, axis, 1))
    r, axes, x, before = _prepared("all_gather", x, axis_name)
    n = math.prod(r.size(a) for a in axes)
    d = _dim("all_gather", x, axis, 0 if tiled else 1)
    with suspended():
        src = x.movedim(d, 0) if tiled else x.unsqueeze(0)
        out = _Gather.apply(src, _groups(r, axes))
        out = out.movedim(0, d) if tiled else out.view((n,) + tuple(x.shape)).movedim(0, d)
    return mark(out, before, r)


def psum_scatter(x: torch.Tensor, axis_name, *, scatter_dimension: int = 0,
                 tiled: bool = False):
    """This rank's block of the sum over ``axis_name``: split along
    ``scatter_dimension`` (whose size must be the axis size, and is dropped, or with
    ``tiled`` divisible by it), as ``lax.psum_scatter``."""
    if _tensor("psum_scatter", x).dtype == torch.bool:
        raise ConfigError(f"psum_scatter(..., {axis_name!r}): x is a bool tensor, which "
                          f"lax.psum_scatter refuses too (it adds); cast it first, e.g. "
                          f"psum_scatter(x.int(), ...) to count the ranks holding True")
    if _no_axes(axis_name):
        return x
    alone = _alone("psum_scatter", axis_name)
    if alone:
        x, n = _tensor("psum_scatter", x), 1
    else:
        r, axes, x, before = _prepared("psum_scatter", x, axis_name, one_state=True)
        n = math.prod(r.size(a) for a in axes)
    d = _dim("psum_scatter", x, scatter_dimension)
    size = x.shape[d]
    if (tiled and size % n) or (not tiled and size != n):
        raise SpecError(
            f"psum_scatter(..., {axis_name!r}, scatter_dimension={scatter_dimension}, "
            f"tiled={tiled}): dim {d} has size {size}; it must "
            + (f"divide over the {n} ranks" if tiled else f"equal the {n} ranks (or use "
               f"tiled=True to split it)"))
    if alone:
        return x if tiled else x.squeeze(d)
    with suspended():
        out = _Scatter.apply(x.movedim(d, 0), _groups(r, axes)).movedim(0, d)
        if not tiled:
            out = out.squeeze(d)
    return mark(out, before, r)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, perm):
        ctx.group, ctx.perm = group, perm
        return _permute(x, group, perm)

    @staticmethod
    def backward(ctx, g):
        return _permute(g, ctx.group, tuple((d, s) for s, d in ctx.perm)), None, None


def _permute(x: torch.Tensor, group, perm) -> torch.Tensor:
    me = dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group)
    x = x.contiguous()
    out = torch.zeros_like(x)
    if (me, me) in perm:          # a rank that sends to itself keeps its block: no message
        out.copy_(x)
    ops = [dist.P2POp(dist.isend, x, ranks[d], group) for s, d in perm if s == me != d]
    ops += [dist.P2POp(dist.irecv, out, ranks[s], group) for s, d in perm if d == me != s]
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    return out


def ppermute(x: torch.Tensor, axis_name: str, perm) -> torch.Tensor:
    """Send this rank's block along ``axis_name`` as ``perm`` says (``(source, dest)``
    positions on the axis); a rank no pair sends to gets zeros (``lax.ppermute``)."""
    alone = _alone("ppermute", axis_name)
    if alone:
        x, axes, n = _tensor("ppermute", x), (axis_name,) if isinstance(axis_name, str) \
            else tuple(axis_name), 1
    else:
        r, axes, x, before = _prepared("ppermute", x, axis_name)
        n = r.size(axes[0]) if len(axes) == 1 else 0
    if len(axes) != 1:
        raise ConfigError(f"ppermute(..., {axis_name!r}): one axis at a time here (JAX also "
                          f"takes several); permute over one axis, then the next")
    try:
        perm = tuple((int(s), int(d)) for s, d in perm)
    except (TypeError, ValueError):
        raise ConfigError(f"ppermute(perm={perm!r}): give (source, destination) pairs of "
                          f"positions on {axes[0]!r}, e.g. [(i, (i + 1) % {n}) for i in "
                          f"range({n})]") from None
    srcs, dsts = [s for s, _ in perm], [d for _, d in perm]
    if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts) or not all(
            0 <= i < n for i in srcs + dsts):
        raise ConfigError(f"ppermute(perm={perm!r}): each position of {axes[0]!r} (0 to "
                          f"{n - 1}) sends at most once and receives at most once")
    if alone:                     # the one rank keeps its block if it sends to itself
        return x if perm else torch.zeros_like(x)
    with suspended():
        out = _Permute.apply(x, r.group(axes[0]), perm)
    return mark(out, before, r)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, split, concat):
        ctx.group, ctx.split, ctx.concat = group, split, concat
        return _all_to_all(x, group, split, concat)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g, ctx.group, ctx.concat, ctx.split), None, None, None


def _all_to_all(x: torch.Tensor, group, split: int, concat: int) -> torch.Tensor:
    n = dist.get_world_size(group)
    chunks = x.movedim(split, 0).contiguous()             # (n * s, ...): block i to rank i
    out = torch.empty_like(chunks)
    dist.all_to_all_single(out, chunks, group=group)
    parts = out.view((n, chunks.shape[0] // n) + tuple(chunks.shape[1:])).movedim(1, split + 1)
    return torch.cat(list(parts.unbind(0)), dim=concat)


def all_to_all(x: torch.Tensor, axis_name: str, split_axis: int, concat_axis: int, *,
               tiled: bool = False) -> torch.Tensor:
    """Split ``split_axis`` into one block per rank of ``axis_name``, send block i to rank
    i and concatenate what arrives along ``concat_axis`` (``lax.all_to_all``; without
    ``tiled``, ``split_axis`` has the axis size and is dropped, and a dimension of that
    size is inserted at ``concat_axis``)."""
    alone = _alone("all_to_all", axis_name)
    if alone:
        x, axes, n = _tensor("all_to_all", x), (axis_name,) if isinstance(axis_name, str) \
            else tuple(axis_name), 1
    else:
        r, axes, x, before = _prepared("all_to_all", x, axis_name)
        n = r.size(axes[0]) if len(axes) == 1 else 0
    if len(axes) != 1:
        raise ConfigError(f"all_to_all(..., {axis_name!r}): one axis at a time here")
    s = _dim("all_to_all", x, split_axis)
    if (tiled and x.shape[s] % n) or (not tiled and x.shape[s] != n):
        raise SpecError(f"all_to_all(..., split_axis={split_axis}, tiled={tiled}): dim {s} "
                        f"has size {x.shape[s]}; it must "
                        + (f"divide over the {n} ranks" if tiled else f"equal the {n} ranks"))
    if alone:                     # one block, to this rank: split_axis moves to concat_axis
        return x if tiled else x.movedim(s, _dim("all_to_all", x, concat_axis))
    with suspended():
        if tiled:
            c = _dim("all_to_all", x, concat_axis)
            out = _AllToAll.apply(x, r.group(axes[0]), s, c)
        else:
            c = _dim("all_to_all", x, concat_axis)      # in the result's dims, as JAX
            y = x.movedim(s, 0)                            # (n, ...rest)
            moved = _AllToAll.apply(y, r.group(axes[0]), 0, 0)   # block i now from rank i
            out = moved.movedim(0, c)
    return mark(out, before, r)


def axis_index(axis_name) -> torch.Tensor:
    """This rank's position on ``axis_name`` (on several axes: the flattened position,
    the first axis major), an int32 scalar varying along them (``lax.axis_index``)."""
    if _no_axes(axis_name) or _alone("axis_index", axis_name):
        return torch.tensor(0, dtype=torch.int32)
    r, axes = _region("axis_index", axis_name)
    i = 0
    for a in axes:
        i = i * r.size(a) + r.index(a)
    dev = torch.device("cuda", torch.cuda.current_device()) if r.dm.device_type == "cuda" \
        else torch.device(r.dm.device_type)
    with suspended():
        out = torch.tensor(i, dtype=torch.int32, device=dev)
    return mark(out, frozenset(axes), r)


def axis_size(axis_name) -> int:
    """The number of ranks on ``axis_name`` (on several axes, their product)."""
    if _alone("axis_size", axis_name):
        return 1
    r, axes = _region("axis_size", axis_name)
    return math.prod(r.size(a) for a in axes)


def pcast(x: torch.Tensor, axis_name, *, to: str) -> torch.Tensor:
    """``x`` cast to vary along ``axis_name`` (``lax.pcast(x, axes, to='varying')``, once
    ``lax.pvary``): the same values, and a gradient summed over those axes. Where ``x``
    is the same on every rank of them, the values it is combined with then may differ
    there, in place too."""
    if to != "varying":
        raise ConfigError(f"pcast(..., to={to!r}): only to='varying' is implemented (a value "
                          f"becomes invariant through psum, pmean or all_gather)")
    if _alone("pcast", axis_name):
        return _tensor("pcast", x)
    x = _tensor("pcast", x)
    r, axes = _region("pcast", axis_name)
    return pvary(x, axes, r)
