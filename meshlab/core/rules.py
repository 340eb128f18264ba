"""Rules: logical axis names -> mesh axes, with ordered fallbacks (flax / MaxText style).

Model code and policies speak a small closed vocabulary of logical axes (``batch``,
``seq``, ``embed``, ``heads``, ``kv_heads``, ``mlp``, ``vocab``, ``expert``,
``layers``); one ``Rules`` table says which mesh axes each one uses. A rule's value
is ``None`` (replicate), a mesh axis name, or a tuple of fallbacks tried in order; a
fallback may itself be a tuple of axes that shard the dimension together, and the last
fallback may be ``None`` (replicate).

The first fallback whose axes are all present in the mesh and not yet used by an
earlier dimension of the same spec wins; if every present one is taken, the dimension is
replicated. A name of the vocabulary above with no rule is replicated; any other name
that is neither a rule nor a mesh axis raises (it is most likely a typo).

A rule that names only axes the mesh lacks raises ``RulesError`` when a spec uses it:
``Rules(mlp='model')`` on a ``('dp', 'tp')`` mesh is a misspelled or stale axis, and
replicating instead would silently plan a model that shards nothing. The error names
the rule, the missing axis, the mesh's axes and the nearest axis name. A rule set meant
for meshes with and without an axis says so with a final ``None``:
``mlp=('tp', None)`` uses ``tp`` where the mesh has it and replicates elsewhere, and
never raises. A tuple with one present fallback (``mlp=('fsdp', 'tp')`` on
``('dp', 'tp')``) falls back to it silently, as before.

Defaults: ``Rules.default()`` (``DEFAULT_RULES``) is what ``shard`` uses when neither
it nor the plan has rules. Every value ends in ``None``, so it resolves on any mesh:

* ``heads``, ``kv_heads``, ``mlp``, ``vocab`` -> the tensor-parallel axis, the first of
  the conventional names ``tp``, ``tensor``, ``model`` the mesh has;
* ``batch`` -> the data axes: ``('dp', 'fsdp')`` together, else whichever one exists;
* ``embed`` -> ``fsdp`` where the mesh has it (2-D sharding, FSDP2 over it), else
  replicated.

Worked example, on a mesh with axes ``('dp', 'tp')``:

>>> rules = Rules(batch=('dp',), embed=('fsdp', 'tp'), mlp='tp')
>>> rules.resolve(P('batch', 'embed'), ('dp', 'tp'))   # no 'fsdp': falls back to 'tp'
P('dp', 'tp')
>>> rules.resolve(P('mlp', 'embed'), ('dp', 'tp'))     # 'tp' taken by dim 0: replicate
P('tp', None)
>>> Rules(mlp=('sp', None)).resolve(P('mlp'), ('dp', 'tp'))  # no 'sp': replicate
P(None)
"""

from __future__ import annotations

import difflib
from typing import Iterable, Mapping, Sequence, Union

from .errors import RulesError, RulesTypeError, SpecError
from .spec import P

LOGICAL_AXES = ("batch", "seq", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab",
                "expert", "layers")

# Conventional mesh axis names of the tensor-parallel axis, in the order the defaults try.
TENSOR_AXES = ("tp", "tensor", "model")
# The mesh axis names meshlab's roles and transforms use by convention.
KNOWN_AXES = ("tp", "dp", "pp", "sp", "fsdp", "ep")
# Names of one role: an absent one is suggested by a present one, not by its spelling.
_AXIS_FAMILIES = (TENSOR_AXES + ("mp",), ("dp", "data", "ddp"), ("fsdp",),
                  ("pp", "pipe", "pipeline"), ("sp", "cp", "context", "sequence"),
                  ("ep", "expert"))

RuleValue = Union[None, str, tuple]
# One alternative: the mesh axes that shard the dimension together, major first; the
# empty alternative is a final ``None`` (replicate).
Alternative = tuple


def nearest_axis(name: str, axes: Sequence[str]) -> str | None:
    """The axis of ``axes`` that ``name`` most likely means, or None.

    A conventional name (``model``) suggests a present name of the same role (``tp``);
    any other name the closest spelling (``tpp`` -> ``tp``, ``tq`` -> ``tp``)."""
    family = next((f for f in _AXIS_FAMILIES if name in f), ())
    if family:
        return next((a for a in axes if a in family and a != name), None)
    hits = difflib.get_close_matches(name, [a for a in axes if a != name], n=1, cutoff=0.5)
    return hits[0] if hits else None


def _axis(name: str, value: RuleValue, v: object) -> str:
    """One mesh axis name of rule ``name``'s ``value``: an identifier."""
    if not v.isidentifier():
        raise RulesError(f"rule {name}={value!r}: {v!r} is not a mesh axis name; axis names "
                         f"are identifiers such as 'tp' or 'dp'")
    return v


