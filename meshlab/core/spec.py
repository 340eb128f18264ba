"""P: a PartitionSpec with JAX semantics.

Each entry describes one tensor dimension: ``None`` (replicated), an axis name, or a
tuple of axis names (the dimension is split over several axes, the first one major).
Dimensions past the end of the spec are replicated, so ``P()`` is fully replicated.
``partial`` names axes over which the value is an unreduced sum (an activation that
still needs an all-reduce), like JAX's ``unreduced``.

Names may be mesh axes (``'dp'``) or logical axes (``'embed'``) that ``Rules`` map to
mesh axes; a ``P`` does not know which until it meets a mesh or rules.

>>> P('dp', None)
P('dp', None)
>>> P(('dp', 'tp'), 'sp').axes
('dp', 'tp', 'sp')
>>> P('dp') == P('dp', None)
True
"""

from __future__ import annotations

from typing import Iterator, Union

from .errors import SpecError, check_int

Entry = Union[None, str, tuple]


def _check_name(name: object, where: str) -> str:
    if not isinstance(name, str) or not name.isidentifier():
        raise SpecError(
            f"{where}: axis names must be identifiers such as 'dp' or 'heads', got {name!r}"
        )
    return name


def _norm_entry(e: object, i: int) -> Entry:
    if e is None:
        return None
    if isinstance(e, str):
        return _check_name(e, f"P entry {i}")
    if isinstance(e, (tuple, list)):
        names = tuple(_check_name(n, f"P entry {i}") for n in e)
        # A 1-tuple shards exactly like the bare name; keep one spelling.
        return None if not names else (names[0] if len(names) == 1 else names)
    raise SpecError(
        f"P entry {i} is {e!r}; each entry must be None, an axis name, or a tuple of "
        f"axis names, e.g. P('dp', ('fsdp', 'tp'), None)"
    )


# The pending reductions a value may carry over its partial axes (DTensor's Partial ops).
PARTIAL_OPS = ("sum", "avg")


