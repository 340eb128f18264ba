"""lora: low-rank adapters through peft, on a parallelized model.

The room: ``Lora`` (a plan value holding a ``peft.LoraConfig``), its plan step (the
parameter table as peft will leave it: each target's weight becomes the frozen
``<module>.base_layer.weight``, its adapters ``lora_A.default.weight [r, in]`` and
``lora_B.default.weight [out, r]`` are added with specs derived from the base weight's
(A follows its input sharding, B its output sharding), ``modules_to_save`` become a
frozen ``original_module`` and a trainable ``modules_to_save.default`` copy, and every
other parameter is frozen; the rooms it runs with are the composition table's), and its
prepare step (peft's
``inject_adapter_in_model`` on the model before it is initialized, checked against the
plan; B starts at zero so the model starts equal to its base). Export and import in PEFT
format live in ``meshlab.checkpoint.adapters``.

Frozen parameters hold no gradient and no optimizer state: ``plan.memory()`` counts the
adapters' share alone, the gradient reductions cover only them, and ZeRO-3 shards the
base and the adapters alike.

QLoRA (``lora(config, quantize=Quantize())``, ``_quant``): the base's Linear layers are
held in 4 bits by bitsandbytes. The plan records each quantized weight as ``'nf4'`` (or
``'fp4'``), frozen and kept whole, its scales in ``plan.memory()``; the install step,
after the weights hold their values, quantizes them and then injects peft's adapters
(peft's own ``Linear4bit`` adapter layer), so a ``state_dict`` given to ``parallelize``
names the model's parameters before the adapters. The quantized base takes the
composition table's ``lora(quantize)`` row besides ``lora``: it runs replicated
(``data_parallel``, ``zero_shard(1)``, ``zero_shard(2)``, with ``remat`` and
``precision`` in fp32, bf16 or fp16, its products in ``Quantize.compute_dtype``), and the
rows that would split, move or replace the base are refused there by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from ...core.errors import ConfigError, NotRunnable
from ...planning.plan import ModuleInfo, ParamEntry, Plan
from ...core.spec import P
from .._protocol import Phase, Transform
from ._peft import jsonable as _jsonable, peft_module as _peft, with_targets as with_targets
from ._quant import KEEP_WHOLE, Quantize as Quantize, quantization, quantized_modules, scale_rows

# Saving, loading and merging adapters are checkpoint work: meshlab.checkpoint.adapters
# (meshlab.save_adapter, load_adapter, save_merged, merge_adapters, unmerge_adapters).
__all__ = ["Lora", "Quantize", "lora"]


def _targets(config, plan: Plan) -> list[ModuleInfo]:
    """The linear modules peft will wrap (its own matching rule)."""
    from peft.tuners.tuners_utils import check_target_module_exists

    out = []
    for m in plan.model.modules:
        if m.fqn and check_target_module_exists(config, m.fqn):
            if m.kind != "linear":
                raise ConfigError(f"lora: target {m.fqn} is a {m.cls}, not a Linear; meshlab "
                                  f"runs LoRA on nn.Linear targets (narrow target_modules)")
            out.append(m)
    if not out:
        raise ConfigError(f"lora: target_modules={sorted(config.target_modules)} match no "
                          f"module of {plan.model.cls}; name modules such as 'q_proj'")
    return out


def _saved(config, plan: Plan) -> list[str]:
    names = list(config.modules_to_save or ())
    return [m.fqn for m in plan.model.modules if m.fqn and any(
        m.fqn == t or m.fqn.endswith("." + t) for t in names)]


def _axis(spec: P, d: int):
    return spec[d] if d < len(spec) else None


def lora_entries(config, plan: Plan) -> tuple[ParamEntry, ...]:
    """The parameter table after peft's injection (see the module doc)."""
    targets = {m.fqn: m for m in _targets(config, plan)}
    saved = _saved(config, plan)
    r = config.r
    out: list[ParamEntry] = []
    for e in plan.params:
        if e.module in targets:
            name = e.fqn.rsplit(".", 1)[-1]
            base = dataclasses.replace(e, fqn=f"{e.module}.base_layer.{name}",
                                       module=f"{e.module}.base_layer", requires_grad=False)
            out.append(base)
            if name == "weight":
                if e.tied_to is not None:
                    raise ConfigError(f"lora: target {e.module} shares its weight with "
                                      f"{e.tied_to}; untie them or target other modules")
                spec = e.spec
                out_ax, in_ax = _axis(spec, 0), _axis(spec, 1)
                # Under tensor parallelism: a base split on its outputs has B split alike
                # and A replicated, reading the region's input, its gradient partial like
                # every input's there (summed over tp); a base split on its inputs has A
                # split alike and B replicated after the reduction, its gradient whole.
                row = any("rowwise" in t for t in e.tags)
                col = any("colwise" in t for t in e.tags)
                a_tags = ("replicated_with_grad_allreduce",) if col else ()
                b_tags = ("full_grad",) if row else ()
                A = ParamEntry(f"{e.module}.lora_A.default.weight", (r, e.shape[1]), e.dtype,
                               P(None, in_ax), True, None, f"{e.module}.lora_A.default",
                               tags=a_tags)
                B = ParamEntry(f"{e.module}.lora_B.default.weight", (e.shape[0], r), e.dtype,
                               P(out_ax, None), True, None, f"{e.module}.lora_B.default",
                               tags=b_tags)
                out += [A, B]
            continue
        owner = next((s for s in saved if e.module == s or e.module.startswith(s + ".")), None)
        if owner is not None:
            if e.tied_to is not None:
                raise ConfigError(f"lora(modules_to_save=...): {owner} shares {e.fqn} with "
                                  f"{e.tied_to}; untie them or save another module")
            rest = e.fqn[len(owner) + 1:]
            sub = e.module[len(owner):]
            out.append(dataclasses.replace(e, fqn=f"{owner}.original_module.{rest}",
                                           module=f"{owner}.original_module{sub}",
                                           requires_grad=False))
            out.append(dataclasses.replace(e, fqn=f"{owner}.modules_to_save.default.{rest}",
                                           module=f"{owner}.modules_to_save.default{sub}",
                                           requires_grad=True))
            continue
        out.append(dataclasses.replace(e, requires_grad=False))
    return tuple(out)


