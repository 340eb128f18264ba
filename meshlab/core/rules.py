"""Rules: logical axis names -> mesh axes, as flax's and MaxText's ``logical_axis_rules``.

Model code and policies speak a small closed vocabulary of logical axes (``batch``,
``seq``, ``embed``, ``heads``, ``kv_heads``, ``mlp``, ``vocab``, ``expert``,
``layers``); one ``Rules`` table says which mesh axes each one uses. The table is an
ordered list of ``(logical, mesh axes)`` rules, flax's and MaxText's format, and a spec
resolves exactly as ``flax.linen.logical_to_mesh_axes`` resolves it:

* the rules are tried in order; a rule gives its logical axis's dimension its mesh axes
  when that dimension has none yet and no dimension holds any of those axes already, so
  **rule order decides**, not the order of a spec's dimensions;
* a rule's mesh axes are one axis, several that shard the dimension *together* (a tuple,
  as inside ``P``), or ``None``: the dimension is replicated and later rules for it are
  not tried;
* a logical axis named by several rules has ordered *fallbacks*: the next rule is tried
  when an earlier one's axes are taken.

Two spellings build a table. ``Rules.from_pairs`` takes flax's and MaxText's pairs as they
are written (a tuple is joint sharding, a repeated name a fallback)::

    Rules.from_pairs([('activation_batch', ('data', 'fsdp')),   # P(('data', 'fsdp'))
                      ('embed', 'fsdp'), ('embed', None)])       # fsdp, else replicate

The keyword form gives each logical axis its rules at once, in keyword order:
``None`` (replicate), an axis name, ``joint('dp', 'fsdp')`` (one rule, two axes),
``first('fsdp', 'tp')`` (fallbacks: a rule each), or a tuple ending in ``None``
(``('fsdp', 'tp', None)``: fallbacks, then replicate). A bare tuple of several axes is
refused with a ``RulesError``: flax reads it as joint sharding and older meshlab as
fallbacks, and no spelling here means two things. Inside ``first(...)`` and a
``None``-ended tuple a tuple is one joint alternative, as inside ``P``.

meshlab adds three things to flax's resolution. None of them changes what a spec of the
table's logical axes resolves to on a mesh that has every axis the table names:

* a rule naming an axis the mesh lacks is skipped (flax would put it in the spec, and JAX
  refuse the spec), so one table serves meshes with and without an axis;
* a logical axis whose every rule names an absent axis raises ``RulesError`` when a spec
  uses it: ``Rules(mlp='model')`` on a ``('dp', 'tp')`` mesh is a misspelled or stale
  axis, and replicating instead would silently plan a model that shards nothing. The
  error names the rule, the missing axis, the mesh's axes and the nearest axis name. A
  rule set meant for meshes with and without an axis says so with a final ``None``
  (``mlp=('tp', None)``), which never raises;
* a spec may name mesh axes directly (they pass through and are claimed first, where
  flax would replicate a name without a rule), and a name of the vocabulary above with
  no rule is replicated; any other name that is neither a rule nor a mesh axis raises
  ``SpecError`` (most likely a typo; flax replicates it).

Defaults: ``Rules.default()`` (``DEFAULT_RULES``) is what ``shard`` uses when neither
it nor the plan has rules. Every value ends in ``None``, so it resolves on any mesh:

* ``heads``, ``kv_heads``, ``mlp``, ``vocab`` -> the tensor-parallel axis, the first of
  the conventional names ``tp``, ``tensor``, ``model`` the mesh has;
* ``batch`` -> the data axes: ``('dp', 'fsdp')`` together, else whichever one exists;
* ``embed`` -> ``fsdp`` where the mesh has it (2-D sharding, FSDP2 over it), else
  replicated.

Worked example, on a mesh with axes ``('dp', 'tp')``:

>>> rules = Rules(batch='dp', mlp='tp', embed=first('fsdp', 'tp'))
>>> rules.resolve(P('batch', 'embed'), ('dp', 'tp'))   # no 'fsdp': falls back to 'tp'
P('dp', 'tp')
>>> rules.resolve(P('mlp', 'embed'), ('dp', 'tp'))     # mlp's rule came first: tp is taken
P('tp', None)
>>> Rules(mlp=('sp', None)).resolve(P('mlp'), ('dp', 'tp'))  # no 'sp': replicate
P(None)
>>> Rules.from_pairs([('batch', ('dp', 'tp'))]).resolve(P('batch'), ('dp', 'tp'))
P(('dp', 'tp'))
"""

