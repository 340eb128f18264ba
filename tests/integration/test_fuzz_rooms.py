"""The fuzz of ``test_fuzz.py`` over the constructors added since: ``offload``, ``lora``,
``expert_route``, the inference engine's ``InferenceConfig`` and every Booster plugin. For
arbitrary values of one argument (ints negative and zero, bools, floats, NaN, strings,
None, lists, dicts) each raises a ``meshlab.MeshlabError`` subclass or accepts the value;
never an untyped exception. An accepted numeric value is in the argument's range (no NaN
or negative fraction accepted silently)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

import meshlab as ml
from tests.integration.test_fuzz import FUZZ, VALUES, _typed


def _finite_or_absent(v) -> bool:
    return not (isinstance(v, float) and not math.isfinite(v))


ROOMS = {
    "offload": (ml.offload, ("params", "grads", "optimizer", "pin_memory", "policy", "budget",
                             "chunk_elements")),
    "lora": (ml.lora, ("r", "lora_alpha", "lora_dropout", "target_modules", "bias",
                       "use_dora", "modules_to_save")),
    "expert_route": (ml.expert_route, ("axis", "capacity_factor", "dispatch")),
}
# arguments a constructor needs before any other is read: each fuzzed argument is checked
# beside valid others (lora with named targets: the fuzz reads each argument beside them)
BASE = {"lora": {"target_modules": ["q_proj", "v_proj"]}}


@pytest.mark.parametrize("name", sorted(ROOMS))
@FUZZ
@given(data=st.data())
def test_room_constructors_raise_only_typed_errors(name, data):
    import inspect

    fn, args = ROOMS[name]
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    arg = data.draw(st.sampled_from([a for a in args if a in params or takes_any]),
                    label="arg")
    value = data.draw(VALUES, label=arg)
    t = _typed(fn, **{**BASE.get(name, {}), arg: value})
    if t is not None and isinstance(value, float) and not math.isfinite(value):
        pytest.fail(f"{name}({arg}={value!r}) accepted a non-finite number: {t!r}")
    if name == "lora" and t is not None:
        c = t.config
        assert type(c.r) is int and c.r > 0 and math.isfinite(c.lora_alpha) and \
            0 <= c.lora_dropout < 1, (arg, value, c)
        assert c.bias == "none" and c.use_dora is False, (arg, value, c)
        assert c.target_modules is None or (isinstance(c.target_modules, str) and
                                            c.target_modules) or (
            c.target_modules and all(isinstance(m, str) and m for m in c.target_modules)), \
            (arg, value, c.target_modules)     # None: peft's defaults for the model type
        assert c.modules_to_save is None or all(isinstance(m, str) and m
                                                for m in c.modules_to_save), (arg, value)


@pytest.mark.parametrize("arg, value", [
    ("r", 0), ("r", -1), ("r", 1.5), ("r", True), ("lora_alpha", math.nan),
    ("lora_dropout", 1.0), ("target_modules", 5), ("target_modules", [1]),
    ("target_modules", [""]), ("target_modules", []), ("target_modules", {"q_proj": 1}),
    ("bias", "x"), ("bias", 0),
    ("use_dora", 1), ("use_dora", "no"), ("modules_to_save", "lm_head"),
    ("modules_to_save", [None]), ("task_type", "x"), ("no_such_option", 1),
])
def test_lora_refuses_each_bad_argument_beside_valid_targets(arg, value):
    with pytest.raises(ml.ConfigError, match=arg if arg != "no_such_option" else "LoraConfig"):
        ml.lora(**{"target_modules": ["q_proj", "v_proj"], arg: value})


def _config_fields():
    from meshlab.inference import InferenceConfig

    return [f.name for f in dataclasses.fields(InferenceConfig) if f.init]


@FUZZ
@given(data=st.data())
def test_inference_config_raises_only_typed_errors(data):
    from meshlab.inference import InferenceConfig

    field = data.draw(st.sampled_from(_config_fields()), label="field")
    value = data.draw(VALUES, label=field)
    cfg = _typed(InferenceConfig, **{field: value})
    if cfg is not None and isinstance(value, float) and not math.isfinite(value):
        pytest.fail(f"InferenceConfig({field}={value!r}) accepted a non-finite number")


def _plugins():
    from meshlab.booster.plugin import PLUGINS

    return {c.__name__: c for c in PLUGINS}


@pytest.mark.parametrize("plugin", sorted(_plugins()))
@FUZZ
@given(data=st.data())
def test_plugins_raise_only_typed_errors(plugin, data):
    import warnings

    cls = _plugins()[plugin]
    arg = data.draw(st.sampled_from([a.name for a in cls.ARGS]), label="arg")
    value = data.draw(VALUES, label=arg)
    base = {"tp_size": 1, "pp_size": 1} if "Hybrid" in plugin else {}
    if plugin == "MoeHybridParallelPlugin":
        base["ep_size"] = 2
    base[arg] = value
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = _typed(cls, **base)
    if p is not None and isinstance(value, float) and not math.isfinite(value):
        pytest.fail(f"{plugin}({arg}={value!r}) accepted a non-finite number")


@pytest.mark.parametrize("kw", [dict(offload_optim_frac=-1), dict(offload_param_frac=-0.5),
                                dict(offload_optim_frac=1.5), dict(offload_optim_frac=math.nan),
                                dict(offload_optim_frac="0.5")])
def test_gemini_fractions_outside_zero_to_one_are_refused(kw):
    """offload_optim_frac=-1 became max(-1, offload_param_frac) = 0: no offload, silently."""
    from meshlab.booster.plugin import GeminiPlugin

    with pytest.raises(ml.ConfigError, match=next(iter(kw))):
        GeminiPlugin(**kw)
