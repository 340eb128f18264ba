"""peft, found when first needed (it is the ``lora`` extra), and JSON for its config."""

from __future__ import annotations

import enum

from ...core.errors import ConfigError


def peft_module():
    try:
        import peft
    except ImportError:
        raise ConfigError("lora() needs peft: pip install 'meshlab[lora]' (or pip install "
                          "peft)") from None
    return peft


def jsonable(v):
    """``v`` (a LoraConfig's ``to_dict()``) with sets, tuples and enums as JSON values."""
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (set, frozenset)):
        return sorted(jsonable(x) for x in v)
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, enum.Enum):
        return v.value
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return repr(v)