from __future__ import annotations

import difflib
import keyword
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
# One rule's mesh axes: the axes that shard the dimension together, major first; the
# empty tuple is ``None`` (replicate).
Alternative = tuple


class Joint(tuple):
    """Mesh axes that shard one dimension together, major first: ``joint('dp', 'fsdp')``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "joint(" + ", ".join(map(repr, self)) + ")"


class First(tuple):
    """Ordered fallbacks of one logical axis: ``first('fsdp', 'tp', None)``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "first(" + ", ".join(map(repr, self)) + ")"


def joint(*axes: str) -> Joint:
    """One rule whose mesh axes shard the dimension together, major first, as the tuple
    ``('dp', 'fsdp')`` inside ``P`` does: ``Rules(batch=joint('dp', 'fsdp'))`` resolves
    ``P('batch')`` to ``P(('dp', 'fsdp'))`` on a mesh with both axes.

    >>> Rules(batch=joint('dp', 'fsdp')).resolve(P('batch'), ('dp', 'fsdp'))
    P(('dp', 'fsdp'))
    """
    if not axes or not all(isinstance(a, str) and a.isidentifier() for a in axes):
        raise RulesError(f"joint{axes!r}: give one or more mesh axis names, major first, "
                         f"e.g. joint('dp', 'fsdp')")
    return Joint(axes)


def first(*alternatives) -> First:
    """Ordered fallbacks of one logical axis, a rule each: the first whose axes the mesh
    has and no earlier rule took wins. An alternative is an axis name, ``joint(...)`` (or
    a tuple, as inside ``P``), or a final ``None`` (replicate where none fits, and never
    raise for absent axes).

    >>> Rules(embed=first('fsdp', 'tp')).resolve(P('embed'), ('dp', 'tp'))
    P('tp')
    """
    if not alternatives:
        raise RulesError("first(): give the alternatives in order, e.g. first('fsdp', 'tp', "
                         "None)")
    return First(alternatives)


def nearest_axis(name: str, axes: Sequence[str]) -> str | None:
    """The axis of ``axes`` that ``name`` most likely means, or None.

    A conventional name (``model``) suggests a present name of the same role (``tp``);
    any other name the closest spelling (``tpp`` -> ``tp``, ``tq`` -> ``tp``)."""
    family = next((f for f in _AXIS_FAMILIES if name in f), ())
    if family:
        return next((a for a in axes if a in family and a != name), None)
    hits = difflib.get_close_matches(name, [a for a in axes if a != name], n=1, cutoff=0.5)
    return hits[0] if hits else None


def _axis(name: str, value: object, v: object) -> str:
    """One mesh axis name of rule ``name``'s ``value``: an identifier."""
    if not isinstance(v, str) or not v.isidentifier():
        raise RulesError(f"rule {name}={value!r}: {v!r} is not a mesh axis name; axis names "
                         f"are identifiers such as 'tp' or 'dp'")
    return v


def _logical(name: object) -> str:
    if not isinstance(name, str) or not name.isidentifier():
        raise RulesError(f"logical axis names must be identifiers, got {name!r}")
    return name


def _alternative(name: str, value: object, v: object) -> Alternative:
    """One fallback of rule ``name``: a mesh axis, or a tuple of them sharding together."""
    if isinstance(v, str):
        return (_axis(name, value, v),)
    if isinstance(v, (tuple, list)) and not isinstance(v, First) and v and all(
            isinstance(x, str) for x in v):
        return tuple(_axis(name, value, x) for x in v)
    raise RulesError(
        f"rule {name}={value!r}: each fallback must be a mesh axis name, joint(...) of names "
        f"sharding together or a final None, e.g. {name}=first('fsdp', joint('dp', 'tp'), "
        f"None)")


def _fallbacks(name: str, value: object, items) -> tuple[Alternative, ...]:
    out = []
    for i, v in enumerate(items):
        if v is None and i != len(items) - 1:
            raise RulesError(
                f"rule {name}={value!r}: None means 'replicate' and ends the fallbacks; "
                f"put it last, e.g. {name}=('tp', None)")
        out.append(() if v is None else _alternative(name, value, v))
    return tuple(out)


