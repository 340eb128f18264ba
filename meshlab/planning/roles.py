"""Axis roles: which mesh axis carries tensor, data, pipeline or sequence parallelism.

Derived once, in ``Plan.bind``, from what the transforms claim (``claims``), what the
parameter specs shard and what the batch maps to in the rules; read by the layout, the
estimates, ``dataloader`` and the runtime (process groups are found by axis name).

* ``dp``: the axes gradients are averaged over — those ``zero_shard``/``data_parallel``
  claim, else the axes the logical ``batch`` maps to;
* ``fsdp``: the ``dp`` axes that parameter specs also shard (``P('fsdp', 'tp')``, the
  JAX way of writing 2-D sharding): FSDP2 over them, on the dimension the spec names;
* ``tp``: the one other axis parameter specs shard (tensor parallelism);
* ``pp``, ``sp``, ``ep`` (``expert_route``: tokens split over it like ``dp``, expert
  weights sharded over it) and any role a transform outside meshlab claims, as claimed.

An axis of size > 1 with no role is a layout a plan may describe (JAX replicates over
it) but not one meshlab trains on: nothing would keep its ranks' data apart or their
updates together. ``bind`` records it in ``plan.not_runnable`` (the table shows it) and
``parallelize`` refuses it before any collective.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

from ..core.errors import ConfigError
from ..core.spec import P

# ``Plan`` in annotations is meshlab.planning.plan.Plan, which imports this module.

_BUILTIN = ("tp", "dp", "pp", "sp")


@dataclasses.dataclass(frozen=True, slots=True)
class AxisRoles:
    """The role of every used mesh axis (see the module docstring)."""

    tp: str | None = None
    dp: tuple[str, ...] = ()
    fsdp: tuple[str, ...] = ()
    pp: str | None = None
    sp: str | None = None
    other: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def replicated(self, sizes: Mapping[str, int]) -> tuple[str, ...]:
        """Axes of size > 1 with no role: every rank along them computes the same."""
        return tuple(a for a, s in sizes.items() if s > 1 and a not in self.used)

    def axes(self, role: str) -> tuple[str, ...]:
        """The axes of ``role`` (empty if no axis has it)."""
        if role in ("tp", "pp", "sp"):
            a = getattr(self, role)
            return () if a is None else (a,)
        if role in ("dp", "fsdp"):
            return getattr(self, role)
        return dict(self.other).get(role, ())

    @property
    def data(self) -> tuple[str, ...]:
        """The axes whose ranks read different batches: ``dp`` and ``expert_route``'s
        ``ep`` (tokens are split over it too; the experts are exchanged there)."""
        return self.dp + tuple(a for a in self.axes("ep") if a not in self.dp)

    @property
    def used(self) -> tuple[str, ...]:
        out = self.axes("tp") + self.dp + self.axes("pp") + self.axes("sp")
        return tuple(dict.fromkeys(out + tuple(a for _, ax in self.other for a in ax)))

    def to_json(self) -> dict:
        return {"tp": self.tp, "dp": list(self.dp), "fsdp": list(self.fsdp), "pp": self.pp,
                "sp": self.sp, "other": [[r, list(a)] for r, a in self.other]}

    @classmethod
    def from_json(cls, d: Mapping) -> "AxisRoles":
        return cls(d["tp"], tuple(d["dp"]), tuple(d["fsdp"]), d["pp"], d["sp"],
                   tuple((r, tuple(a)) for r, a in d["other"]))


# Rooms a bound plan runs without being asked: plain data parallelism when the batch maps
# to an axis, tensor parallelism when specs shard one. Filled by the rooms themselves.
_IMPLIED: list[Callable[["Plan", AxisRoles], object | None]] = []


def block_sequence_axes(plan: "Plan") -> tuple[str, ...]:
    """The mesh axes the repeated blocks' outputs are split over on the sequence dimension
    (Megatron sequence parallelism: the activation specs ``shard`` lays out), read from the
    first block's output; the ranks along them hold other tokens of the same rows."""
    first = plan.model.blocks[0] if plan.model.blocks else None
    for a in plan.activations:
        if a.module == first and a.output is not None and len(a.output) > 1:
            return tuple(a.output.dim_axes(1))
    return ()


