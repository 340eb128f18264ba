"""Rules: logical axis names -> mesh axes, with ordered fallbacks (flax / MaxText style).

Model code and policies speak a small closed vocabulary of logical axes (``batch``,
``seq``, ``embed``, ``heads``, ``kv_heads``, ``mlp``, ``vocab``, ``expert``,
``layers``); one ``Rules`` table says which mesh axes each one uses. A rule's value
is ``None`` (replicate), a mesh axis name, or a tuple of fallbacks tried in order; a
fallback may itself be a tuple of axes that shard the dimension together.

The first fallback whose axes are all present in the mesh and not yet used by an
earlier dimension of the same spec wins; if none does, the dimension is replicated. A
name of the vocabulary above with no rule is replicated; any other name that is neither
a rule nor a mesh axis raises (it is most likely a typo).

Worked example, on a mesh with axes ``('dp', 'tp')``:

>>> rules = Rules(batch=('dp',), embed=('fsdp', 'tp'), mlp='tp')
>>> rules.resolve(P('batch', 'embed'), ('dp', 'tp'))   # no 'fsdp': falls back to 'tp'
P('dp', 'tp')
>>> rules.resolve(P('mlp', 'embed'), ('dp', 'tp'))     # 'tp' taken by dim 0: replicate
P('tp', None)
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence, Union

from ._errors import RulesError, SpecError
from ._spec import P

LOGICAL_AXES = ("batch", "seq", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab",
                "expert", "layers")

RuleValue = Union[None, str, tuple]
# One alternative: the mesh axes that shard the dimension together, major first.
Alternative = tuple


def _norm_value(name: str, value: RuleValue) -> tuple[Alternative, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return ((value,),)
    if isinstance(value, (tuple, list)):
        alts = []
        for v in value:
            if isinstance(v, str):
                alts.append((v,))
            elif isinstance(v, (tuple, list)) and v and all(isinstance(x, str) for x in v):
                alts.append(tuple(v))
            else:
                raise RulesError(
                    f"rule {name}={value!r}: each fallback must be a mesh axis name or a "
                    f"tuple of names sharding together, e.g. {name}=('fsdp', ('dp', 'tp'))"
                )
        return tuple(alts)
    raise RulesError(f"rule {name}={value!r}: expected None, an axis name or a tuple of them")


def _fmt_value(alts: tuple[Alternative, ...]) -> str:
    if not alts:
        return "None"
    items = [a[0] if len(a) == 1 else a for a in alts]
    if len(items) == 1 and isinstance(items[0], str):
        return repr(items[0])
    return repr(tuple(items))


class Rules:
    """An ordered, immutable mapping from logical axis names to mesh-axis fallbacks."""

    __slots__ = ("_table",)

    def __init__(self, pairs: Iterable[tuple[str, RuleValue]] | Mapping[str, RuleValue] = (),
                 /, **rules: RuleValue) -> None:
        items = list(pairs.items() if isinstance(pairs, Mapping) else pairs) + list(rules.items())
        table: dict[str, tuple[Alternative, ...]] = {}
        for name, value in items:
            if not isinstance(name, str) or not name.isidentifier():
                raise RulesError(f"logical axis names must be identifiers, got {name!r}")
            alts = _norm_value(name, value)
            if name in table and table[name] != alts:
                raise RulesError(
                    f"logical axis {name!r} is given twice with different values: "
                    f"{_fmt_value(table[name])} and {_fmt_value(alts)}; keep one"
                )
            table[name] = alts
        object.__setattr__(self, "_table", table)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Rules are immutable; compose with `|` to extend them")

    def __contains__(self, name: object) -> bool:
        return name in self._table

    def __iter__(self):
        return iter(self._table)

    def __len__(self) -> int:
        return len(self._table)

    def get(self, name: str) -> tuple[Alternative, ...] | None:
        return self._table.get(name)

    def items(self):
        return self._table.items()

    def __or__(self, other: "Rules") -> "Rules":
        """Union of two rule sets; a logical axis mapped differently by each raises."""
        if not isinstance(other, Rules):
            return NotImplemented
        for name, alts in other._table.items():
            mine = self._table.get(name)
            if mine is not None and mine != alts:
                raise RulesError(
                    f"cannot compose rules: {name!r} maps to {_fmt_value(mine)} in the first "
                    f"and {_fmt_value(alts)} in the second; drop it from one side"
                )
        merged = dict(self._table)
        merged.update(other._table)
        out = Rules.__new__(Rules)
        object.__setattr__(out, "_table", merged)
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Rules) and list(self._table.items()) == list(other._table.items())

    def __hash__(self) -> int:
        return hash(tuple(self._table.items()))

    def __repr__(self) -> str:
        return "Rules(" + ", ".join(f"{k}={_fmt_value(v)}" for k, v in self._table.items()) + ")"

    def to_json(self) -> list:
        return [[k, [list(a) for a in v]] for k, v in self._table.items()]

    @classmethod
    def from_json(cls, data: list) -> "Rules":
        return cls([(k, tuple(tuple(a) for a in v) if v else None) for k, v in data])

    # -- resolution ----------------------------------------------------------------------
    def resolve(self, spec: P, mesh_axes: Sequence[str], *, what: str = "spec") -> P:
        """Map every logical name in ``spec`` to mesh axes of a mesh with ``mesh_axes``.

        Names that are already mesh axes pass through. A name that is neither a rule nor
        a mesh axis raises, listing both vocabularies.
        """
        mesh_axes = tuple(mesh_axes)
        used: set[str] = set()
        # Mesh axes named directly are claimed first so a logical fallback cannot take them.
        for n in spec.axes:
            if n not in self._table and n in mesh_axes:
                used.add(n)

        def one(name: str) -> tuple[str, ...]:
            if name not in self._table:
                if name in mesh_axes:
                    return (name,)
                if name in LOGICAL_AXES:
                    return ()  # a vocabulary axis without a rule is replicated
                raise SpecError(
                    f"{what}: {spec!r} names {name!r}, which is neither a mesh axis "
                    f"{mesh_axes} nor a logical axis of {self!r}; add a rule such as "
                    f"Rules({name}='tp') or use a mesh axis"
                )
            for alt in self._table[name]:
                if all(a in mesh_axes for a in alt) and not any(a in used for a in alt):
                    used.update(alt)
                    return alt
            return ()

        dims = []
        for entry in spec:
            names = () if entry is None else ((entry,) if isinstance(entry, str) else entry)
            axes: tuple[str, ...] = ()
            for n in names:
                axes += one(n)
            dims.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
        partial: tuple[str, ...] = ()
        for n in spec.partial:
            partial += one(n)
        return P(*dims, partial=partial or None)


def resolve(spec: P, mesh_axes: Sequence[str], rules: Rules | None, *, what: str = "spec") -> P:
    """Resolve ``spec`` with ``rules`` (or check it names only mesh axes when None)."""
    return (rules or Rules()).resolve(spec, mesh_axes, what=what)