def _ambiguous(name: str, value: tuple) -> RulesError:
    """A bare tuple of several mesh axes: joint sharding to flax, fallbacks to older
    meshlab; refused with both spellings."""
    items = ", ".join(map(repr, value))
    plain = all(isinstance(v, str) for v in value)
    both = (f"joint sharding, the dimension split over all of them as inside P: "
            f"{name}=joint({items}) (or the nested tuple {name}=({tuple(value)!r},)); "
            if plain else "")
    return RulesError(
        f"rule {name}={value!r}: a tuple of several mesh axes is ambiguous (flax and MaxText "
        f"read it as joint sharding, a list of fallbacks is the other reading); say which: "
        f"{both}ordered fallbacks, the first the mesh has and no earlier rule took: "
        f"{name}=first({items}) (or {name}=({items}, None) to replicate where none fits). "
        f"A flax or MaxText table of (logical, mesh) pairs reads as written with "
        f"Rules.from_pairs([...])")


def _norm_value(name: str, value: RuleValue) -> tuple[Alternative, ...]:
    """The rules of keyword ``name=value``, in order; ``()`` is a replicate rule."""
    if value is None:
        return ((),)
    if isinstance(value, str):
        return ((_axis(name, value, value),),)
    if isinstance(value, Joint):
        return (_alternative(name, value, value),)
    if isinstance(value, First):
        return _fallbacks(name, value, value)
    if isinstance(value, (tuple, list)):
        if not value:                       # (): replicate, as an empty entry of P
            return ((),)
        if len(value) == 1 or value[-1] is None:
            return _fallbacks(name, value, value)
        _fallbacks(name, value, value)      # a malformed entry is named before ambiguity
        raise _ambiguous(name, tuple(value))
    raise RulesError(f"rule {name}={value!r}: expected None, a mesh axis name, joint(...), "
                     f"first(...) or a tuple ending in None, e.g. {name}=('tp', None)")


def _pair_axes(name: str, value: object) -> Alternative:
    """The mesh axes of one ``(logical, mesh)`` pair as flax reads them."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (_axis(name, value, value),)
    if isinstance(value, First):
        raise RulesError(
            f"Rules.from_pairs([..., ({name!r}, {value!r}), ...]): in a table of pairs a "
            f"fallback is a rule of its own: repeat the logical axis, one pair per "
            f"alternative, e.g. [({name!r}, 'fsdp'), ({name!r}, 'tp')]")
    if isinstance(value, (tuple, list)) and all(isinstance(a, str) for a in value):
        return tuple(_axis(name, value, a) for a in value)     # []: replicate, as MaxText's
    raise RulesError(
        f"Rules.from_pairs([..., ({name!r}, {value!r}), ...]): a pair's mesh axes are None, "
        f"an axis name or a tuple of names sharding together, e.g. ({name!r}, ('dp', "
        f"'fsdp'))")


def _fmt_axes(a: Alternative) -> str:
    return "None" if not a else repr(a[0]) if len(a) == 1 else repr(a)


def _fmt_value(alts: tuple[Alternative, ...]) -> str:
    """One logical axis's rules as its keyword value (pastes back into ``Rules(...)``)."""
    if not alts or alts == ((),):
        return "None"
    if len(alts) == 1:
        return _fmt_axes(alts[0]) if len(alts[0]) == 1 else repr((alts[0],))
    items = [None if not a else (a[0] if len(a) == 1 else a) for a in alts]
    if () in alts[:-1]:                     # a from_pairs table: rules after a None
        return "[" + ", ".join(map(_fmt_axes, alts)) + "]"
    if alts[-1] == ():
        return repr(tuple(items))
    return "first(" + ", ".join(map(repr, items)) + ")"


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


def _given_pairs(pairs) -> list:
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


def _grouped(pairs) -> bool:
    """Each logical axis's rules are adjacent and only the last may replicate: the table
    reads back as keywords."""
    seen, last = set(), None
    for i, (n, a) in enumerate(pairs):
        if n != last and n in seen:
            return False
        if not a and i + 1 < len(pairs) and pairs[i + 1][0] == n:
            return False
        seen.add(n)
        last = n
    return not any(keyword.iskeyword(n) for n in seen)


