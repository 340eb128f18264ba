"""expert_route: expert parallelism for Hugging Face mixture-of-experts models.

The room: ``ExpertRoute`` (claims the ``ep`` role), the layout it finds in the plan
(every experts module in transformers' common layout: 3-D ``gate_up_proj [E, 2I, H]`` /
``down_proj [E, H, I]`` weights behind ``ExpertsInterface``), its checks, its install
(the expert weights become DTensors sharded on their expert dimension over ``ep``; the
experts' implementation becomes the dispatching one of ``_dispatch``), its gradient
reductions (the dense weights are averaged over ``ep``: its ranks read different tokens)
and its estimates (expert bytes per rank, all-to-all volume, expected load).

The router, its auxiliary loss and shared experts are the family's own code and dense
parameters; nothing of a family's forward is copied.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from ...core.errors import ConfigError, NotRunnable, check_choice, check_name, check_number
from ...planning.plan import Plan
from ...core.spec import P
from .._gradsync import Reduction
from .._protocol import CommOp, Phase, Transform
from ._layout import ExpertLayout, ExpertPlacement, experts_of, place, placement

__all__ = ["ExpertRoute", "ExpertLayout", "ExpertLoad", "ExpertPlacement", "expert_route",
           "experts_of"]


# Families whose expert-parallel training is shown equal to one process (tests/
# test_expert_gloo.py). Others in the common layout are refused until shown: PhiMoE, for
# one, routes with random draws in training, which no second run reproduces.
SHOWN = frozenset({"mixtral", "qwen2_moe", "deepseek_v3", "qwen3_moe", "olmoe", "granitemoe",
                   "glm4_moe", "gpt_oss"})


@dataclasses.dataclass(frozen=True)
class ExpertRoute(Transform):
    """Experts sharded on their expert dimension over ``axis``; tokens dispatched to the
    ranks that hold their experts and combined back (see the module doc)."""

    kind: ClassVar[str] = "expert_route"
    phase: ClassVar[Phase] = Phase.EXPERTS

    axis: str = "ep"
    capacity_factor: float | None = None
    dispatch: str = "all_to_all"

    def __post_init__(self):
        object.__setattr__(self, "axis", check_name(self.axis, "expert_route", "axis",
                                                    example="ep"))
        if self.capacity_factor is not None:
            object.__setattr__(self, "capacity_factor", check_number(
                self.capacity_factor, "expert_route", "capacity_factor", example=1.25))
        object.__setattr__(self, "dispatch", check_choice(self.dispatch, "expert_route",
                                                          "dispatch", ("all_to_all",)))

    def claims(self, plan: Plan):
        return {"ep": (self.axis,)}

    def decide(self, plan: Plan) -> ExpertPlacement:
        """Where the experts go, once: the experts modules found and the run of experts
        each rank of ``axis`` holds (``_layout.place``)."""
        return place(plan, self.axis)

    def apply(self, plan: Plan) -> Plan:
        names = {f for x in experts_of(plan) for f in x.params}
        params = tuple(dataclasses.replace(e, spec=P(self.axis, *([None] * (len(e.shape) - 1))))
                       if e.fqn in names else e for e in plan.params)
        return plan.replace(params=params)

    def check(self, plan: Plan) -> None:
        layouts = placement(plan, self).layouts
        if self.axis not in plan.mesh_shape:
            raise ConfigError(f"{self!r}: {self.axis!r} is not a mesh axis "
                              f"{tuple(plan.mesh_shape)}; add it, e.g. Mesh(ep=2)")
        if not layouts:
            raise ConfigError(
                f"{self!r}: {plan.model.cls or 'the model'} has no experts module in the "
                f"common layout (transformers' ExpertsInterface: 3-D gate_up_proj/down_proj "
                f"weights behind @use_experts_implementation); expert_route shards those only")
        mt = plan.model.model_type
        if mt not in SHOWN:
            raise NotRunnable(f"{self!r} on {mt!r}: its experts follow the common layout, but "
                              f"training with them split over {self.axis!r} is not yet shown to "
                              f"match one process (shown: {', '.join(sorted(SHOWN))})")
        n = plan.mesh_shape[self.axis]
        for x in layouts:
            if not x.params or not any(p.endswith(("gate_up_proj", "up_proj")) for p in x.params) \
                    or not any(p.endswith("down_proj") for p in x.params):
                raise ConfigError(
                    f"{x.fqn} ({x.cls}): its experts differ from the common layout (expected "
                    f"3-D gate_up_proj or up_proj and down_proj with {x.num_experts} experts "
                    f"on dim 0; found {list(x.params) or 'none'}); expert_route cannot shard "
                    f"them")
            if x.num_experts % n:
                raise ConfigError(f"{x.fqn}: {x.num_experts} experts do not divide over "
                                  f"{self.axis}={n}; use an {self.axis} size that divides "
                                  f"{x.num_experts}")

    def prepare(self, ctx) -> None:
        from ._install import check_model

        check_model(self, ctx)

    def install(self, ctx):
        from ._install import install_experts

        return install_experts(self, ctx)

    def reductions(self, plan: Plan) -> list:
        """The dense weights are averaged over ``axis`` (its ranks read different
        tokens); the experts' gradients are complete where they live (scaled by 1/n in
        the forward)."""
        experts = {f for x in placement(plan, self).layouts for f in x.params}
        dense = frozenset(e.fqn for e in plan.params if e.requires_grad and
                          e.fqn not in experts and e.tied_to is None)
        return [Reduction((self.axis,), average=True, names=dense, order=5)]

    def comm(self, plan: Plan, *, batch, seq, coord):
        """Per MoE layer and step: one all-to-all of the counts, and the rows out and back
        in the forward and again in the backward; a uniform router sends ``(n-1)/n`` of
        the ``tokens * k`` rows away (rows in the experts' dtype)."""
        from ...core.units import dtype_bytes

        where = placement(plan, self)
        n, layouts = where.ranks, where.layouts
        if n == 1 or batch is None or not layouts:
            return []
        k = plan.model.config_get("num_experts_per_tok") or 1
        hidden = plan.model.config_get("hidden_size") or 0
        tokens = batch * (seq or 1)
        per = tokens * k * (n - 1) / n * hidden * dtype_bytes(plan[layouts[0].params[0]].dtype)
        layers = len(layouts)
        # per layer: the counts (E int64s), then the rows there and back, each way again
        # in the backward
        return [CommOp("all_to_all", self.axis, layers,
                       layers * 8 * (layouts[0].num_experts if layers else 0)),
                CommOp("all_to_all", self.axis, 4 * layers, int(4 * layers * per))]

    def load(self, plan: Plan, *, batch: int, seq: int) -> "ExpertLoad":
        """What each rank holds and moves per step for ``batch`` sequences of ``seq``
        tokens per rank, with a uniform router (every expert equally likely)."""
        from ...core.units import dtype_bytes
        from ...core.placement import local_shape

        where = placement(plan, self)
        n, layouts = where.ranks, where.layouts
        k = plan.model.config_get("num_experts_per_tok") or 1
        hidden = plan.model.config_get("hidden_size") or 0
        pairs = batch * seq * k
        sizes = plan.mesh_shape
        held = sum(math.prod(local_shape(plan[f].shape, plan[f].mesh_spec, sizes)) *
                   dtype_bytes(plan[f].dtype) for x in layouts for f in x.params)
        elem = dtype_bytes(plan[layouts[0].params[0]].dtype) if layouts else 4
        if self.capacity_factor is None:
            away = pairs * (n - 1) / n
        else:
            from ._dispatch import capacity

            E = layouts[0].num_experts if layouts else 1
            away = capacity(self.capacity_factor, pairs, E) * E * (n - 1) / n
        return ExpertLoad(
            layers=len(layouts), experts=layouts[0].num_experts if layouts else 0,
            per_rank=where.per_rank[0] if layouts else 0, expert_bytes=held,
            pairs=pairs, received=pairs, away=int(away),
            all_to_all_bytes=int(4 * len(layouts) * away * hidden * elem))

    def __repr__(self) -> str:
        cap = "" if self.capacity_factor is None else f", capacity_factor={self.capacity_factor}"
        return f"expert_route(axis={self.axis!r}{cap})"


@dataclasses.dataclass(frozen=True)
class ExpertLoad:
    """Per rank and step under a uniform router: MoE layers, experts per layer and per
    rank, bytes of expert weights held, (token, expert) pairs routed per layer, pairs
    received per layer (as many as routed, on average), rows sent to other ranks per
    layer, and all-to-all bytes (there and back, forward and backward, every layer)."""

    layers: int
    experts: int
    per_rank: int
    expert_bytes: int
    pairs: int
    received: int
    away: int
    all_to_all_bytes: int

    def rows(self) -> list[tuple[str, str]]:
        from ...core.units import fmt_bytes

        return [("MoE layers", str(self.layers)),
                ("experts per layer / per rank", f"{self.experts} / {self.per_rank}"),
                ("expert weights held", fmt_bytes(self.expert_bytes)),
                ("pairs routed per layer", f"{self.pairs:,}"),
                ("pairs received per layer (uniform router)", f"{self.received:,}"),
                ("rows sent to other ranks per layer", f"{self.away:,}"),
                ("all-to-all bytes per step", fmt_bytes(self.all_to_all_bytes))]

    def __str__(self) -> str:
        w = max(len(k) for k, _ in self.rows())
        return "\n".join(f"{k:<{w}}  {v}" for k, v in self.rows())


def expert_route(axis: str = "ep", capacity_factor: float | None = None,
                 dispatch: str = "all_to_all") -> ExpertRoute:
    """Expert parallelism over ``axis`` for a Hugging Face MoE model.

    Dropless by default; ``capacity_factor`` keeps at most ``ceil(factor * tokens * k /
    E)`` pairs per expert from each rank and counts the rest as dropped.

    >>> expert_route('ep')
    expert_route(axis='ep')
    """
    return ExpertRoute(axis, capacity_factor, dispatch)
