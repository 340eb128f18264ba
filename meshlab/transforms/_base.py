"""The transform protocol: a frozen value with one method, ``Plan -> Plan``; ``|`` composes."""

from __future__ import annotations

import dataclasses

from .._plan import Plan


class Transform:
    """Base of every transform. Subclasses are frozen dataclasses implementing ``apply``."""

    def apply(self, plan: Plan) -> Plan:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement apply(plan) -> plan")

    def __call__(self, plan: Plan) -> Plan:
        if not isinstance(plan, Plan):
            raise TypeError(f"{self!r} takes a Plan, got {type(plan).__name__}; build one with "
                            f"meshlab.plan(model, spec, mesh) or meshlab.trace(model)")
        out = self.apply(plan)
        return dataclasses.replace(out, transforms=out.transforms + (repr(self),))

    def __or__(self, other: "Transform") -> "Compose":
        if not isinstance(other, Transform):
            return NotImplemented
        return Compose(_flat(self) + _flat(other))

    @property
    def parts(self) -> tuple["Transform", ...]:
        return (self,)


def _flat(t: Transform) -> tuple[Transform, ...]:
    return t.transforms if isinstance(t, Compose) else (t,)


@dataclasses.dataclass(frozen=True)
class Compose(Transform):
    """``t1 | t2 | ...``: apply left to right."""

    transforms: tuple[Transform, ...]

    def __call__(self, plan: Plan) -> Plan:
        for t in self.transforms:
            plan = t(plan)
        return plan

    def apply(self, plan: Plan) -> Plan:
        return self(plan)

    @property
    def parts(self) -> tuple[Transform, ...]:
        return self.transforms

    def __repr__(self) -> str:
        return " | ".join(repr(t) for t in self.transforms)


@dataclasses.dataclass(frozen=True)
class Identity(Transform):
    """The transform that changes nothing (a neutral element for ``|``)."""

    def apply(self, plan: Plan) -> Plan:
        return plan

    def __repr__(self) -> str:
        return "identity()"