def implied_room(fn: Callable[["Plan", AxisRoles], object | None]):
    """Register ``fn(bound_plan, roles) -> transform | None``, asked in every ``bind``."""
    _IMPLIED.append(fn)
    return fn


def implied_rooms(plan: "Plan", roles: AxisRoles) -> tuple:
    return tuple(t for t in (fn(plan, roles) for fn in _IMPLIED) if t is not None)


def _claims(plan: "Plan", sizes: Mapping[str, int]) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    owner: dict[str, str] = {}
    for t in plan.options:
        for role, axes in t.claims(plan).items():
            for a in axes:
                if a not in sizes:
                    raise ConfigError(f"{t!r}: {a!r} is not a mesh axis {tuple(sizes)}; use one "
                                      f"of those")
                if owner.get(a, repr(t)) != repr(t):
                    raise ConfigError(f"mesh axis {a!r} is claimed by {owner[a]} and by {t!r}; "
                                      f"each transform needs its own mesh axis")
                owner[a] = repr(t)
            if role in out and out[role] != tuple(axes):
                raise ConfigError(f"role {role!r} is claimed twice ({out[role]} and "
                                  f"{tuple(axes)}); keep one transform of that kind")
            out[role] = tuple(axes)
    return out


_TP_LOGICAL = ("heads", "kv_heads", "mlp", "vocab")


def _tp_votes(plan: "Plan", axes: tuple[str, ...]) -> dict[str, int]:
    """How many parameter dimensions of the heads, MLP or vocabulary each axis shards."""
    votes = dict.fromkeys(axes, 0)
    for e in plan.params:
        for d in range(min(len(e.spec), len(e.mesh_spec or P()))):
            if set(e.spec.dim_axes(d)) & set(_TP_LOGICAL):
                for a in e.mesh_spec.dim_axes(d):
                    if a in votes:
                        votes[a] += 1
    return votes


def derive_roles(plan: "Plan", sizes: Mapping[str, int]) -> AxisRoles:
    """The roles of a plan whose parameter specs are resolved to mesh axes (model-free)."""
    claims = _claims(plan, sizes)
    claimed = {a for axes in claims.values() for a in axes}
    sharded = tuple(a for a in sizes if sizes[a] > 1 and any(
        a in (e.mesh_spec or P()).axes for e in plan.params))
    if "dp" in claims:
        dp = claims["dp"]
    else:
        batch = (plan.rules.resolve(P("batch"), tuple(sizes)) if plan.rules else P()).dim_axes(0)
        dp = tuple(a for a in batch if a not in claimed)
    # Axes expert_route claims shard the experts' weights, not tensor parallel ones.
    tp = tuple(a for a in sharded if a not in dp and a not in claims.get("ep", ()))
    if len(tp) > 1 and "dp" not in claims:
        # Parameters sharded over several axes no data maps to: the one sharding heads,
        # MLP or vocabulary is tensor parallel; the others shard like FSDP — data axes
        # whose ranks may see the same batch, so the gradient average stays exact.
        votes = _tp_votes(plan, tp)
        if sum(1 for v in votes.values() if v) <= 1:
            keep = max(tp, key=lambda a: (votes[a], tp.index(a)))
            dp = dp + tuple(a for a in tp if a != keep)
            tp = (keep,)
    fsdp = tuple(a for a in dp if a in sharded)
    if len(tp) > 1:
        raise ConfigError(
            f"parameters are sharded over several mesh axes {sorted(tp)} that carry no data: "
            f"meshlab runs tensor parallelism over one axis. Map the logical axes of the others "
            f"to None in Rules, or shard over them with zero_shard(3, axis=...)")
    roles = AxisRoles(
        tp=tp[0] if tp else None, dp=dp, fsdp=fsdp,
        pp=(claims.get("pp") or (None,))[0], sp=(claims.get("sp") or (None,))[0],
        other=tuple((r, a) for r, a in claims.items() if r not in _BUILTIN))
    if roles.tp is not None and roles.tp in claimed:
        who = next(r for r, axes in claims.items() if roles.tp in axes)
        raise ConfigError(f"axis {roles.tp!r} both shards parameters (tensor parallel) and "
                          f"carries {who!r}; give them different mesh axes")
    return roles
