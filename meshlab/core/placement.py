"""The one conversion between ``P`` and DTensor placements, and the block arithmetic.

A mesh with axes ``(a0, a1, ...)`` gives DTensor one placement per mesh axis:
``Shard(d)`` if the spec shards tensor dim ``d`` over that axis, ``Partial('sum')`` if
the axis is in ``spec.partial``, else ``Replicate()``.

Several axes on one tensor dim (``P(('dp', 'tp'))``) split it major-first: ``dp`` takes
contiguous outer blocks, ``tp`` splits each of them. DTensor applies shards in mesh-axis
order, so the axes of a tuple must appear in mesh order; the other order would need
DTensor's private strided shard and is refused with the fix.

Uneven dims follow DTensor (``torch.chunk``): each of ``k`` shards holds
``ceil(n / k)`` elements except the last ones, which may be smaller or empty. ``bind``
refuses them unless ``uneven=True``; nothing ever computes wrong numbers for them.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

from .errors import SpecError
from .spec import PARTIAL_OPS, P


def check_spec(spec: P, shape: Sequence[int], mesh_axes: Sequence[str], *,
               what: str = "tensor", mesh_repr: str | None = None,
               any_order: bool = False) -> None:
    """Raise ``SpecError`` unless ``spec`` names only mesh axes, in order (unless
    ``any_order``: a layout only read, as ``visualize`` reads one), within ``ndim``."""
    mesh_axes = tuple(mesh_axes)
    where = mesh_repr or f"mesh axes {mesh_axes}"
    if len(spec) > len(shape):
        raise SpecError(
            f"{what} {tuple(shape)}: {spec!r} has {len(spec)} entries but the tensor has "
            f"{len(shape)} dims; drop the extra entries (trailing dims are replicated anyway)"
        )
    for name in spec.axes:
        if name not in mesh_axes:
            raise SpecError(
                f"{what} {tuple(shape)}: {spec!r} names axis {name!r}, which {where} does not "
                f"have (axes: {mesh_axes}); use one of those or map it with Rules"
            )
    for d in range(len(spec)):
        axes = spec.dim_axes(d)
        idx = [mesh_axes.index(a) for a in axes]
        if idx != sorted(idx) and not any_order:
            fixed = tuple(sorted(axes, key=mesh_axes.index))
            raise SpecError(
                f"{what} {tuple(shape)}: {spec!r} shards dim {d} over {axes}, against the "
                f"mesh order {mesh_axes}; DTensor splits a dim over axes in mesh order, so "
                f"write {fixed} or build the Mesh with the axes in the order you want"
            )


def to_placements(spec: P, mesh_axes: Sequence[str], shape: Sequence[int], *,
                  what: str = "tensor"):
    """``P`` (mesh axes) -> a tuple of DTensor placements, one per mesh axis."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    mesh_axes = tuple(mesh_axes)
    check_spec(spec, shape, mesh_axes, what=what)
    out: list = [Replicate()] * len(mesh_axes)
    for d in range(len(spec)):
        for a in spec.dim_axes(d):
            out[mesh_axes.index(a)] = Shard(d)
    for a in spec.partial:
        out[mesh_axes.index(a)] = Partial(spec.partial_op)
    return tuple(out)