def lora_modules(config, plan: Plan) -> tuple[ModuleInfo, ...]:
    """The module table after injection: each target gains ``base_layer`` (the original
    Linear) and its two adapter Linears."""
    targets = {m.fqn for m in _targets(config, plan)}
    saved = set(_saved(config, plan))
    out = []
    for m in plan.model.modules:
        if m.fqn in saved:      # peft's ModulesToSaveWrapper around the original and a copy
            out += [dataclasses.replace(m, cls="ModulesToSaveWrapper", kind=""),
                    dataclasses.replace(m, fqn=f"{m.fqn}.original_module"),
                    dataclasses.replace(m, fqn=f"{m.fqn}.modules_to_save.default")]
            continue
        owner = next((o for o in saved if m.fqn.startswith(o + ".")), None)
        if owner is not None:   # a submodule of a saved module: in both copies
            sub = m.fqn[len(owner):]
            out += [dataclasses.replace(m, fqn=f"{owner}.original_module{sub}"),
                    dataclasses.replace(m, fqn=f"{owner}.modules_to_save.default{sub}")]
            continue
        if m.fqn not in targets:
            out.append(m)
        else:                   # peft's wrapper: no weight of its own
            out.append(dataclasses.replace(m, cls=f"lora.{m.cls}", kind=""))
            ints = dict(m.ints)
            fin, fout = ints.get("in_features"), ints.get("out_features")
            out += [dataclasses.replace(m, fqn=f"{m.fqn}.base_layer"),
                    ModuleInfo(f"{m.fqn}.lora_A.default", "Linear", "linear",
                               (("in_features", fin), ("out_features", config.r))),
                    ModuleInfo(f"{m.fqn}.lora_B.default", "Linear", "linear",
                               (("in_features", config.r), ("out_features", fout)))]
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Lora(Transform):
    """LoRA adapters from a ``peft.LoraConfig`` (see the module doc)."""

    kind: ClassVar[str] = "lora"
    phase: ClassVar[Phase] = Phase.ADAPTERS

    config: Any
    quantize: Quantize | None = None

    def apply(self, plan: Plan) -> Plan:
        if plan.is_bound:
            raise ConfigError("lora() rewrites the parameter table: apply it to an unbound "
                              "plan, as part of the spec given to plan/parallelize")
        config = with_targets(self.config, plan.model.config_get("model_type"))
        params = lora_entries(config, plan)
        modules = lora_modules(config, plan)
        if self.quantize is not None:
            params, modules = _quantized(self.quantize, config, plan, params, modules)
        return plan.replace(params=params,
                            model=dataclasses.replace(plan.model, modules=modules))

    def check(self, plan: Plan) -> None:
        """Adapter dropout under tensor parallelism is not drawn as one process draws it:
        peft drops the adapter's input inside the split module, where each tp rank draws
        from its own stream (a replicated input there gets another mask on each rank and
        another than one process's), so that is not runnable."""
        drop = float(getattr(self.config, "lora_dropout", 0.0) or 0.0)
        tp = plan.roles.tp
        if drop > 0 and tp is not None and plan.mesh_shape.get(tp, 1) > 1:
            raise NotRunnable(
                f"lora(lora_dropout={drop}) under tensor parallelism over {tp!r}: the "
                f"adapters' dropout runs inside the split modules, where each tp rank draws "
                f"its own mask, not one process's; train with lora_dropout=0.0 there, or "
                f"without tensor parallelism")

    def rows(self, plan) -> tuple[str, ...]:
        """``lora``, and with a quantized base ``lora(quantize)`` too: the rows it does not
        compose with are those that would split, move or cast the 4-bit base."""
        return ("lora", "lora(quantize)") if self.quantize is not None else ("lora",)

    def prepare(self, ctx) -> None:
        # A quantized base is made from the weights' values: its adapters go in at install,
        # after the initialization (or the state_dict) has given the weights their values.
        if self.quantize is None:
            from ._inject import inject

            inject(self, ctx)

    def install(self, ctx):
        if self.quantize is not None:
            from ._inject import inject_quantized

            inject_quantized(self, ctx)
        return None

    def single_process(self, plan: Plan, model, init):
        """``model`` with these adapters as one process trains them (``_inject``'s
        ``single_process``): the reference ``meshlab.verify`` checks a layout against."""
        from ._inject import single_process

        return single_process(self, plan, model, init)

    def memory(self, plan: Plan, rows: list) -> list:
        """The scales of each 4-bit weight beside its packed bytes (``_quant.scale_rows``)."""
        if self.quantize is None:
            return rows
        extra = [r for e in plan.params if KEEP_WHOLE in e.tags and e.dtype in ("nf4", "fp4")
                 for r in scale_rows(self.quantize, e.fqn, e.numel)]
        return list(rows) + extra

    # -- JSON: the config as peft writes it ------------------------------------------------
    def to_json(self) -> dict:
        d = self.config.to_dict()
        out = {"kind": self.kind, "config": _jsonable(d)}
        if self.quantize is not None:
            out["quantize"] = self.quantize.to_json()
        return out

    @classmethod
    def from_json(cls, d) -> "Lora":
        peft = _peft()
        cfg = dict(d["config"])
        cfg.pop("peft_type", None)
        q = d.get("quantize")
        return cls(peft.LoraConfig(**{k: v for k, v in cfg.items()
                                      if k in peft.LoraConfig.__dataclass_fields__}),
                   None if q is None else Quantize.from_json(q))

    def __repr__(self) -> str:
        c = self.config
        targets = sorted(c.target_modules) if c.target_modules else "peft's for the model type"
        return (f"lora(r={c.r}, alpha={c.lora_alpha}, targets={targets}"
                + (f", modules_to_save={list(c.modules_to_save)}" if c.modules_to_save else "")
                + (f", quantize={self.quantize!r}" if self.quantize is not None else "")
                + ")")


