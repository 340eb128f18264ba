"""Where a plan's experts are: the experts modules in transformers' common layout."""

from __future__ import annotations

import dataclasses

from ...planning.plan import Plan


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """One experts module of the plan: its FQN, expert count and expert parameters."""

    fqn: str
    cls: str
    num_experts: int
    params: tuple[str, ...]


def experts_of(plan: Plan) -> list[ExpertLayout]:
    """Every experts module in the common layout (``ExpertsInterface``), from the plan."""
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