def _norm_value(name: str, value: RuleValue) -> tuple[Alternative, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return ((_axis(name, value, value),),)
    if isinstance(value, (tuple, list)):
        alts = []
        for i, v in enumerate(value):
            if v is None and i == len(value) - 1:
                alts.append(())
            elif v is None:
                raise RulesError(
                    f"rule {name}={value!r}: None means 'replicate' and ends the fallbacks; "
                    f"put it last, e.g. {name}=('tp', None)")
            elif isinstance(v, str):
                alts.append((_axis(name, value, v),))
            elif isinstance(v, (tuple, list)) and v and all(isinstance(x, str) for x in v):
                alts.append(tuple(_axis(name, value, x) for x in v))
            else:
                raise RulesError(
                    f"rule {name}={value!r}: each fallback must be a mesh axis name, a "
                    f"tuple of names sharding together or a final None, e.g. "
                    f"{name}=('fsdp', ('dp', 'tp'), None)"
                )
        return () if alts == [()] else tuple(alts)
    raise RulesError(f"rule {name}={value!r}: expected None, an axis name or a tuple of them")


def _fmt_value(alts: tuple[Alternative, ...]) -> str:
    if not alts:
        return "None"
    items = [None if not a else (a[0] if len(a) == 1 else a) for a in alts]
    if len(items) == 1 and isinstance(items[0], str):
        return repr(items[0])
    return repr(tuple(items))


def _absent_error(name: str, alts: tuple[Alternative, ...], mesh_axes: tuple[str, ...],
                  where: str) -> RulesError:
    """The rule ``name`` names only axes the mesh lacks: what is missing and the fixes."""
    missing = tuple(dict.fromkeys(a for alt in alts for a in alt if a not in mesh_axes))
    near = [(a, n) for a in missing for n in (nearest_axis(a, mesh_axes),) if n]
    if len(missing) == 1:
        what = f"names mesh axis {missing[0]!r}, which the mesh {mesh_axes} lacks"
        hint = f"; did you mean {near[0][1]!r}?" if near else "."
    else:
        what = (f"has no fallback the mesh {mesh_axes} holds (it lacks "
                f"{', '.join(map(repr, missing))})")
        hint = "; did you mean " + ", ".join(f"{n!r} for {a!r}" for a, n in near) + "?" \
            if near else "."
    return RulesError(
        f"{where}: rule {name}={_fmt_value(alts)} {what}{hint} Fix the axis name or add the "
        f"axis to the mesh; or, to replicate on meshes without it, end the fallbacks with "
        f"None: {name}={_fmt_value(alts + ((),))} (a tuple ending in None never raises)")


def _pairs(pairs) -> list:
    """``Rules``' positional argument as ``[(name, value)]``: a mapping or an iterable of
    pairs."""
    if isinstance(pairs, Mapping):
        return list(pairs.items())
    if isinstance(pairs, (str, bytes)) or not hasattr(pairs, "__iter__"):
        raise RulesError(f"Rules({pairs!r}): give a mapping of logical axis -> mesh axes, "
                         f"pairs, or keywords, e.g. Rules(mlp='tp') or Rules({{'mlp': 'tp'}})")
    out = list(pairs)
    for x in out:
        if not (isinstance(x, (tuple, list)) and len(x) == 2):
            raise RulesError(f"Rules([..., {x!r}, ...]): each pair must be (logical axis, "
                             f"mesh axes), e.g. ('mlp', 'tp')")
    return out


class Rules:
    """An ordered, immutable mapping from logical axis names to mesh-axis fallbacks."""

    __slots__ = ("_table",)

    def __init__(self, pairs: Iterable[tuple[str, RuleValue]] | Mapping[str, RuleValue] = (),
                 /, **rules: RuleValue) -> None:
        items = _pairs(pairs) + list(rules.items())
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
            raise RulesTypeError(f"{self!r} | {other!r}: both sides of | must be Rules; wrap "
                                 f"a mapping first: rules | Rules({other!r})")
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

    def __ror__(self, other: object) -> "Rules":
        raise RulesTypeError(f"{other!r} | {self!r}: both sides of | must be Rules; wrap "
                             f"a mapping first: Rules({other!r}) | rules")

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
        """The ``Rules`` that ``to_json`` wrote: ``[[name, [[axis, ...], ...]], ...]``."""
        if not isinstance(data, list) or not all(
                isinstance(x, list) and len(x) == 2 and isinstance(x[1], list)
                and all(isinstance(a, list) for a in x[1]) for x in data):
            raise RulesError(f"Rules.from_json({data!r}): expected [[logical, [[axis, ...], "
                             f"...]], ...] as Rules.to_json() writes it, e.g. "
                             f"{Rules(mlp='tp').to_json()!r}")
        return cls([(k, tuple(tuple(a) if a else None for a in v) if v else None)
                    for k, v in data])

    @classmethod
    def default(cls) -> "Rules":
        """The rules ``shard`` uses when none are given (``DEFAULT_RULES``, module doc)."""
        return DEFAULT_RULES

    # -- resolution ----------------------------------------------------------------------
    def resolve(self, spec: P, mesh_axes: Sequence[str], *, what: str = "spec") -> P:
        """Map every logical name in ``spec`` to mesh axes of a mesh with ``mesh_axes``.

        Names that are already mesh axes pass through. A name that is neither a rule nor
        a mesh axis raises ``SpecError``, listing both vocabularies; a rule whose every
        fallback names an axis the mesh lacks raises ``RulesError`` (module doc).
        """
        if not isinstance(spec, P):
            raise SpecError(f"{what}: Rules.resolve takes a P(...) spec, got {spec!r}")
        if isinstance(mesh_axes, str) or not all(isinstance(a, str) for a in mesh_axes):
            raise SpecError(f"{what}: mesh_axes must be a sequence of axis names such as "
                            f"('dp', 'tp'), got {mesh_axes!r}")
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
            alts = self._table[name]
            for alt in alts:
                if all(a in mesh_axes for a in alt) and not any(a in used for a in alt):
                    used.update(alt)
                    return alt
            if alts and not any(all(a in mesh_axes for a in alt) for alt in alts):
                raise _absent_error(name, alts, mesh_axes, f"{what} {spec!r}")
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


DEFAULT_RULES = Rules(
    batch=(("dp", "fsdp"), "dp", "fsdp", None),
    heads=TENSOR_AXES + (None,),
    kv_heads=TENSOR_AXES + (None,),
    mlp=TENSOR_AXES + (None,),
    vocab=TENSOR_AXES + (None,),
    embed=("fsdp", None),
)