class P:
    """A PartitionSpec: one entry per tensor dimension; immutable and hashable."""

    # ``_key_``, ``_hash`` and ``_axes``: made when first asked, kept (a P is immutable)
    __slots__ = ("_dims", "_partial", "_op", "_key_", "_hash", "_axes")

    def __init__(self, *entries: Entry, partial: str | tuple[str, ...] | None = None,
                 partial_op: str = "sum") -> None:
        dims = tuple(_norm_entry(e, i) for i, e in enumerate(entries))
        if partial is None:
            part: tuple[str, ...] = ()
        elif isinstance(partial, str):
            part = (_check_name(partial, "P partial"),)
        elif not isinstance(partial, (tuple, list)):
            raise SpecError(f"P(partial={partial!r}): give an axis name or a tuple of axis names")
        else:
            part = tuple(_check_name(n, "P partial") for n in partial)
        if partial_op not in PARTIAL_OPS:
            raise SpecError(f"P(partial_op={partial_op!r}): a pending reduction is one of "
                            f"{PARTIAL_OPS} ('sum' unless a mean left it: 'avg')")
        object.__setattr__(self, "_dims", dims)
        object.__setattr__(self, "_partial", part)
        object.__setattr__(self, "_op", partial_op if part else "sum")
        object.__setattr__(self, "_key_", None)
        object.__setattr__(self, "_hash", None)
        object.__setattr__(self, "_axes", None)
        seen: dict[str, str] = {}
        for where, name in self._iter_named():
            if name in seen:
                raise SpecError(
                    f"{self!r} uses axis {name!r} twice ({seen[name]} and {where}); a mesh "
                    f"axis can shard at most one dimension of a tensor. Remove one use."
                )
            seen[name] = where

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("P is immutable; build a new one")

    # -- sequence protocol -------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._dims)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._dims)

    def __getitem__(self, i):
        return self._dims[i]

    # -- queries -------------------------------------------------------------------------
    @property
    def partial(self) -> tuple[str, ...]:
        """Axes over which this value is an unreduced (pending) reduction."""
        return self._partial

    @property
    def partial_op(self) -> str:
        """The pending reduction over ``partial``: ``'sum'`` (the default), or ``'avg'``
        (a mean of sharded values, as DTensor leaves ``x.mean()``)."""
        return self._op

    def _iter_named(self) -> Iterator[tuple[str, str]]:
        for i, e in enumerate(self._dims):
            for n in (e,) if isinstance(e, str) else (e or ()):
                yield f"dim {i}", n
        for n in self._partial:
            yield "partial", n

    @property
    def axes(self) -> tuple[str, ...]:
        """Every axis name the spec uses, in order (sharded dims, then partial)."""
        if self._axes is None:
            object.__setattr__(self, "_axes", tuple(n for _, n in self._iter_named()))
        return self._axes

    def dim_axes(self, dim: int) -> tuple[str, ...]:
        """The axes that shard tensor dimension ``dim``, major first (empty: replicated)."""
        if type(dim) is not int or dim < 0:       # the message is built only when it fails
            dim = check_int(dim, f"{self!r}.dim_axes", "dim", low=0, error=SpecError, example=0)
        if dim >= len(self._dims):
            return ()
        e = self._dims[dim]
        return () if e is None else ((e,) if isinstance(e, str) else e)

    def padded(self, ndim: int) -> "P":
        """This spec with trailing ``None`` entries up to ``ndim`` dimensions."""
        if type(ndim) is not int or ndim < 0:
            ndim = check_int(ndim, f"{self!r}.padded", "ndim", low=0, error=SpecError, example=2)
        if len(self) > ndim:
            raise SpecError(f"{self!r} has {len(self)} entries but the tensor has {ndim} dims")
        return P(*self._dims, *([None] * (ndim - len(self))), partial=self._partial or None,
                 partial_op=self._op)

    def normalized(self) -> "P":
        """Trailing ``None`` entries dropped: ``P('dp', None) -> P('dp')``."""
        dims = list(self._dims)
        while dims and dims[-1] is None:
            dims.pop()
        return P(*dims, partial=self._partial or None, partial_op=self._op)

    def replace(self, *entries: Entry, partial: object = ...) -> "P":
        """A copy with new dimension entries and/or ``partial``."""
        return P(*(entries if entries else self._dims),
                 partial=self._partial or None if partial is ... else partial,
                 partial_op=self._op)

    # -- value semantics -----------------------------------------------------------------
    def _key(self) -> tuple:
        if self._key_ is None:
            dims = list(self._dims)
            while dims and dims[-1] is None:
                dims.pop()
            # A pending sum over several axes is one sum whatever order they are named in.
            object.__setattr__(self, "_key_", (tuple(dims), tuple(sorted(self._partial)),
                                               self._op))
        return self._key_

    def __eq__(self, other: object) -> bool:
        if isinstance(other, P):
            return self is other or self._key() == other._key()
        return NotImplemented

    def __hash__(self) -> int:
        if self._hash is None:
            object.__setattr__(self, "_hash", hash(self._key()))
        return self._hash

    def __repr__(self) -> str:
        parts = [repr(e) for e in self._dims]
        if self._partial:
            p = self._partial[0] if len(self._partial) == 1 else self._partial
            parts.append(f"partial={p!r}")
            if self._op != "sum":
                parts.append(f"partial_op={self._op!r}")
        return f"P({', '.join(parts)})"

    __str__ = __repr__

    def __reduce__(self):
        return (_rebuild, (self._dims, self._partial, self._op))

    def to_json(self) -> dict:
        """A JSON-ready dict; ``P.from_json`` inverts it."""
        d = {"dims": [list(e) if isinstance(e, tuple) else e for e in self._dims],
             "partial": list(self._partial)}
        if self._op != "sum":
            d["partial_op"] = self._op
        return d

    @classmethod
    def from_json(cls, d: dict) -> "P":
        """The ``P`` that ``to_json`` wrote: ``{'dims': [...], 'partial': [...]}``."""
        dims = d.get("dims") if isinstance(d, dict) else None
        partial = d.get("partial", ()) if isinstance(d, dict) else None
        if not isinstance(dims, list) or not isinstance(partial, (list, tuple)):
            raise SpecError(f"P.from_json({d!r}): expected {{'dims': [entry, ...], 'partial': "
                            f"[axis, ...]}} as P.to_json() writes it, e.g. "
                            f"{P('dp', None).to_json()!r}")
        return cls(*[tuple(e) if isinstance(e, list) else e for e in dims],
                   partial=tuple(partial) or None, partial_op=d.get("partial_op", "sum"))


def _rebuild(dims: tuple, partial: tuple, op: str = "sum") -> P:
    return P(*dims, partial=partial or None, partial_op=op)


PartitionSpec = P