def lora(config=None, *, quantize=None, **kwargs) -> Lora:
    """LoRA through peft: ``lora(peft.LoraConfig(r=8, target_modules=['q_proj', 'v_proj']))``
    or the same keywords (``lora(r=8, target_modules=[...])``).

    ``quantize`` holds the base in 4 bits (QLoRA, bitsandbytes: the ``qlora`` extra): True
    for Colossal-AI's defaults (nf4, double quantization, bfloat16 products), a
    ``Quantize(...)``, or a ``transformers.BitsAndBytesConfig(load_in_4bit=True, ...)``;
    every Linear but the output head is quantized (``Quantize`` says which)."""
    q = quantization(quantize)
    if q is not None:
        from ._quant import bnb_module

        bnb_module()
    peft = _peft()
    if config is None:
        try:
            config = peft.LoraConfig(**kwargs)
        except (TypeError, ValueError) as e:     # an unknown keyword, peft's own checks
            raise ConfigError(f"lora(**{sorted(kwargs)}): peft.LoraConfig refused them "
                              f"({e}); pass the keywords of peft.LoraConfig, e.g. "
                              f"lora(r=8, target_modules=['q_proj', 'v_proj'])") from None
    elif kwargs:
        raise ConfigError("lora(config, ...): give a LoraConfig or its keywords, not both")
    if not isinstance(config, peft.LoraConfig):
        raise ConfigError(f"lora(config): a peft.LoraConfig, got {type(config).__name__}")
    # peft takes these as they come and fails inside the injection (r=0, -1) or builds
    # adapters of a rank no matmul can have (r=1.5): refused here, by name
    from ...core.errors import check_int, check_number

    check_int(config.r, "lora", "r", example=8)
    check_number(config.lora_alpha, "lora", "lora_alpha", example=16)
    drop = config.lora_dropout
    if isinstance(drop, bool) or not isinstance(drop, (int, float)) or not 0 <= drop < 1:
        raise ConfigError(f"lora(lora_dropout={drop!r}): lora_dropout is a probability in "
                          f"[0, 1); pass e.g. lora_dropout=0.05")
    for name in ("rank_pattern", "alpha_pattern"):
        if getattr(config, name, None):
            raise ConfigError(f"lora: LoraConfig({name}=...) gives modules their own rank or "
                              f"alpha, which meshlab does not plan yet; use one r and alpha")
    from ...core.errors import check_bool

    if check_bool(getattr(config, "use_dora", False), "lora", "use_dora"):
        raise ConfigError("lora: LoraConfig(use_dora=True) is not planned by meshlab yet; "
                          "use plain LoRA")
    if config.bias != "none":
        # peft takes any value and would train biases meshlab plans frozen ("all",
        # "lora_only"), or none at all
        raise ConfigError(f"lora(bias={config.bias!r}): meshlab plans LoRA with frozen "
                          f"biases only; pass bias='none' (the default)")
    targets = config.target_modules     # None: peft's defaults for the model type
    names = isinstance(targets, (list, tuple, set, frozenset)) and all(
        isinstance(t, str) and t for t in targets)
    if targets is not None and (not targets or not (isinstance(targets, str) or names)):
        raise ConfigError(f"lora(target_modules={targets!r}): target_modules is a module "
                          f"name pattern (a string), a list of module names, or None for "
                          f"peft's defaults for the model type; pass e.g. "
                          f"target_modules=['q_proj', 'v_proj']")
    saved = config.modules_to_save
    if saved is not None and not (isinstance(saved, (list, tuple, set, frozenset)) and all(
            isinstance(m, str) and m for m in saved)):
        raise ConfigError(f"lora(modules_to_save={saved!r}): modules_to_save is a list of "
                          f"module names; pass e.g. modules_to_save=['lm_head']")
    return Lora(config, q)


