"""Policy: how one model family shards, as data.

A policy is a list of module rules (module glob -> style), extra parameter specs, and
activation boundaries, in logical axes. Module globs are relative to the Hugging Face
base model (``layers.*.self_attn.q_proj``); a glob starting with ``/`` is relative to
the root (``/lm_head``). Each style says which logical specs the module's ``weight`` and
``bias`` get; the materializer reads the style from the entry's tags.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from ..core.errors import PolicyError
from ..core.spec import P

# style -> (weight spec, bias spec) with "{tp}" standing for the module's logical TP axis.
# nn.Linear weights are (out_features, in_features).
_STYLES: dict[str, tuple[tuple, tuple | None]] = {
    "colwise": (("{tp}", "embed"), ("{tp}",)),
    "colwise_gather_output": (("{tp}", "embed"), ("{tp}",)),
    "packed_colwise": (("{tp}", "embed"), ("{tp}",)),
    # An nn.Linear packing q|k|v of equal widths (no GQA): each of the three parts split.
    "packed_qkv_colwise": (("{tp}", "embed"), ("{tp}",)),
    "rowwise": (("embed", "{tp}"), ("embed",)),
    "rowwise_split_input": (("embed", "{tp}"), ("embed",)),
    "packed_rowwise": (("embed", "{tp}"), ("embed",)),
    "embedding_rowwise": (("vocab", "embed"), None),
    # An nn.Embedding whose columns are split (T5's relative position bias: (buckets, heads)).
    "embedding_colwise": ((None, "{tp}"), None),
    "vocab": (("vocab", "embed"), ("vocab",)),
    "norm": (("embed",), ("embed",)),
    "replicate": ((), ()),
    "replicated_with_grad_allreduce": ((), ()),
    # GPT-2's Conv1D keeps weights as (in_features, out_features).
    "conv1d_colwise": (("embed", "{tp}"), ("{tp}",)),
    "conv1d_packed_colwise": (("embed", "{tp}"), ("{tp}",)),
    "conv1d_rowwise": (("{tp}", "embed"), ("embed",)),
}

# The logical TP axis of a projection, by the last segment of its module name.
_TP_AXIS = {
    "q_proj": "heads", "query": "heads", "q": "heads", "qkv_proj": "heads", "Wqkv": "heads",
    "c_attn": "heads", "query_key_value": "heads", "o_proj": "heads", "out_proj": "heads",
    "dense": "heads", "k_proj": "kv_heads", "v_proj": "kv_heads", "key": "kv_heads",
    "value": "kv_heads", "k": "kv_heads", "v": "kv_heads", "lm_head": "vocab",
    "embed_tokens": "vocab", "wte": "vocab", "word_embeddings": "vocab",
}


def tp_axis_for(glob: str) -> str:
    last = glob.rstrip("/").split(".")[-1]
    if last in _TP_AXIS:
        return _TP_AXIS[last]
    return "heads" if "attn" in glob or "attention" in glob else "mlp"


def style_specs(style: str, tp: str) -> tuple[P, P | None]:
    if style not in _STYLES:
        raise PolicyError(
            f"style {style!r} is not translated (known: {sorted(_STYLES)}); give specs for "
            f"those modules with shard({{'<fqn glob>': P(...)}})"
        )
    w, b = _STYLES[style]
    if style in ("colwise_gather_output", "rowwise_split_input") and tp == "kv_heads":
        tp = "heads"     # gathered again: K/V heads need not be whole per rank
    sub = lambda t: P(*(tp if x == "{tp}" else x for x in t))
    return sub(w), (None if b is None else sub(b))


@dataclasses.dataclass(frozen=True)
class ModuleRule:
    """One module glob and its style; ``axis`` overrides the logical TP axis."""

    glob: str
    style: str
    axis: str | None = None

    def __post_init__(self):
        style_specs(self.style, "x")  # validate the style now, not at use


@dataclasses.dataclass(frozen=True)
class Policy:
    """Sharding of one model family, in logical axes. Compose with ``+`` (right wins)."""

    name: str
    modules: tuple[ModuleRule, ...] = ()
    params: tuple[tuple[str, P], ...] = ()          # parameter globs -> P, for odd cases
    activations: tuple[tuple[str, P], ...] = ()     # module glob -> output spec
    sequence_parallel: tuple[str, ...] = ()         # replicated modules on sequence shards (SP)
    regions: tuple[str, ...] = ()                   # modules whose input enters a TP region
    dense_regions: tuple[str, ...] = ()             # the same, for modules holding no experts
    local_attrs: tuple[tuple[str, str], ...] = ()   # (module glob, int attribute) divided by tp
    optional: tuple[str, ...] = ()                   # globs allowed to match nothing
    # regions whose every tensor input enters (attention called with query=, key=, value=)
    multi_input_regions: tuple[str, ...] = ()
    # (module glob, keyword, head-count attribute, dim): a tensor keyword argument of the
    # module that carries every attention head on ``dim`` (from the end when negative; as
    # the first dim, batch x heads, heads inner), as ALiBi biases do; under TP each rank
    # is passed its own heads' share
    head_args: tuple[tuple[str, str, str, int], ...] = ()

    def __add__(self, other: "Policy") -> "Policy":
        mine = {r.glob: r for r in self.modules}
        mine.update({r.glob: r for r in other.modules})
        return Policy(
            name=other.name,
            modules=tuple(mine.values()),
            params=tuple({**dict(self.params), **dict(other.params)}.items()),
            activations=tuple({**dict(self.activations), **dict(other.activations)}.items()),
            sequence_parallel=tuple(dict.fromkeys(self.sequence_parallel + other.sequence_parallel)),
            regions=tuple(dict.fromkeys(self.regions + other.regions)),
            dense_regions=tuple(dict.fromkeys(self.dense_regions + other.dense_regions)),
            local_attrs=tuple(dict.fromkeys(self.local_attrs + other.local_attrs)),
            optional=tuple(dict.fromkeys(self.optional + other.optional)),
            multi_input_regions=tuple(dict.fromkeys(self.multi_input_regions +
                                                    other.multi_input_regions)),
            head_args=tuple(dict.fromkeys(self.head_args + other.head_args)),
        )

    def without(self, *globs: str) -> "Policy":
        return dataclasses.replace(self, modules=tuple(r for r in self.modules
                                                       if r.glob not in globs))

    def __repr__(self) -> str:
        return f"policies.get({self.name!r})"

    # -- application -----------------------------------------------------------------
    @staticmethod
    def _abs(glob: str, prefix: str) -> str:
        if glob.startswith("/"):
            return glob[1:]
        return f"{prefix}.{glob}" if prefix else glob

    def _modules_of(self, plan) -> dict[str, list]:
        """module fqn -> its parameter entries."""
        out: dict[str, list] = {}
        for e in plan.params:
            out.setdefault(e.module, []).append(e)
        return out

    def param_specs(self, plan) -> dict[str, P]:
        """Parameter FQN -> logical ``P`` for ``plan``'s model. Raises for a module glob
        that matches nothing (unless listed in ``optional``)."""
        from ..core.specs_tree import glob_match

        prefix = plan.model.base_prefix
        mods = self._modules_of(plan)
        out: dict[str, P] = {}
        for rule in self.modules:
            g = self._abs(rule.glob, prefix)
            hit = [m for m in mods if glob_match(g, m)]
            if not hit:
                if rule.glob in self.optional:
                    continue
                raise PolicyError(
                    f"policy {self.name!r}: module glob {g!r} ({rule.style}) matches no module "
                    f"of {plan.model.cls or 'the model'}; the policy does not fit this model. "
                    f"Pass specs with shard({{...}}) or register a policy for it"
                )
            w, b = style_specs(rule.style, rule.axis or tp_axis_for(rule.glob))
            for m in hit:
                for e in mods[m]:
                    leaf = e.fqn.rsplit(".", 1)[-1]
                    if leaf == "weight":
                        out.setdefault(e.fqn, w)
                    elif leaf == "bias" and b is not None:
                        out.setdefault(e.fqn, b)
        for glob, spec in self.params:
            for e in plan.params:
                if glob_match(self._abs(glob, prefix), e.fqn):
                    out.setdefault(e.fqn, spec)
        # Tied names are one tensor: whichever name the policy covers gives the spec.
        for e in plan.params:
            if e.tied_to is not None:
                spec = out.get(e.tied_to, out.get(e.fqn))
                if spec is not None:
                    out[e.fqn] = out[e.tied_to] = spec
        return out

    def tags(self, plan) -> dict[str, tuple[str, ...]]:
        from ..core.specs_tree import glob_match

        prefix = plan.model.base_prefix
        out: dict[str, tuple[str, ...]] = {}
        for rule in self.modules:
            g = self._abs(rule.glob, prefix)
            for e in plan.params:
                if glob_match(g, e.module):
                    out.setdefault(e.fqn, (rule.style,))
        for glob in self.sequence_parallel:
            g = self._abs(glob, prefix)
            for e in plan.params:
                if glob_match(g, e.module):
                    out[e.fqn] = out.get(e.fqn, ()) + ("sequence_parallel",)
        return out

    def _keep(self, glob: str, plan) -> bool:
        """Optional globs that match no module of this model are dropped."""
        if glob not in self.optional:
            return True
        from ..core.specs_tree import glob_match

        g = self._abs(glob, plan.model.base_prefix)
        mods = {p for e in plan.params for p in _prefixes(e.module)} | set(plan.model.blocks)
        return any(glob_match(g, m) for m in mods)

    def activation_specs(self, plan) -> dict[str, P]:
        prefix = plan.model.base_prefix
        return {self._abs(g, prefix): s for g, s in self.activations if self._keep(g, plan)}

    def module_tags(self, plan) -> dict[str, tuple[str, ...]]:
        """Module glob -> tags (``tp_region``: the module's input enters a TP region)."""
        prefix = plan.model.base_prefix
        out = {self._abs(g, prefix): ("tp_region",) for g in self.regions if self._keep(g, plan)}
        for g in self.multi_input_regions:
            if self._keep(g, plan):
                out[self._abs(g, prefix)] = ("tp_region", "tp_region_all_inputs")
        for g, kw, attr, dim in self.head_args:
            if self._keep(g, plan):
                k = self._abs(g, prefix)
                out[k] = out.get(k, ()) + (head_arg_tag(kw, attr, dim),)
        if self.dense_regions:
            from ..core.specs_tree import glob_match

            experts = [m.fqn for m in plan.model.modules if dict(m.ints).get("experts_interface")]
            for g in self.dense_regions:
                a = self._abs(g, prefix)
                for m in plan.model.modules:      # a dense MLP, not an MoE block
                    if glob_match(a, m.fqn) and not any(x.startswith(m.fqn + ".")
                                                        for x in experts):
                        out[m.fqn] = ("tp_region",)
        return out

    def module_attrs(self, plan) -> dict[str, tuple[str, ...]]:
        """Module glob -> integer attributes that must hold this rank's share under TP."""
        prefix = plan.model.base_prefix
        out: dict[str, tuple[str, ...]] = {}
        for g, attr in self.local_attrs:
            if self._keep(g, plan):
                k = self._abs(g, prefix)
                out[k] = out.get(k, ()) + (attr,)
        return out


def head_arg_tag(keyword: str, attr: str, dim: int) -> str:
    """The module tag of one ``Policy.head_args`` entry; ``parse_head_arg`` reads it."""
    return f"head_arg:{keyword}:{attr}:{dim}"


def parse_head_arg(tag: str) -> tuple[str, str, int] | None:
    """``(keyword, attribute, dim)`` of a ``head_arg_tag``; None for any other tag."""
    if not tag.startswith("head_arg:"):
        return None
    _, kw, attr, dim = tag.split(":")
    return kw, attr, int(dim)


def _prefixes(module: str):
    parts = module.split(".") if module else []
    for i in range(1, len(parts) + 1):
        yield ".".join(parts[:i])
