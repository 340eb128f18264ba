"""The policy registry, keyed on ``config.model_type``, and ``auto``."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ..core.errors import PolicyError
from ._policy import ModuleRule, Policy

_REGISTRY: dict[str, Policy] = {}


def register(model_type: str, policy: Policy) -> Policy:
    """Register ``policy`` for models whose ``config.model_type`` is ``model_type``."""
    _REGISTRY[model_type] = policy
    return policy


def registered() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


class _Auto:
    """``policies.auto``: the policy for the model's ``config.model_type``."""

    def __repr__(self) -> str:
        return "policies.auto"


auto = _Auto()


def from_hf_tp_plan(model_type: str, tp_plan: dict[str, str]) -> Policy:
    """Translate a Hugging Face ``base_model_tp_plan`` into a policy (on top of the
    shared decoder defaults: vocab-parallel embedding and LM head, sharded norms)."""
    from ._decoder import DECODER

    if any("experts" in g.split(".") for g in tp_plan):
        return _moe(model_type, tp_plan)
    rules = tuple(ModuleRule(glob, style) for glob, style in tp_plan.items())
    return DECODER + Policy(name=model_type, modules=rules)


def _moe(model_type: str, tp_plan: dict[str, str]) -> Policy:
    """A mixture-of-experts plan: attention and the dense MLPs (shared experts) sharded
    as the plan says; the experts themselves, which ``expert_route`` shards over its own
    axis, and the router are replicated over the tensor-parallel axis, every rank running
    them on the same tokens. The MoE block is then no tensor-parallel region; each shared
    expert is one, and so is the MLP of each dense layer."""
    from ._decoder import DECODER

    # attention is a region only where the plan shards it (DeepSeek's MLA it leaves whole)
    rules, dense = [], []
    regions = ["layers.*.self_attn"] if any(g.startswith("layers.*.self_attn.")
                                            for g in tp_plan) else []
    for glob, style in tp_plan.items():
        parts = glob.split(".")
        if "experts" in parts:
            continue
        rules.append(ModuleRule(glob, style))
        parent = ".".join(parts[:-1])
        if parent.startswith("layers.*.mlp.") and parent not in regions:
            regions.append(parent)              # a shared expert
        elif parent == "layers.*.mlp" and parent not in dense:
            dense.append(parent)                # the dense layers' MLP (not the MoE blocks)
    # Under Megatron sequence parallelism the MoE block runs on this rank's share of the
    # sequence: the router and the experts (replicated over tp) see part of the tokens, so
    # their gradients are summed over tp, as the norms' are
    moe = tuple(f"layers.*.{b}.{m}" for b in ("mlp", "block_sparse_moe")
                for m in ("gate", "router", "experts"))
    base = dataclasses.replace(DECODER, regions=tuple(regions), dense_regions=tuple(dense),
                               optional=DECODER.optional + tuple(regions),
                               sequence_parallel=DECODER.sequence_parallel + moe)
    return base + Policy(name=model_type, modules=tuple(rules), optional=tuple(
        r.glob for r in rules if r.glob.startswith("layers.*.mlp.")))


def get(model_type: str, tp_plan: dict[str, str] | None = None) -> Policy:
    """The policy for ``model_type``: registered, else translated from ``tp_plan``."""
    if model_type in _REGISTRY:
        return _REGISTRY[model_type]
    if tp_plan:
        return from_hf_tp_plan(model_type, tp_plan)
    raise PolicyError(
        f"no sharding policy for model_type {model_type!r}: it is not registered "
        f"({', '.join(registered())}) and its config carries no base_model_tp_plan. Pass "
        f"specs instead: shard({{'layers.*.mlp.up_proj.weight': P('mlp', 'embed'), ...}}), or "
        f"meshlab.policies.register({model_type!r}, Policy(...)) before plan/parallelize "
        f"(docs/policies.md, 'Remote-code models')"
    )


def resolve_policy(specs: Any, plan) -> Policy | None:
    """``specs`` as a Policy when it is one (or ``auto``); None for plain specs."""
    if isinstance(specs, Policy):
        return specs
    if isinstance(specs, _Auto):
        mt = plan.model.model_type
        if mt is None:
            raise PolicyError(
                f"policies.auto needs a Hugging Face model (a config with model_type); "
                f"{plan.model.cls or 'this model'} has none. Pass specs to shard(...) instead"
            )
        if mt in _REGISTRY:            # hand-written, with parity tests of its own
            return _REGISTRY[mt]
        if plan.model.tp_plan:          # translated: only what the family walk trained
            from ._support import require_trained

            require_trained(mt)
        return get(mt, dict(plan.model.tp_plan))
    if isinstance(specs, str):
        return get(specs)
    return None
