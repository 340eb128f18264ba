"""Where a plan's experts are: the experts modules in transformers' common layout, and
where ``expert_route`` places their experts (``ExpertPlacement``, decided in ``bind``)."""

from __future__ import annotations

import dataclasses

from ...core.errors import PlanError
from ...planning.decisions import register_decision
from ...planning.plan import Plan


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """One experts module of the plan: its FQN, expert count and expert parameters."""

    fqn: str
    cls: str
    num_experts: int
    params: tuple[str, ...]

    def to_json(self) -> list:
        return [self.fqn, self.cls, self.num_experts, list(self.params)]

    @classmethod
    def from_json(cls, d: list) -> "ExpertLayout":
        return cls(d[0], d[1], d[2], tuple(d[3]))


@dataclasses.dataclass(frozen=True)
class ExpertPlacement:
    """What ``expert_route`` decided in ``bind``: the experts modules found (``layouts``)
    and how their experts spread over the ``ranks`` ranks of ``axis``: ``per_rank[i]``
    experts of ``layouts[i]`` on each, rank ``r`` holding the ``r``-th run of them."""

    axis: str
    ranks: int
    layouts: tuple[ExpertLayout, ...]
    per_rank: tuple[int, ...]

    def held(self, x: ExpertLayout, rank: int) -> range:
        """The experts of ``x`` (an entry of ``layouts``) the rank at ``rank`` holds."""
        per = self.per_rank[self.layouts.index(x)]
        return range(rank * per, (rank + 1) * per)

    def to_json(self) -> dict:
        return {"axis": self.axis, "ranks": self.ranks,
                "layouts": [x.to_json() for x in self.layouts],
                "per_rank": list(self.per_rank)}

    @classmethod
    def from_json(cls, d: dict) -> "ExpertPlacement":
        return cls(d["axis"], d["ranks"], tuple(ExpertLayout.from_json(x) for x in d["layouts"]),
                   tuple(d["per_rank"]))


register_decision("expert_route.placement", ExpertPlacement)


def place(plan: Plan, axis: str) -> ExpertPlacement:
    """The experts of the bound ``plan`` split evenly over ``axis`` (``bind`` refuses
    counts that do not divide)."""
    n = plan.mesh_shape[axis]
    layouts = tuple(experts_of(plan))
    return ExpertPlacement(axis, n, layouts, tuple(x.num_experts // n for x in layouts))


def placement(plan: Plan, t) -> ExpertPlacement:
    """The placement ``bind`` recorded for ``t`` (an ``expert_route``) in ``plan``."""
    got = plan.decision(ExpertPlacement)
    if got is None:
        raise PlanError(f"{t!r}: this plan records no expert placement; bind the spec that "
                        f"holds {t!r} with plan.bind(mesh) (or meshlab.plan(model, spec, "
                        f"mesh)), which places the experts once")
    return got


def experts_of(plan: Plan) -> list[ExpertLayout]:
    """Every experts module in the common layout (``ExpertsInterface``), from the plan's
    parameters and modules (the plan step reads it; a bound plan records it in its
    ``ExpertPlacement``)."""
    out = []
    by_module: dict[str, list] = {}
    for e in plan.params:
        by_module.setdefault(e.module, []).append(e)
    for m in plan.model.modules:
        ints = dict(m.ints)
        if not ints.get("experts_interface"):
            continue
        n = ints.get("num_experts")
        params = tuple(e.fqn for e in by_module.get(m.fqn, ())
                       if n and len(e.shape) >= 2 and e.shape[0] == n)
        out.append(ExpertLayout(m.fqn, m.cls, n or 0, params))
    return out