def from_placements(placements: Sequence, mesh_axes: Sequence[str], ndim: int) -> P:
    """DTensor placements -> ``P`` in mesh axes (inverse of ``to_placements``).

    Every placement meshlab makes has a spelling: ``Partial('avg')`` (the mean of a sharded
    value) is ``P(partial=..., partial_op='avg')``, and the strided shard FSDP2 leaves on a
    tensor-parallel parameter (``_StridedShard`` over the data axis: the dim is split by the
    tensor-parallel axis first, each block then by the data axis) is the joint
    ``P(('tp', 'dp'))`` in that true major order, against the mesh order (a layout to read,
    ``visualize`` and ``typeof``; ``to_placements`` builds only mesh-ordered ones).
    """
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    dims: list[list[str]] = [[] for _ in range(ndim)]
    strided: list[list[str]] = [[] for _ in range(ndim)]
    partial: list[str] = []
    ops: set[str] = set()
    for axis, pl in zip(mesh_axes, placements):
        if isinstance(pl, _StridedShard):
            strided[pl.dim if pl.dim >= 0 else pl.dim + ndim].append(axis)
        elif type(pl) is Shard:
            dims[pl.dim if pl.dim >= 0 else pl.dim + ndim].append(axis)
        elif isinstance(pl, Partial):
            if pl.reduce_op not in PARTIAL_OPS:
                raise SpecError(f"placement {pl!r} on axis {axis!r}: reduce op "
                                f"{pl.reduce_op!r} has no P spelling (P's partial_op is one "
                                f"of {PARTIAL_OPS}); redistribute it first")
            partial.append(axis)
            ops.add(pl.reduce_op)
        elif isinstance(pl, Replicate):
            pass
        else:
            raise SpecError(f"placement {pl!r} on axis {axis!r} has no P spelling; "
                            f"redistribute it first")
    if len(ops) > 1:
        raise SpecError(f"placements {tuple(placements)}: pending reductions of different kinds "
                        f"({sorted(ops)}) on one value have no P spelling; reduce one first")
    # a strided axis splits what the plain shards of its dim left: it is the minor one
    merged = [a + s for a, s in zip(dims, strided)]
    entries = [None if not a else (a[0] if len(a) == 1 else tuple(a)) for a in merged]
    return P(*entries, partial=tuple(partial) or None,
             partial_op=ops.pop() if ops else "sum").normalized()


def dim_block(n: int, sizes: Sequence[int], coords: Sequence[int]) -> tuple[int, int]:
    """(offset, length) of the block of a dim of size ``n`` split over axes of ``sizes``
    (major first) held at ``coords``, with DTensor's ``torch.chunk`` semantics."""
    offset, length = 0, n
    for k, c in zip(sizes, coords):
        full = -(-length // k) if length else 0
        start = min(c * full, length)
        sub = max(0, min(full, length - start))
        offset, length = offset + start, sub
    return offset, length


def local_shape(shape: Sequence[int], spec: P, axis_sizes: dict[str, int],
                coord: dict[str, int] | None = None) -> tuple[int, ...]:
    """The local shape at mesh ``coord`` (default: coordinate 0, the largest any rank holds)."""
    return _local_shape(tuple(shape), spec, tuple(axis_sizes.items()),
                        tuple(coord.items()) if coord else ())


# Keyed on the shape, the spec (a P is immutable and hashable; specs equal as values shard
# every dim alike) and the sizes and coordinates as tuples: a pure function of immutable
# values, asked for every parameter of every layout the planner weighs.
@functools.lru_cache(maxsize=1 << 16)
def _local_shape(shape: tuple[int, ...], spec: P, sizes: tuple, coord: tuple) -> tuple[int, ...]:
    axis_sizes, at = dict(sizes), dict(coord)
    return tuple(
        dim_block(n, [axis_sizes[a] for a in spec.dim_axes(d)],
                  [at.get(a, 0) for a in spec.dim_axes(d)])[1]
        for d, n in enumerate(shape)
    )


def uneven_dims(shape: Sequence[int], spec: P, axis_sizes: dict[str, int]) -> list[tuple[int, int]]:
    """(dim, shard count) for every dim whose size the shard count does not divide."""
    out = []
    for d, n in enumerate(shape):
        k = math.prod(axis_sizes[a] for a in spec.dim_axes(d))
        if k > 1 and n % k:
            out.append((d, k))
    return out


def mesh_repr(sizes) -> str:
    """``Mesh(dp=2, tp=4)`` for a mapping of axis sizes."""
    return "Mesh(" + ", ".join(f"{n}={s}" for n, s in sizes.items()) + ")"
