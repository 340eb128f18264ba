"""offload: parameters, gradients and optimizer state kept in host memory, by fraction.

The room: ``Offload`` (a plan value naming the fractions), its selection (``_select``:
which tensors, largest first, nested kinds), its checks, its install (``_install``: the
host masters and moments, the CPU AdamW, the copies on their own streams), its memory
rows and the predicted cost of a step (``_estimates``).

* ``optimizer=f``: AdamW's moments and an fp32 master copy (fp64 for fp64 parameters) of the selected parameters
  live in (pinned) host memory and are updated by ``meshlab.ops.CPUAdamW``'s C++ loop;
  the rest by the optimizer the user named, on the device. On one rank under
  ``precision('bf16')`` the device copy of an offloaded parameter is kept in bf16.
* ``grads=f``: the selected gradients leave the device in the backward that reduces
  them (a copy on a side stream as each is ready) and are consumed on the host.
* ``params=f`` (``zero_shard(2)``, ``zero_shard(3)`` or ``data_parallel``): FSDP2 keeps
  the shards of the selected units on the host and copies them in for the forward, and
  again for the backward under ``zero_shard(3)`` (``zero_shard(2)`` keeps them gathered
  from one to the other) (``CPUOffloadPolicy`` per unit). Under ``data_parallel`` FSDP2
  runs with a size-1 shard dimension: the "shard" is the whole parameter, kept gathered
  from the forward to the backward as under ``zero_shard(2)``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ...core.errors import (ConfigError, NotRunnable, PlanError, check_bool, check_choice,
                            check_int, check_number)
from ...planning.plan import Plan
from .._protocol import Phase, Transform
from ._estimates import Profile, StepCost, measure_profile, offload_memory, step_cost
from ._select import Choice, OffloadBudgetError, auto_fractions, choose, parse_bytes

__all__ = ["Offload", "offload", "Choice", "OffloadBudgetError", "Profile", "StepCost",
           "measure_profile"]


def _frac(value, name: str) -> float:
    """A fraction in [0, 1]: bools, strings, NaN and values outside are refused."""
    x = check_number(value, "offload", name, allow_zero=True, example=0.5)
    if x > 1.0:
        raise ConfigError(f"offload({name}={value!r}): {name} is a fraction of the trainable "
                          f"bytes, from 0 to 1; pass e.g. {name}=0.5")
    return x


@dataclasses.dataclass(frozen=True)
class Offload(Transform):
    """Fractions of each kind of training state kept in host memory (see module doc).
    ``policy='auto'`` picks them from ``budget`` (bytes of device memory per rank for
    parameters, gradients and optimizer state)."""

    kind: ClassVar[str] = "offload"
    phase: ClassVar[Phase] = Phase.OFFLOAD

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    pin_memory: bool = True
    policy: str = "static"
    budget: int | None = None
    chunk_elements: int = 64 << 20     # elements per CPU AdamW call: sizes the staging

    def __post_init__(self):
        object.__setattr__(self, "chunk_elements", check_int(
            self.chunk_elements, "offload", "chunk_elements", example=64 << 20))
        for name in ("params", "grads", "optimizer"):
            object.__setattr__(self, name, _frac(getattr(self, name), name))
        object.__setattr__(self, "pin_memory", check_bool(self.pin_memory, "offload",
                                                          "pin_memory"))
        object.__setattr__(self, "policy", check_choice(self.policy, "offload", "policy",
                                                        ("static", "auto")))
        if self.budget is not None:
            object.__setattr__(self, "budget", parse_bytes(self.budget))
        if self.policy == "static":
            if self.budget is not None:
                raise ConfigError(f"offload(budget={self.budget}): a budget is read by "
                                  f"policy='auto'; pass policy='auto' or leave budget out")
            p, g, o = self.params, self.grads, self.optimizer
            if p > g or g > o:
                raise ConfigError(
                    f"offload(params={p}, grads={g}, optimizer={o}): an offloaded parameter "
                    f"is updated on the host, so its gradient and optimizer state are there "
                    f"too, and an offloaded gradient's optimizer state is; give "
                    f"params <= grads <= optimizer, e.g. offload(params={p}, "
                    f"grads={max(p, g)}, optimizer={max(p, g, o)})")
        elif (self.params, self.grads, self.optimizer) != (0.0, 0.0, 0.0):
            raise ConfigError("offload(policy='auto') chooses the fractions itself; pass "
                              "either fractions (policy='static') or a budget, not both")

    # -- what the plan says ---------------------------------------------------------------
    def _zero(self, plan: Plan):
        from ..zero import ZeroShard

        return plan.get(ZeroShard)

    def _dp(self, plan: Plan) -> int:
        sizes = plan.mesh_shape
        z = self._zero(plan)
        n = 1
        for a in (z.axis if z is not None else ()):
            n *= sizes[a]
        return n

    def _stage(self, plan: Plan) -> int:
        z = self._zero(plan)
        return z.stage if z is not None and self._dp(plan) > 1 else 0

    def _compute(self, plan: Plan) -> str:
        from ..precision import Precision

        prec = plan.get(Precision)
        return prec.compute if prec is not None else "float32"

    def cast(self, plan: Plan, choice: Choice) -> frozenset:
        """Offloaded parameters whose device copy is kept in the compute dtype: with one
        data rank (no gradient reduction in that dtype), not sharded by a spec, fp32,
        under a 16-bit ``precision``, outside FSDP2."""
        z = self._zero(plan)
        if self._compute(plan) == "float32" or self._dp(plan) > 1 or \
                (z is not None and (z.stage >= 2 or z.stage == 0 and choice.params)):
            return frozenset()
        return frozenset(e.fqn for e in plan.params
                         if e.fqn in choice.optimizer and e.fqn not in choice.params
                         and e.dtype == "float32" and not e.mesh_spec.axes)

    def choice(self, plan: Plan) -> Choice:
        """Which tensors this offload keeps on the host on ``plan``: what ``bind`` decided
        (``decide``), read from the bound plan."""
        got = plan.decision(Choice)
        if got is None:
            raise PlanError(f"{self!r}: this plan records no offload selection; bind the spec "
                            f"that holds {self!r} with plan.bind(mesh) (or meshlab.plan(model, "
                            f"spec, mesh)), which selects the tensors once")
        return got

    def decide(self, plan: Plan) -> Choice:
        """Which tensors this offload keeps on the host on the bound ``plan``, decided once:
        the static fractions' selection, or (``policy='auto'``) the smallest fractions whose
        device bytes, after the rooms before this one, fit the budget; 'auto' refuses a
        budget nothing fits (``OffloadBudgetError``)."""
        stage = self._stage(plan)
        late = _summed_late(plan)
        if self.policy == "static":
            return choose(plan, (self.params, self.grads, self.optimizer), zero_stage=stage,
                          late=late)
        from ...planning.rows import room_rows

        budget = self.budget if self.budget is not None else _default_budget()
        before = room_rows(plan, until=self)

        def device_bytes(fr) -> int:
            c = choose(plan, fr, zero_stage=stage, late=late)
            rows = offload_memory(c, self.cast(plan, c), self._compute(plan), stage == 1,
                                  before, self.chunk_elements)
            return sum(r.bytes for r in rows if r.where == "device")

        fr, why = auto_fractions(plan, budget, device_bytes, can_grads=self._grads_ok(plan),
                                 can_params=self._params_ok(plan))
        return dataclasses.replace(choose(plan, fr, zero_stage=stage, late=late), auto=why)

    def _grads_ok(self, plan: Plan) -> bool:
        return self._dp(plan) == 1 or self._stage(plan) >= 2

    def _params_ok(self, plan: Plan) -> bool:
        return self._zero(plan) is not None

    # -- the hooks -------------------------------------------------------------------------
    def rows(self, plan: Plan | None) -> tuple[str, ...]:
        """One row per target it keeps a nonzero fraction of on the host
        (``offload(optimizer)``, ``offload(grads)``, ``offload(params)``): the fractions
        given, or those ``policy='auto'`` chose for the bound plan (none before)."""
        if self.policy == "static":
            fr = (self.params, self.grads, self.optimizer)
        elif plan is not None and plan.is_bound and plan.decision(Choice) is not None:
            fr = plan.decision(Choice).fractions
        else:
            return ()
        return tuple(f"offload({k})" for k, f in zip(("params", "grads", "optimizer"), fr)
                     if f > 0)[::-1]

    def check(self, plan: Plan) -> None:
        if not any(e.requires_grad for e in plan.params):
            raise ConfigError(f"{self!r}: the model has no trainable parameters, so there is "
                              f"no gradient or optimizer state to offload; drop offload()")
        if plan.roles.fsdp:
            raise NotRunnable(f"{self!r}: parameter specs that shard over the data axis "
                              f"{plan.roles.fsdp!r} (FSDP by spec) are not yet shown with "
                              f"offload; use zero_shard(3) with unsharded specs (in the "
                              f"composition table offload composes with zero_shard(3) written "
                              f"as a transform; see docs/composition.md)")
        if self.params > 0 and self._zero(plan) is None:
            raise ConfigError(
                f"{self!r}: parameters rest on the host as the shards of FSDP2 units, which "
                f"data_parallel and every zero_shard stage build (on one rank too: "
                f"over a size-1 axis); add one or use params=0 (see docs/composition.md)")

    def memory(self, plan: Plan, rows: list) -> list:
        c = self.choice(plan)
        return offload_memory(c, self.cast(plan, c), self._compute(plan),
                              self._stage(plan) == 1, rows, self.chunk_elements)

    def step_cost(self, plan: Plan, profile: Profile | None = None) -> StepCost:
        """The copies and CPU AdamW work a step adds, and their predicted time from
        ``profile`` (default: the H200 machine's, shipped in ``benchmarks/results``)."""
        from ._estimates import default_profile

        c = self.choice(plan)
        return step_cost(plan, c, self.cast(plan, c), self._compute(plan), self._stage(plan),
                         profile if profile is not None else default_profile())

    def host_seconds(self, plan: Plan) -> float:
        return self.step_cost(plan).seconds or 0.0

    def prepare(self, ctx) -> None:
        """Tell ``zero_shard``'s install what it builds differently (``HostResidency``):
        the FSDP2 units that keep their shards on the host, the ZeRO-1 parameters bucketed
        apart."""
        from ..zero import HostResidency

        c = self.choice(ctx.plan)
        ctx.keep(HostResidency(units=c.units,
                               pinned=self.pin_memory and ctx.mesh.device_type == "cuda",
                               optimizer_host=c.optimizer))

    def install(self, ctx):
        from ._install import install_offload

        return install_offload(self, ctx)

    def __repr__(self) -> str:
        if self.policy == "auto":
            b = "" if self.budget is None else f", budget={self.budget}"
            return f"offload(policy='auto'{b})"
        return (f"offload(params={self.params}, grads={self.grads}, "
                f"optimizer={self.optimizer}, pin_memory={self.pin_memory})")


def _summed_late(plan: Plan) -> frozenset:
    """The parameters whose gradients ``GradSync`` sums after the backward (over a
    sequence, tensor-parallel or expert axis of more than one rank): a gradient copied out
    as the backward makes it would miss that sum, so these leave at the step."""
    from .._gradsync import plan_reductions, routes

    names = [e.fqn for e in plan.params if e.requires_grad]
    return frozenset(routes(plan_reductions(plan), plan.mesh_shape, names))


def _default_budget() -> int:
    """The card's free memory less a margin for activations (a fifth, at least 8 GiB)."""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("offload(policy='auto') without a budget reads the GPU's free "
                          "memory, and this machine has no GPU; pass budget='120GiB' (device "
                          "bytes per rank for parameters, gradients and optimizer state)")
    free, _ = torch.cuda.mem_get_info()
    return int(free - max(8 * 2**30, free // 5))


def offload(params: float = 0.0, grads: float = 0.0, optimizer: float = 0.0, *,
            pin_memory: bool = True, policy: str = "static",
            budget: int | str | None = None, chunk_elements: int = 64 << 20) -> Offload:
    """Keep fractions of the parameters, gradients and optimizer state in host memory.

    Fractions are of each rank's trainable bytes, largest tensors first; an offloaded
    parameter's gradient and optimizer state are offloaded too (``params <= grads <=
    optimizer``). ``policy='auto'`` picks the smallest fractions that fit ``budget``.
    ``chunk_elements`` is how many elements the step's pipeline updates per CPU AdamW
    call (two chunks of staging live in pinned host memory).

    >>> offload(optimizer=1.0)
    offload(params=0.0, grads=0.0, optimizer=1.0, pin_memory=True)
    >>> offload(policy='auto', budget='80GiB')
    offload(policy='auto', budget=85899345920)
    """
    return Offload(params, grads, optimizer, pin_memory, policy, budget, chunk_elements)