class Rules:
    """An ordered, immutable table of ``(logical axis, mesh axes)`` rules (module doc)."""

    __slots__ = ("_pairs", "_by_name")

    def __init__(self, pairs: Iterable[tuple[str, RuleValue]] | Mapping[str, RuleValue] = (),
                 /, **rules: RuleValue) -> None:
        table: dict[str, tuple[Alternative, ...]] = {}
        for name, value in _given_pairs(pairs) + list(rules.items()):
            alts = _norm_value(_logical(name), value)
            if name in table and table[name] != alts:
                raise RulesError(
                    f"logical axis {name!r} is given twice with different values: "
                    f"{_fmt_value(table[name])} and {_fmt_value(alts)}; keep one (for "
                    f"fallbacks write {name}=first(...); a flax or MaxText table that "
                    f"repeats a name as fallbacks reads as written with Rules.from_pairs)")
            table[name] = alts
        self._set(tuple((n, a) for n, alts in table.items() for a in alts))

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[str, object]]) -> "Rules":
        """flax's and MaxText's ``logical_axis_rules``, as written: ``(logical, mesh)``
        pairs in priority order, where the mesh axes are ``None`` (replicate), an axis
        name, or a tuple (or list) of names that shard the dimension together, and a
        logical axis named again is a fallback tried when an earlier rule's axes are
        taken. Resolves as ``flax.linen.logical_to_mesh_axes`` does (module doc).

        >>> rules = Rules.from_pairs([('activation_batch', ('data', 'fsdp')),
        ...                           ('embed', 'fsdp'), ('embed', 'tensor'), ('mlp', 'tensor')])
        >>> rules.resolve(P('activation_batch', 'embed'), ('data', 'fsdp', 'tensor'))
        P(('data', 'fsdp'), 'tensor')
        """
        if isinstance(pairs, (str, bytes, Mapping)) or not hasattr(pairs, "__iter__"):
            raise RulesError(f"Rules.from_pairs({pairs!r}): give a sequence of (logical, mesh "
                             f"axes) pairs, e.g. [('batch', ('data', 'fsdp')), ('embed', "
                             f"'fsdp'), ('embed', None)]")
        out = []
        for x in pairs:
            if not (isinstance(x, (tuple, list)) and len(x) == 2):
                raise RulesError(f"Rules.from_pairs([..., {x!r}, ...]): each rule is a "
                                 f"(logical axis, mesh axes) pair, e.g. ('mlp', 'tensor')")
            out.append((_logical(x[0]), _pair_axes(x[0], x[1])))
        return cls._of(tuple(out))

    @classmethod
    def _of(cls, pairs: tuple) -> "Rules":
        out = cls.__new__(cls)
        out._set(pairs)
        return out

    def _set(self, pairs: tuple) -> None:
        by_name: dict[str, tuple[Alternative, ...]] = {}
        for n, a in pairs:
            by_name[n] = by_name.get(n, ()) + (a,)
        object.__setattr__(self, "_pairs", pairs)
        object.__setattr__(self, "_by_name", by_name)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("Rules are immutable; compose with `|` to extend them")

    @property
    def pairs(self) -> tuple[tuple[str, Alternative], ...]:
        """The table as flax writes it: ``(logical, mesh axes)`` in priority order, the
        mesh axes a tuple (``()`` for ``None``)."""
        return self._pairs

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __iter__(self):
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str) -> tuple[Alternative, ...] | None:
        """``name``'s alternatives in order (``()`` when it only replicates), or None."""
        alts = self._by_name.get(name)
        return () if alts == ((),) else alts

    def items(self):
        return [(n, self.get(n)) for n in self._by_name]

    def __or__(self, other: "Rules") -> "Rules":
        """Union of two rule sets, the left one's rules first; a logical axis mapped
        differently by each raises."""
        if not isinstance(other, Rules):
            raise RulesTypeError(f"{self!r} | {other!r}: both sides of | must be Rules; wrap "
                                 f"a mapping first: rules | Rules({other!r})")
        for name, alts in other._by_name.items():
            mine = self._by_name.get(name)
            if mine is not None and mine != alts:
                raise RulesError(
                    f"cannot compose rules: {name!r} maps to {_fmt_value(mine)} in the first "
                    f"and {_fmt_value(alts)} in the second; drop it from one side"
                )
        return Rules._of(self._pairs + tuple(
            (n, a) for n, a in other._pairs if n not in self._by_name))

    def __ror__(self, other: object) -> "Rules":
        raise RulesTypeError(f"{other!r} | {self!r}: both sides of | must be Rules; wrap "
                             f"a mapping first: Rules({other!r}) | rules")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Rules) and self._pairs == other._pairs

    def __hash__(self) -> int:
        return hash(self._pairs)

    def __repr__(self) -> str:
        if _grouped(self._pairs):
            return "Rules(" + ", ".join(f"{k}={_fmt_value(v)}"
                                        for k, v in self._by_name.items()) + ")"
        return "Rules.from_pairs([" + ", ".join(
            f"({k!r}, {_fmt_axes(a)})" for k, a in self._pairs) + "])"

    def to_json(self) -> list:
        """``[[logical, [axis, ...]], ...]``: the pairs, ``[]`` for ``None``."""
        return [[k, list(a)] for k, a in self._pairs]

    @classmethod
    def from_json(cls, data: list) -> "Rules":
        """The ``Rules`` that ``to_json`` wrote (also the older per-name form,
        ``[[logical, [[axis, ...], ...]], ...]``)."""
        def names(v):
            return isinstance(v, list) and all(isinstance(a, str) for a in v)

        if not isinstance(data, list) or not all(
                isinstance(x, list) and len(x) == 2 and isinstance(x[0], str)
                and (names(x[1]) or isinstance(x[1], list) and all(map(names, x[1])))
                for x in data):
            raise RulesError(f"Rules.from_json({data!r}): expected [[logical, [axis, ...]], "
                             f"...] as Rules.to_json() writes it, e.g. "
                             f"{Rules(mlp='tp').to_json()!r}")
        pairs = []
        for k, v in data:
            pairs += [(k, v)] if names(v) else [(k, a) for a in v]
        return cls.from_pairs(pairs)

    @classmethod
    def default(cls) -> "Rules":
        """The rules ``shard`` uses when none are given (``DEFAULT_RULES``, module doc)."""
        return DEFAULT_RULES

    # -- resolution ----------------------------------------------------------------------
    def resolve(self, spec: P, mesh_axes: Sequence[str], *, what: str = "spec") -> P:
        """Map every logical name in ``spec`` to mesh axes of a mesh with ``mesh_axes``,
        as ``flax.linen.logical_to_mesh_axes`` does: rule order decides (module doc).

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
        entries = [() if e is None else ((e,) if isinstance(e, str) else e) for e in spec]
        names = [n for e in entries for n in e] + list(spec.partial)
        got = self._assign(names, mesh_axes, spec, what)

        def axes_of(n: str) -> tuple[str, ...]:
            return got.get(n, ()) if n in self._by_name else (n,) if n in mesh_axes else ()

        dims = []
        for e in entries:
            axes = tuple(a for n in e for a in axes_of(n))
            dims.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
        partial = tuple(a for n in spec.partial for a in axes_of(n))
        return P(*dims, partial=partial or None)

    def _assign(self, names: list, mesh_axes: tuple, spec: P, what: str) -> dict:
        """The mesh axes each logical name of a spec gets: flax's loop over the rules."""
        # Mesh axes named directly are claimed first so a logical rule cannot take them.
        used = {n for n in names if n not in self._by_name and n in mesh_axes}
        for n in names:
            if n in self._by_name:
                alts = self._by_name[n]
                if not any(all(a in mesh_axes for a in alt) for alt in alts):
                    raise _absent_error(n, alts, mesh_axes, f"{what} {spec!r}")
            elif n not in mesh_axes and n not in LOGICAL_AXES:
                raise SpecError(
                    f"{what}: {spec!r} names {n!r}, which is neither a mesh axis "
                    f"{mesh_axes} nor a logical axis of {self!r}; add a rule such as "
                    f"Rules({n}='tp') or use a mesh axis")
        wanted, got = set(names), {}
        for name, axes in self._pairs:
            # a dimension takes the first rule whose axes the mesh has and no dimension
            # holds yet; a None rule (no axes) claims it unsharded
            if name in wanted and name not in got and all(a in mesh_axes for a in axes) \
                    and not used.intersection(axes):
                got[name] = axes
                used.update(axes)
        return got


def resolve(spec: P, mesh_axes: Sequence[str], rules: Rules | None, *, what: str = "spec") -> P:
    """Resolve ``spec`` with ``rules`` (or check it names only mesh axes when None)."""
    return (rules or Rules()).resolve(spec, mesh_axes, what=what)


DEFAULT_RULES = Rules(
    batch=first(joint("dp", "fsdp"), "dp", "fsdp", None),
    heads=first(*TENSOR_AXES, None),
    kv_heads=first(*TENSOR_AXES, None),
    mlp=first(*TENSOR_AXES, None),
    vocab=first(*TENSOR_AXES, None),
    embed=first("fsdp", None),
)
