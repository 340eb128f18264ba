"""peft, found when first needed (it is the ``lora`` extra), JSON for its config, and the
target modules peft picks where a config names none."""

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


def with_targets(config, model_type: str | None):
    """``config`` with the target modules peft picks for ``model_type`` where it names none
    (peft's own table, as ``get_peft_model`` fills it in), else ``config`` itself; a model
    type peft has no defaults for is refused by name."""
    if config.target_modules:
        return config
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as TABLE

    if model_type not in TABLE:
        raise ConfigError(f"lora: the LoraConfig names no target_modules and peft has no "
                          f"defaults for model type {model_type!r}; name some, e.g. "
                          f"target_modules=['q_proj', 'v_proj']")
    import copy

    out = copy.copy(config)
    out.target_modules = set(TABLE[model_type])
    return out
