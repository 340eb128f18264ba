"""shard: lay parameters (and activation boundaries) out by specs or a model policy."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from .._errors import PlanError
from .._plan import ActivationEntry, Plan
from .._rules import Rules
from .._spec import P
from .._specs_tree import glob_match, match_specs, normalize_specs
from ._base import Transform


@dataclasses.dataclass(frozen=True)
class Shard(Transform):
    """Tensor (and Megatron sequence) parallel layout from specs or a policy.

    ``specs`` is a dict of FQN globs -> ``P`` (first match wins), a pytree of ``P``
    mirroring the module tree, a ``Policy``, or ``meshlab.policies.auto`` (the policy
    registered for the model's ``config.model_type``). ``rules`` map the logical names
    the specs use to mesh axes; they join the plan's rules (a disagreement raises).
    ``activations`` maps module globs to the spec of their output.
    """

    specs: Any
    rules: Rules | None = None
    activations: tuple[tuple[str, P], ...] = ()

    def apply(self, plan: Plan) -> Plan:
        from ..policies import resolve_policy

        rules = plan.rules
        if self.rules is not None:
            rules = self.rules if rules is None else rules | self.rules
        policy = resolve_policy(self.specs, plan)
        if policy is not None:
            param_specs, tags, acts = policy.param_specs(plan), policy.tags(plan), \
                policy.activation_specs(plan)
            mod_tags = policy.module_tags(plan)
            source = f"policy {policy.name!r}"
        else:
            param_specs, tags, acts, mod_tags = normalize_specs(self.specs), {}, {}, {}
            source = "shard specs"
        acts = {**acts, **dict(self.activations)}
        hits = match_specs(param_specs, plan.fqns, what=source)
        out = []
        for e in plan.params:
            hit = hits.get(e.fqn)
            if hit is None:
                extra = tags.get(e.fqn, ())
                out.append(dataclasses.replace(e, tags=tuple(dict.fromkeys(e.tags + extra)))
                           if extra else e)
                continue
            _, spec = hit
            if e.tied_to is not None:
                # A tied parameter is one tensor: it keeps the layout of its first name.
                canon = plan[e.tied_to]
                new_spec = hits.get(canon.fqn, (None, canon.spec))[1]
                if new_spec != spec:
                    raise PlanError(
                        f"{e.fqn} is tied to {e.tied_to}, but {source} gives them different "
                        f"specs ({spec!r} vs {new_spec!r}); give both the same spec"
                    )
            if e.spec != P() and e.spec != spec:
                raise PlanError(
                    f"{e.fqn} {e.shape}: already laid out as {e.spec!r} by an earlier transform; "
                    f"{source} now asks for {spec!r}. Two transforms cannot claim one tensor; "
                    f"drop one of them"
                )
            out.append(dataclasses.replace(e, spec=spec, tags=tuple(dict.fromkeys(
                e.tags + tags.get(e.fqn, ())))))
        act_entries = {a.module: a for a in plan.activations}
        modules = _module_names(plan)
        for glob, spec in acts.items():
            matched = [m for m in modules if glob_match(glob, m)]
            if not matched:
                raise PlanError(f"{source}: activation glob {glob!r} matches no module; fix the "
                                f"name or remove it")
            for m in matched:
                prev = act_entries.get(m, ActivationEntry(module=m))
                act_entries[m] = dataclasses.replace(prev, output=spec)
        for glob, mtags in mod_tags.items():
            matched = [m for m in modules if glob_match(glob, m)]
            if not matched:
                raise PlanError(f"{source}: module glob {glob!r} matches no module; the policy "
                                f"does not fit {plan.model.cls or 'this model'}")
            for m in matched:
                prev = act_entries.get(m, ActivationEntry(module=m))
                act_entries[m] = dataclasses.replace(
                    prev, tags=tuple(dict.fromkeys(prev.tags + mtags)))
        return dataclasses.replace(plan, params=tuple(out), rules=rules,
                                   activations=tuple(act_entries.values()))

    def __repr__(self) -> str:
        from ..policies import Policy, _Auto

        if isinstance(self.specs, (_Auto, Policy)):
            s = repr(self.specs)
        elif isinstance(self.specs, Mapping):
            s = "{" + ", ".join(f"{k!r}: {v!r}" for k, v in list(self.specs.items())[:4]) + \
                (", ..." if len(self.specs) > 4 else "") + "}"
        else:
            s = f"<{type(self.specs).__name__} spec tree>"
        r = f", {self.rules!r}" if self.rules is not None else ""
        return f"shard({s}{r})"


def _module_names(plan: Plan) -> list[str]:
    mods = dict.fromkeys(m for e in plan.params for m in _prefixes(e.module))
    mods.update(dict.fromkeys(a.module for a in plan.activations))
    mods.update(dict.fromkeys(plan.model.blocks))
    return list(mods)


def _prefixes(module: str):
    parts = module.split(".") if module else []
    for i in range(1, len(parts) + 1):
        yield ".".join(parts[:i])


def shard(specs: Any, rules: Rules | None = None, *,
          activations: Mapping[str, P] | None = None) -> Shard:
    """Lay parameters out by ``specs`` (globs, a spec pytree, or a policy) and ``rules``.

    >>> shard({'layers.*.mlp.up_proj.weight': P('mlp', 'embed')}, Rules(mlp='tp'))
    shard({'layers.*.mlp.up_proj.weight': P('mlp', 'embed')}, Rules(mlp='tp'))
    """
    if rules is not None and not isinstance(rules, Rules):
        rules = Rules(rules)
    from ..policies import Policy, _Auto

    if not isinstance(specs, (Policy, _Auto, str)):
        specs = _Frozen(normalize_specs(specs))  # one spelling from here on: FQN globs
    return Shard(specs=specs, rules=rules,
                 activations=tuple((activations or {}).items()))


class _Frozen(dict):
    """A dict that hashes (so the frozen transform that holds it does) and refuses edits."""

    def __hash__(self):
        return hash(tuple(self.items()))

    def _ro(self, *a, **k):
        raise TypeError("specs held by a transform are immutable")

    __setitem__ = __delitem__ = update = pop = popitem = setdefault = clear = _ro
