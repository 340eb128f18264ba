"""Binding a plan's tables to a mesh (``Plan.bind``): each parameter's spec resolved
through the rules, checked against its shape (even shards, whole attention heads) and
tagged; each activation boundary's specs resolved. Alike entries bind once per mesh, and a
mesh that binds a table as one before gets the same bound table back."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping

from ..core.errors import SpecError
from ..core.placement import check_spec, mesh_repr, uneven_dims
from ..core.rules import Rules
from ..core.spec import P

# The entries bound (``ParamEntry``, ``ActivationEntry``) and ``ModelInfo`` are
# ``meshlab.planning.plan``'s, named in the annotations only: plan imports this module.


def _spec_key(spec: P) -> tuple:
    """A spec as written, entry by entry (``P('tp') == P('tp', None)``, yet they resolve
    to specs of different lengths)."""
    return tuple(spec), spec.partial, spec.partial_op


# The last few tables bound: (the table, what its specs bound to, the bound table). A mesh
# on which every spec binds as on one before gets that bound table again, the same value
# (its entries are immutable), so what is computed from a bound table and cached by it
# (``shard``'s TP layout) is computed once for every mesh that lays the table out alike.
_BOUND_PARAMS: list = []
_BOUND_ACTIVATIONS: list = []


def _remember(recent: list, table, got: dict, build: Callable):
    """The bound table of ``table`` whose specs bound to ``got``: the one kept in
    ``recent`` if it has it, else ``build()``, kept."""
    for t, seen, bound in recent:
        if t is table and seen == got:
            return bound
    bound = build()
    recent.insert(0, (table, got, bound))
    del recent[4:]
    return bound


def bind_params(params, rules: Rules, axes, sizes, model: ModelInfo,
                 uneven: bool) -> tuple[ParamEntry, ...]:
    """Every entry bound (``_bind_entry``). What binding gives an entry (its mesh spec and
    added tags) follows from its spec, shape and tags alone, its name entering only the
    messages, so the repeated blocks' alike entries are bound once per mesh."""
    keys = [(_spec_key(e.spec), e.shape, e.tags) for e in params]
    done: dict = {}                 # (spec, shape, tags) -> (mesh spec, tags)
    for e, key in zip(params, keys):
        if key not in done:
            b = _bind_entry(e, rules, axes, sizes, model, uneven)
            done[key] = (b.mesh_spec, b.tags)
    return _remember(
        _BOUND_PARAMS, params, {k: (_spec_key(ms), tags) for k, (ms, tags) in done.items()},
        lambda: tuple(dataclasses.replace(e, mesh_spec=done[k][0], tags=done[k][1])
                      for e, k in zip(params, keys)))


def bind_activations(acts, rules: Rules, axes) -> tuple[ActivationEntry, ...]:
    """Every activation boundary's specs resolved on the mesh, each spec once."""
    done: dict = {}                 # spec -> its mesh spec
    for a in acts:
        for spec in (a.output, a.input):
            if spec is not None and _spec_key(spec) not in done:
                done[_spec_key(spec)] = rules.resolve(spec, axes, what=a.module)

    def bound(spec: P | None) -> P | None:
        return None if spec is None else done[_spec_key(spec)]

    return _remember(
        _BOUND_ACTIVATIONS, acts, {k: _spec_key(ms) for k, ms in done.items()},
        lambda: tuple(dataclasses.replace(a, output=bound(a.output), input=bound(a.input))
                      for a in acts))


def _bind_entry(e: ParamEntry, rules: Rules, axes, sizes, model: ModelInfo,
                uneven: bool) -> ParamEntry:
    ms = rules.resolve(e.spec, axes, what=f"{e.fqn} {e.shape}")
    check_spec(ms, e.shape, axes, what=e.fqn, mesh_repr=mesh_repr(sizes))
    if not uneven:
        for d, k in uneven_dims(e.shape, ms, sizes):
            via = ms.dim_axes(d)
            logical = e.spec.dim_axes(d) if d < len(e.spec) else ()
            if logical == ("vocab",):
                # Vocab-parallel embedding and loss handle a short last shard
                # exactly (masked lookup, parallel softmax): no padding needed.
                continue
            fix_axis = f"map {logical[0]!r} to another axis in Rules" if logical and \
                logical != via else "shard that dim over other axes"
            raise SpecError(
                f"{e.fqn} {e.shape}: {e.spec!r} shards dim {d} over "
                f"{' x '.join(f'{a!r} (size {sizes[a]})' for a in via)}, but "
                f"{e.shape[d]} % {k} != 0; change the mesh, {fix_axis}, or allow "
                f"uneven shards with meshlab.plan(..., uneven=True) / "
                f"meshlab.parallelize(..., uneven=True)"
            )
    ms, extra = _split_heads(e, ms, sizes, model)
    return dataclasses.replace(e, mesh_spec=ms, tags=tuple(dict.fromkeys(e.tags + extra)))


_HEAD_COUNTS = {"heads": ("num_attention_heads", "n_head"),
                "kv_heads": ("num_key_value_heads", "num_attention_heads", "n_head")}


def _split_heads(e: ParamEntry, ms: P, sizes: Mapping[str, int], model: ModelInfo):
    """Attention heads are split whole. K/V heads fewer than their shards are replicated
    (each rank then keeps the K/V heads its query heads use); query heads must divide."""
    extra: tuple[str, ...] = ()
    for d in range(min(len(e.spec), len(e.shape))):
        logical = e.spec.dim_axes(d)
        if len(logical) != 1 or logical[0] not in _HEAD_COUNTS:
            continue
        count = next((model.config_get(k) for k in _HEAD_COUNTS[logical[0]]
                      if model.config_get(k)), None)
        axes = ms.dim_axes(d)
        k = math.prod(sizes[a] for a in axes) if axes else 1
        if count is None or k == 1 or count % k == 0:
            continue
        if logical[0] == "kv_heads":
            dims = list(ms) + [None] * (len(e.shape) - len(ms))
            dims[d] = None
            ms = P(*dims, partial=ms.partial or None).normalized()
            extra += ("kv_replicated",)
        else:
            raise SpecError(
                f"{e.fqn} {e.shape}: {e.spec!r} splits {count} attention heads over "
                f"{' x '.join(axes)} = {k} shards; heads are split whole, so {count} % {k} "
                f"must be 0. Choose a tensor-parallel size that divides {count}"
            )
    return ms, extra

