"""shard: lay parameters (and activation boundaries) out by specs or a model policy, and
run the tensor (and Megatron sequence) parallelism that layout means.

The room: ``Shard`` (the plan step: specs and tags per parameter), its check (the TP
layout of ``_layout``, model-free), its install (parameters become DTensors as their
modules are initialized; the styles' hooks; ``_tp``), its gradient sync (replicated
parameters that saw partial activations are summed over tp) and its traffic estimate.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping

from ...core.errors import ConfigError, PlanError, RulesError, SpecError
from ...planning.plan import ActivationEntry, Plan
from ...planning.roles import implied_room
from ...core.rules import DEFAULT_RULES, Rules
from ...core.spec import P
from ...core.specs_tree import glob_match, match_specs, normalize_specs
from .._install import shared_module
from .._gradsync import Reduction
from .._protocol import Part, Phase, Transform
from ._layout import sequence_parallel as sequence_parallel, tp_layout as tp_layout
from ._loss import install_generate, install_loss
from ._styles import TPGroup, VocabHead
from . import _dtensor
from . import _rng, _tp


@dataclasses.dataclass(frozen=True)
class Shard(Transform):
    """Tensor (and Megatron sequence) parallel layout from specs or a policy.

    ``specs`` is a dict of FQN globs -> ``P`` (first match wins), a pytree of ``P``
    mirroring the module tree, a ``Policy``, or ``meshlab.policies.auto`` (the policy
    registered for the model's ``config.model_type``). ``rules`` map the logical names
    the specs use to mesh axes; they join the plan's rules (a disagreement raises). With
    no rules here and none in the plan, ``Rules.default()`` applies (``shard``'s doc) and
    the plan's transforms say so.
    ``activations`` maps module globs to the spec of their output.
    """

    kind: ClassVar[str] = "shard"
    repeatable: ClassVar[bool] = True      # shard(policy) | shard({extra specs})
    in_table: ClassVar[bool] = True        # its effect is the parameter table (diff)
    phase: ClassVar[Phase] = Phase.SHARD

    specs: Any
    rules: Rules | None = None
    activations: tuple[tuple[str, P], ...] = ()

    # -- the plan step --------------------------------------------------------------------
    def __call__(self, plan: Plan) -> Plan:
        """The plan step; where the default rules applied, the recorded transform names
        them, so the plan's table shows which rules laid the parameters out."""
        out = super().__call__(plan)
        if _uses_default_rules(self, plan):
            out = out.replace(transforms=out.transforms[:-1] + (
                f"{out.transforms[-1]} with default {DEFAULT_RULES!r}",))
        return out

    def apply(self, plan: Plan) -> Plan:
        from ...policies import resolve_policy

        rules = _join_rules(plan.rules, self.rules)
        if _uses_default_rules(self, plan):
            rules = DEFAULT_RULES
        policy = resolve_policy(self.specs, plan)
        if policy is not None:
            param_specs, tags, acts = policy.param_specs(plan), policy.tags(plan), \
                policy.activation_specs(plan)
            mod_tags, attrs = policy.module_tags(plan), policy.module_attrs(plan)
            source = f"policy {policy.name!r}"
        else:
            param_specs, tags, acts, mod_tags, attrs = normalize_specs(self.specs), {}, {}, {}, {}
            source = "shard specs"
        acts = {**acts, **dict(self.activations)}
        params = _lay_out(plan, param_specs, tags, source)
        act_entries = _activations(plan, acts, mod_tags, attrs, source)
        return dataclasses.replace(plan, params=params, rules=rules, activations=act_entries)

    # -- bind, install, sync, estimates ---------------------------------------------------
    def rows(self, plan: Plan | None) -> tuple[str, ...]:
        """``shard`` where its specs shard over a tensor-parallel axis, and
        ``sequence('split_gather')`` where the rules map the sequence to that axis too
        (Megatron SP); the value alone names ``shard``."""
        if plan is None:
            return ("shard",)
        tp = plan.roles.tp
        if tp is None:
            return ()
        return ("shard",) + (("sequence('split_gather')",) if sequence_parallel(plan, tp)
                             else ())

    def check(self, plan: Plan) -> None:
        _refuse_shared_split(plan)
        layout, _ = tp_layout(plan, 0)
        compiled = any(t.kind == "compile" for t in plan.rooms)
        if compiled and layout is not None and not layout.dtensor \
                and plan.source is not None and _rng.drops(plan.source):
            raise ConfigError(
                "compile_blocks() with a policy's tensor-parallel regions in a model that "
                "drops (a dropout probability above 0): each region switches dropout to "
                "this rank's random stream by reading and setting the generator's state, "
                "which a compiled block cannot trace; set the model's dropout "
                "probabilities to 0, leave compile_blocks() out, or shard by specs alone "
                "(no policy regions)")

    def prepare(self, ctx) -> None:
        if ctx.roles.tp is not None:
            ctx.keep(_Setup(ctx))

    def install(self, ctx) -> Part | None:
        setup = ctx.kept(_Setup)
        return setup.finish(ctx) if setup is not None else None

    def reductions(self, plan: Plan) -> list:
        """Replicated parameters that see only this rank's share of the activations
        (sequence-parallel norms, K/V replicated over tp) have their gradients summed
        over tp. DTensor mode needs none: DTensor's autograd reduces them itself."""
        if plan.roles.tp is None or next(t for t in plan.rooms if isinstance(t, Shard)) != self:
            return []
        layout, reduce = tp_layout(plan, 0)
        if layout is None or layout.dtensor or not reduce:
            return []
        return [Reduction((plan.roles.tp,), average=False, names=frozenset(reduce), order=0)]

    def activation_memory(self, plan: Plan, rows: list, *, batch: int, seq: int) -> list:
        from ._saved import tp_activations

        return tp_activations(plan, rows)

    def work_share(self, plan: Plan, parts: dict) -> dict:
        """Each TP rank does 1/n of the blocks' matmuls and attention; the elementwise work
        of the residual stream is split only under sequence parallelism."""
        axis = plan.roles.tp
        n = plan.mesh_shape[axis] if axis else 1
        if n == 1:
            return parts
        sp = sequence_parallel(plan, axis)
        b = parts["blocks"]
        out = dict(parts)
        out["blocks"] = dataclasses.replace(b, flops=b.flops // n, attn=b.attn // n,
                                            attn_narrow=b.attn_narrow // n,
                                            attn_kv=b.attn_kv // n,
                                            attn_kv_narrow=b.attn_kv_narrow // n,
                                            bytes=b.bytes // n if sp else
                                            int(b.bytes * (1 + 1 / n) / 2))
        r = parts["rest"]
        out["rest"] = dataclasses.replace(r, flops=r.flops // n)
        return out

    def comm(self, plan: Plan, *, batch, seq, coord):
        from ._comm import tp_comm

        return tp_comm(plan, batch, seq, coord)

    # -- JSON -----------------------------------------------------------------------------
    def to_json(self) -> dict:
        from ...policies import Policy, _Auto

        if isinstance(self.specs, _Auto):
            specs = {"policy": "auto"}
        elif isinstance(self.specs, Policy):
            specs = {"policy": self.specs.name}
        else:
            specs = {"globs": [[k, v.to_json()] for k, v in self.specs.items()]}
        return {"kind": self.kind, "specs": specs,
                "rules": None if self.rules is None else self.rules.to_json(),
                "activations": [[g, p.to_json()] for g, p in self.activations]}

    @classmethod
    def from_json(cls, d: Mapping) -> "Shard":
        from ... import policies

        sp = d["specs"]
        if "policy" in sp:
            specs = policies.auto if sp["policy"] == "auto" else policies.get(sp["policy"])
        else:
            specs = _Frozen({k: P.from_json(v) for k, v in sp["globs"]})
        return cls(specs, None if d["rules"] is None else Rules.from_json(d["rules"]),
                   tuple((g, P.from_json(p)) for g, p in d["activations"]))

    def __repr__(self) -> str:
        from ...policies import Policy, _Auto

        if isinstance(self.specs, (_Auto, Policy)):
            s = repr(self.specs)
        elif isinstance(self.specs, Mapping):
            s = "{" + ", ".join(f"{k!r}: {v!r}" for k, v in list(self.specs.items())[:4]) + \
                (", ..." if len(self.specs) > 4 else "") + "}"
        else:
            s = f"<{type(self.specs).__name__} spec tree>"
        r = f", {self.rules!r}" if self.rules is not None else ""
        return f"shard({s}{r})"


def _uses_default_rules(t: Shard, plan: Plan) -> bool:
    """Neither ``t`` nor the plan it applies to has rules: ``DEFAULT_RULES`` apply."""
    return t.rules is None and plan.rules is None


def _join_rules(have: Rules | None, mine: Rules | None) -> Rules | None:
    """The plan's rules joined with a shard's; a conflict with the defaults an earlier
    shard took says where they came from."""
    if mine is None or have is None:
        return mine if have is None else have
    try:
        return have | mine
    except RulesError as e:
        if have != DEFAULT_RULES:
            raise
        raise RulesError(f"{e}. The first side is Rules.default(), which an earlier shard "
                         f"without rules took; pass the rules you want to that first shard "
                         f"(explicit rules replace the defaults)") from None


def _lay_out(plan: Plan, param_specs, tags, source: str) -> tuple:
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
    return tuple(out)


def _activations(plan: Plan, acts, mod_tags, attrs, source: str) -> tuple:
    entries = {a.module: a for a in plan.activations}
    modules = _module_names(plan)

    unfit = f"the policy does not fit {plan.model.cls or 'this model'}"

    def each(glob: str, what: str, fix: str):
        matched = [m for m in modules if glob_match(glob, m)]
        if not matched:
            raise PlanError(f"{source}: {what} glob {glob!r} matches no module; {fix}")
        return [(m, entries.get(m, ActivationEntry(module=m))) for m in matched]

    for glob, spec in acts.items():
        for m, prev in each(glob, "activation", "fix the name or remove it"):
            entries[m] = dataclasses.replace(prev, output=spec)
    for glob, mtags in mod_tags.items():
        for m, prev in each(glob, "module", unfit):
            entries[m] = dataclasses.replace(prev, tags=tuple(dict.fromkeys(prev.tags + mtags)))
    # a module holding no parameters may reshape by a global size too (an attention core)
    modules = list(dict.fromkeys(modules + [m.fqn for m in plan.model.modules if m.fqn]))
    for glob, names in attrs.items():
        for m, prev in each(glob, "module", unfit):
            entries[m] = dataclasses.replace(
                prev, local_attrs=tuple(dict.fromkeys(prev.local_attrs + names)))
    return tuple(entries.values())


class _Setup:
    """Tensor parallelism during one materialize: modules are sharded as soon as their
    block is initialized (a parent's init may still rewrite its children, as GPT-2 rescales
    c_proj from the block); tied parameters wait for the end (the model ties them after
    initialization)."""

    def __init__(self, ctx):
        axis = ctx.roles.tp
        rank = ctx.coordinate(axis)
        self.layout, self.reduce = tp_layout(ctx.plan, rank)
        self.tp = TPGroup(ctx.device_mesh(axis), ctx.group(axis), rank, ctx.size(axis),
                          self.layout.sequence_parallel if self.layout else False)
        self.specs = {m.fqn: m for m in self.layout.modules} if self.layout else {}
        self.model, self.dropped = ctx.model, ctx.dropped
        self.mods = dict(ctx.model.named_modules())
        uses: dict = {}
        for _, q in ctx.model.named_parameters(remove_duplicate=False):
            uses[id(q)] = uses.get(id(q), 0) + 1
        self.tied = {i for i, c in uses.items() if c > 1}
        self.blocks = set(ctx.plan.model.blocks)
        self.swapped: dict = {}
        self.done: set[str] = set()
        self.versions: dict[str, int] = {}
        ctx.on_module.append(self.on_module)

    def shard(self, name: str) -> None:
        m = self.mods[name]
        _tp.shard_module(m, self.specs[name], self.tp, self.swapped)
        self.done.add(name)
        for k, q in m._parameters.items():
            if q is not None:
                self.versions[f"{name}.{k}"] = q._version

    def on_module(self, name: str, m) -> None:
        if name not in self.blocks or name in self.dropped:
            return
        for sub in self.specs:
            if sub.startswith(name + ".") and sub not in self.done and not any(
                    id(q) in self.tied for q in self.mods[sub].parameters(recurse=False)):
                self.shard(sub)

    def finish(self, ctx) -> Part | None:
        from ...core.errors import ConfigError

        for name, v in self.versions.items():  # nothing may have rewritten a sharded parameter
            mname, _, k = name.rpartition(".")
            if self.mods[mname]._parameters[k]._version != v:
                raise ConfigError(f"{name} was re-initialized after its block finished; "
                                  f"initialize this model with state_dict= instead")
        if self.layout is None:
            return None
        # What a pipeline stage dropped is not sharded (modules without parameters left);
        # integer attributes go to every module still there, with parameters or without.
        present = dict(ctx.model.named_modules())
        self.mods = {n: m for n, m in present.items()
                     if n == "" or next(m.parameters(), None) is not None}
        layout = dataclasses.replace(
            self.layout, modules=tuple(m for m in self.layout.modules if m.fqn in self.mods),
            regions=tuple(r for r in self.layout.regions if r in self.mods),
            all_inputs=tuple(r for r in self.layout.all_inputs if r in self.mods),
            attrs=tuple(a for a in self.layout.attrs if a[0] in present),
            head_args=tuple(a for a in self.layout.head_args if a[0] in self.mods))
        for m in layout.modules:
            if m.fqn not in self.done:
                self.shard(m.fqn)
        if self.swapped:
            # Every module that held a replaced tensor (tied names) now holds the DTensor.
            for mod in ctx.model.modules():
                for k, q in list(mod._parameters.items()):
                    if q is not None and id(q) in self.swapped and self.swapped[id(q)][0] is q:
                        mod._parameters[k] = self.swapped[id(q)][1]
        if layout.dtensor:      # no regions: DTensor mode, no hooks and no sums (``_dtensor``)
            _dtensor.install(ctx.model, _dtensor.model_layout(ctx, self.tp.mesh),
                             ctx.plan.model.blocks)
            return None
        _tp.install_hooks(ctx.model, layout, self.tp)
        _dtensor.install_context(ctx.model, _dtensor.model_layout(ctx))
        if any(isinstance(m.style, VocabHead) and not m.style.gather_output
               for m in layout.modules):
            install_loss(ctx.model)
        install_generate(ctx.model, sequence_parallel=self.tp.sp)
        return None


@implied_room
def _implied_tp(plan: Plan, roles) -> Transform | None:
    """Parameters sharded over a non-data axis run tensor parallelism, however their
    specs were written."""
    if roles.tp is None or any(isinstance(t, Shard) for t in plan.options):
        return None
    return Shard(specs=_Frozen({}))


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

    ``rules`` (a ``Rules`` or a mapping) join the plan's rules. Without rules, and with
    none in the plan yet, ``Rules.default()`` applies, so ``shard(policies.auto)`` on a
    mesh with a tensor axis shards over it:

    * ``heads``, ``kv_heads``, ``mlp``, ``vocab`` -> the tensor-parallel axis: the first
      of ``tp``, ``tensor``, ``model`` in the mesh;
    * ``batch`` -> the data axes: ``('dp', 'fsdp')`` together, else whichever exists;
    * ``embed`` -> ``fsdp`` where the mesh has it, else replicated.

    Every default ends in ``None``: on a mesh without those axes the dimension is
    replicated, never an error. Explicit rules are used as given; the plan's transforms
    (the caption of its table) name the default rules where they applied.

    >>> shard({'layers.*.mlp.up_proj.weight': P('mlp', 'embed')}, Rules(mlp='tp'))
    shard({'layers.*.mlp.up_proj.weight': P('mlp', 'embed')}, Rules(mlp='tp'))
    """
    if rules is not None and not isinstance(rules, Rules):
        if not isinstance(rules, Mapping):
            raise RulesError(f"shard(rules={rules!r}): rules must be a Rules or a mapping of "
                             f"logical axis -> mesh axes, e.g. Rules(mlp='tp')")
        rules = Rules(rules)
    from ...policies import Policy, _Auto, get

    if isinstance(specs, str):                   # a registered policy, by name
        specs = get(specs)
    if not isinstance(specs, (Policy, _Auto)):
        specs = _Frozen(normalize_specs(specs))  # one spelling from here on: FQN globs
    return Shard(specs=specs, rules=rules, activations=_activation_specs(activations))


def _activation_specs(activations) -> tuple[tuple[str, P], ...]:
    """``shard(activations=)``: module globs -> the ``P`` of each module's output."""
    if activations is None:
        return ()
    if not isinstance(activations, Mapping):
        raise SpecError(f"shard(activations={activations!r}): give a dict of module globs -> "
                        f"P, e.g. {{'layers.*': P('batch', 'seq', None)}}")
    for glob, spec in activations.items():
        glob_match(glob, "")                     # a glob that cannot match raises here
        if not isinstance(spec, P):
            raise SpecError(f"shard(activations={{{glob!r}: {spec!r}}}): each module glob "
                            f"maps to a P(...) describing the module's output")
    return tuple(activations.items())


class _Frozen(dict):
    """A dict that hashes (so the frozen transform that holds it does) and refuses edits."""

    def __hash__(self):
        return hash(tuple(self.items()))

    def _ro(self, *a, **k):
        raise TypeError("specs held by a transform are immutable")

    __setitem__ = __delitem__ = update = pop = popitem = setdefault = clear = _ro


def _refuse_shared_split(plan: Plan) -> None:
    """A module placed twice in the model whose parameters tensor parallelism splits: the
    layout splits each module by its name, and the second name is the same object."""
    twice = shared_module(plan.source, plan.model.blocks) if plan.roles.tp is not None \
        else None
    if twice is None:
        return
    first = twice[0] + "."
    split = next((e for e in plan.params if e.fqn.startswith(first)
                  and plan.roles.tp in (e.mesh_spec or P()).axes), None)
    if split is not None:
        raise ConfigError(
            f"{twice[1]} is {twice[0]} (one module placed twice in the model), and "
            f"{split.fqn} is split over {plan.roles.tp!r}: tensor parallelism splits each "
            f"module where it sits; share its parameters instead of the module "
            f"({twice[1]}.weight = {twice[0]}.weight, each a module of its own), or "
            f"replicate it with P()")