def _quantized(q: Quantize, config, plan: Plan, params, modules):
    """The parameter and module tables with the 4-bit base: each quantized Linear's weight
    (its ``base_layer``'s where peft wraps it) becomes ``q.quant_type``, frozen and kept
    whole; its module a ``Linear4bit``; the adapters peft puts beside a 4-bit base are
    made in the base's compute dtype (peft's ``Linear4bit`` layer)."""
    names = set(quantized_modules(q, plan, _saved(config, plan)))
    targets = {m.fqn for m in _targets(config, plan)}
    held = {f"{m}.base_layer" if m in targets else m for m in names}
    beside = {f"{m}.lora_{x}.default" for m in names & targets for x in "AB"}
    out = []
    for e in params:
        if e.module in beside:
            e = dataclasses.replace(e, dtype=q.compute_dtype)
        if e.module in held and e.fqn == f"{e.module}.weight":
            if e.dtype not in ("float32", "bfloat16", "float16"):
                raise ConfigError(f"lora(quantize=...): {e.fqn} is {e.dtype}; bitsandbytes "
                                  f"quantizes float32, bfloat16 and float16 weights: build "
                                  f"the model in one of those (or keep the module in "
                                  f"full precision with Quantize(skip_modules=[...]))")
            e = dataclasses.replace(e, dtype=q.quant_type, requires_grad=False,
                                    tags=e.tags + (KEEP_WHOLE,))
        out.append(e)
    mods = tuple(dataclasses.replace(m, cls="Linear4bit") if m.fqn in held else m
                 for m in modules)
    return tuple(out), mods
