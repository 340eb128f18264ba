"""float8 training of the linear layers, through torchao (``precision('fp8')``).

Which layers run their products in float8 is decided once, from the plan (``Float8Layers``,
recorded in ``plan.decisions``): every ``nn.Linear`` whose two sizes divide by 16 (what
``torch._scaled_mm`` takes), except the output head, which torchao's and torchtitan's
recipes keep in bf16. The install swaps those modules for torchao's ``Float8Linear``
(``convert_to_float8_training`` with the recipe's config); the rest of the model computes
under bf16 autocast. torchao's recipes: ``tensorwise`` (one dynamic scale per tensor) and
``rowwise`` (a scale per row, for inputs and weights, and per column of gradients).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from ...core.errors import ConfigError
from ...core.log import require
from .._install import restore_forward
from ...planning.decisions import register_decision
from ...planning.plan import Plan

RECIPES = ("tensorwise", "rowwise")
_MULTIPLE = 16          # torch._scaled_mm's operands: each size a multiple of 16


@dataclasses.dataclass(frozen=True)
class Float8Layers:
    """The linear layers that compute in float8, and those kept in bf16 with the reason."""

    recipe: str
    layers: tuple[str, ...]
    kept: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> dict:
        return {"recipe": self.recipe, "layers": list(self.layers),
                "kept": [list(k) for k in self.kept]}

    @classmethod
    def from_json(cls, d: dict) -> "Float8Layers":
        return cls(d["recipe"], tuple(d["layers"]), tuple(tuple(k) for k in d["kept"]))


register_decision("precision.float8", Float8Layers)


def choose(plan: Plan, recipe: str) -> Float8Layers:
    """The layers of ``plan``'s model that run in float8 under ``recipe``."""
    layers, kept = [], []
    for m in plan.model.modules:
        if m.kind != "linear" or m.cls != "Linear":
            continue
        sizes = (m.get("in_features"), m.get("out_features"))
        if m.fqn == plan.model.head:
            kept.append((m.fqn, "the output head (torchao's recipes keep it in bf16)"))
        elif any(s is None or s % _MULTIPLE for s in sizes):
            kept.append((m.fqn, f"sizes {sizes[0]} x {sizes[1]}: float8 products take "
                                f"multiples of {_MULTIPLE}"))
        else:
            layers.append(m.fqn)
    return Float8Layers(recipe, tuple(layers), tuple(kept))


def config(recipe: str):
    """torchao's ``Float8LinearConfig`` for ``recipe``."""
    float8 = require("torchao.float8", "fp8", "precision('fp8')")
    return float8.Float8LinearConfig.from_recipe_name(recipe)


def convert(model, chosen: Float8Layers, prefix: str = "") -> int:
    """Swap ``chosen.layers`` of ``model`` (names relative to ``prefix``) for torchao's
    ``Float8Linear``; returns how many were swapped."""
    float8 = require("torchao.float8", "fp8", "precision('fp8')")
    names = set(chosen.layers)
    done = []

    def keep(module, fqn: str) -> bool:
        ok = prefix + fqn in names
        if ok:
            done.append(fqn)
        return ok

    before = dict(model.named_modules())
    float8.convert_to_float8_training(model, config=config(chosen.recipe),
                                      module_filter_fn=keep)
    for fqn in done:                 # the swap builds new modules: the hooks rooms
        _carry_hooks(before[fqn], model.get_submodule(fqn))     # installed go along
    return len(done)


def _hook_dicts(m: nn.Module) -> list[str]:
    """The names of ``m``'s hook registries (forward, backward, state-dict), as torch
    keeps them: instance dicts whose names end in ``hooks``, ``hooks_with_kwargs`` or
    ``hooks_always_called``."""
    return [k for k, v in vars(m).items() if isinstance(v, dict) and
            k.endswith(("_hooks", "_hooks_with_kwargs", "_hooks_always_called"))]


def _carry_hooks(old: nn.Module, new: nn.Module) -> None:
    """Give ``new`` (torchao's ``Float8Linear``, sharing ``old``'s parameters) what rooms
    and the user installed on ``old`` before precision's swap: every hook (forward, as a
    policy's tensor-parallel regions run each module's forward on its local shards through
    them; backward; state-dict) and the attributes rooms set on the instance (their marks).
    A forward replaced on the instance would run on ``old``: refused by name, unless the
    room that replaced it marked how to give it back (``restore_forward``: fuse's query,
    key and value projections computed as one product, whose maps then each run their
    own, in float8)."""
    restore_forward(old)
    if "forward" in vars(old):
        raise ConfigError(f"precision('fp8') would swap {old!r} for torchao's Float8Linear, "
                          f"but its forward was replaced on the instance, which the new "
                          f"module would not run (the layer would silently compute "
                          f"something else); restore the module's own forward, or train "
                          f"with precision('bf16')")
    for name in _hook_dicts(old):
        getattr(new, name).update(getattr(old, name))
    if "_is_full_backward_hook" in vars(old):
        new._is_full_backward_hook = old._is_full_backward_hook
    for k, v in vars(old).items():      # what rooms marked on the instance
        if k not in vars(new):
            setattr(new, k, v)
