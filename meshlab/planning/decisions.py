"""The registry of what rooms decide at bind time: each decision type (a frozen value a
room's ``Transform.decide`` returns) is registered under a name, as transform options
are, so that a bound plan's ``decisions`` travel through its JSON."""

from __future__ import annotations

from typing import Any, Mapping

from ..core.errors import PlanError

# A decision type has ``to_json()`` and a ``from_json(d)`` classmethod; JSON names it by
# the name it was registered under.
_DECISION_TYPES: dict[str, type] = {}
_DECISION_NAMES: dict[type, str] = {}


def register_decision(name: str, cls: type) -> None:
    """Make ``cls`` (a room's decision type) writable to and readable from plan JSON under
    ``name``; one name per type."""
    known = _DECISION_TYPES.get(name)
    # the same type again (its module reloaded) takes the name over; another type may not
    if known is not None and known.__qualname__ != cls.__qualname__:
        raise PlanError(f"register_decision({name!r}, {cls.__qualname__}): the name is taken "
                        f"by {known.__qualname__}; register the decision under another name")
    _DECISION_TYPES[name] = cls
    _DECISION_NAMES[cls] = name


def decision_to_json(d: Any) -> dict:
    """``{'kind': its registered name, 'value': d.to_json()}``."""
    name = _DECISION_NAMES.get(type(d))
    if name is None:
        raise PlanError(f"the plan holds a decision of type {type(d).__qualname__} that is not "
                        f"registered; call register_decision(name, {type(d).__qualname__}) "
                        f"where the type is defined")
    return {"kind": name, "value": d.to_json()}


def decision_from_json(d: Mapping) -> Any:
    """The decision ``decision_to_json`` wrote."""
    cls = _DECISION_TYPES.get(d.get("kind"))
    if cls is None:
        raise PlanError(f"the plan records a decision of kind {d.get('kind')!r} that is not "
                        f"defined here (known: {sorted(_DECISION_TYPES)}); import the module "
                        f"of the transform that makes it first")
    return cls.from_json(d["value"])
