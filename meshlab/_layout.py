"""From a bound plan to what the materializer does: axes, TP modules, gradient syncs.

Pure and local: it reads the plan and the module tree, checks every combination it
cannot run, and raises ``ConfigError`` before any process communicates.
"""

from __future__ import annotations

import dataclasses
import math

from torch import nn

from ._errors import ConfigError
from ._plan import Plan
from ._spec import P
from ._tp import TPLayout, TPModule

_COL = {"colwise", "colwise_gather_output", "packed_colwise", "conv1d_colwise",
        "conv1d_packed_colwise"}
_ROW = {"rowwise", "rowwise_split_input", "packed_rowwise", "conv1d_rowwise"}


@dataclasses.dataclass(frozen=True)
class Layout:
    tp_axis: str | None
    dp_axes: tuple[str, ...]
    zero_stage: int
    tp: TPLayout | None
    grad_tp_reduce: tuple[str, ...]     # FQNs whose gradients are summed over tp
    blocks: tuple[str, ...]
    remat: str
    precision: dict


def _is_conv1d(m: nn.Module) -> bool:
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf")


def build_layout(plan: Plan, model: nn.Module, tp_rank: int = 0) -> Layout:
    sizes = plan.mesh_shape
    entries = {e.fqn: e for e in plan.params}
    sharded_axes = {a for e in plan.params for a in (e.mesh_spec or P()).axes if sizes[a] > 1}
    if len(sharded_axes) > 1:
        raise ConfigError(
            f"parameters are sharded over several mesh axes {sorted(sharded_axes)}; meshlab runs "
            f"tensor parallelism over one axis and shards data-parallel axes with zero_shard(...). "
            f"Map the logical axes of the other mesh axes to None in Rules (e.g. embed=None) and "
            f"add zero_shard(3, axis=...) instead"
        )
    tp_axis = next(iter(sharded_axes), None)
    zero = plan.option("zero")
    if zero is not None:
        stage, dp_axes = zero["stage"], tuple(zero["axis"])
    else:
        stage = 0
        batch = (plan.rules.resolve(P("batch"), tuple(sizes)) if plan.rules else P()).dim_axes(0)
        dp_axes = tuple(a for a in batch if a != tp_axis)
    for a in dp_axes:
        if a not in sizes:
            raise ConfigError(f"zero_shard/data-parallel axis {a!r} is not a mesh axis "
                              f"{tuple(sizes)}; use one of those")
        if a == tp_axis:
            raise ConfigError(f"axis {a!r} both shards parameters (tensor parallel) and carries "
                              f"data parallelism; give them different mesh axes")
    pp = plan.option("pipeline")
    pp_axis = pp["axis"] if pp else None
    sq = plan.option("sequence")
    sp_axis = sq["axis"] if sq else None
    if sp_axis is not None and sp_axis not in sizes:
        raise ConfigError(f"sequence axis {sp_axis!r} is not a mesh axis {tuple(sizes)}")
    if sp_axis is not None and sp_axis in (tp_axis, pp_axis) + dp_axes:
        raise ConfigError(f"sequence(all_to_all) needs its own mesh axis; {sp_axis!r} is "
                          f"already used by another transform")
    unused = [a for a, s in sizes.items() if s > 1 and a not in
              (tp_axis, pp_axis, sp_axis) + dp_axes]
    if unused:
        raise ConfigError(
            f"mesh axis {unused[0]!r} (size {sizes[unused[0]]}) is used by no transform: no "
            f"parameter is sharded over it and it carries no data parallelism. Add "
            f"zero_shard(stage, axis={unused[0]!r}) or data_parallel({unused[0]!r}), map the "
            f"batch to it in Rules, or give it size 1"
        )
    prec = plan.option("precision") or {}
    remat = (plan.option("remat") or {}).get("policy", "none")
    tp = None
    grad_reduce: list[str] = []
    if tp_axis is not None:
        tp, grad_reduce = _tp_layout(plan, model, tp_axis, sizes[tp_axis], tp_rank)
    return Layout(tp_axis, dp_axes, stage, tp, tuple(grad_reduce), plan.model.blocks, remat, prec)


def _tp_layout(plan: Plan, model: nn.Module, axis: str, n: int, rank: int):
    mods = dict(model.named_modules())
    regions = tuple(a.module for a in plan.activations if "tp_region" in a.tags)
    in_region = lambda fqn: any(fqn.startswith(r + ".") for r in regions)
    by_module: dict[str, list] = {}
    for e in plan.params:
        by_module.setdefault(e.module, []).append(e)
    out_embed = getattr(model, "get_output_embeddings", lambda: None)()
    out_name = next((k for k, v in mods.items() if v is out_embed), None) if out_embed is not None else None

    # Sequence parallel: the decoder blocks' outputs are split on the sequence over `axis`.
    sp = any(a.module in plan.model.blocks and a.output is not None and len(a.output) > 1
             and a.output.dim_axes(1) == (axis,) for a in plan.activations)
    tied_names = {e.fqn for e in plan.params if e.tied_to} | \
        {e.tied_to for e in plan.params if e.tied_to}
    tp_modules: list[TPModule] = []
    grad_reduce: list[str] = []
    kv_attn: dict[str, tuple[int, int]] = {}
    cfg = plan.model
    H = cfg.config_get("num_attention_heads") or cfg.config_get("n_head")
    KV = cfg.config_get("num_key_value_heads") or H
    for mname, es in by_module.items():
        m = mods.get(mname)
        w = next((e for e in es if e.fqn.endswith(".weight") or e.fqn == "weight"), None)
        styles = {t for e in es for t in e.tags}
        sharded = any((e.mesh_spec or P()).axes for e in es)
        if "kv_replicated" in styles:
            if not isinstance(m, nn.Linear) or H is None:
                raise ConfigError(f"{mname}: K/V replication needs an nn.Linear projection in a "
                                  f"model whose config gives the head counts")
            hq, g = H // n, H // KV
            if hq % g and g % hq:
                raise ConfigError(f"{mname}: {H} query heads and {KV} KV heads over tp={n}: each "
                                  f"rank's {hq} query heads must map to whole KV groups")
            first, count = (rank * hq) // g, max(1, hq // g)
            head_dim = m.out_features // KV
            tp_modules.append(TPModule(mname, "kv_replicated", in_region=in_region(mname),
                                       kv_heads=(first, count), head_dim=head_dim))
            grad_reduce.extend(e.fqn for e in es)
            kv_attn[mname.rsplit(".", 1)[0]] = (hq, count)
            continue
        if not sharded:
            if "replicated_with_grad_allreduce" in styles or (sp and "sequence_parallel" in styles):
                grad_reduce.extend(e.fqn for e in es)
            continue
        if w is None and all(e.fqn in tied_names for e in es):
            continue  # tied to a parameter of another module, which shards it
        if w is None:
            raise ConfigError(f"{mname}: sharded parameters {[e.fqn for e in es]} but no weight; "
                              f"meshlab shards Linear, Embedding and Conv1D modules")
        ws = w.mesh_spec
        conv = _is_conv1d(m)
        packed = 1
        if "conv1d_packed_colwise" in styles:
            packed = 3
        elif "packed_colwise" in styles:
            if "qkv" in mname:
                raise ConfigError(f"{mname}: packed q/k/v projections have unequal parts under "
                                  f"GQA; give this module a replicated spec")
            packed = 2
        if isinstance(m, nn.Embedding):
            if ws.dim_axes(0) != (axis,):
                raise ConfigError(f"{w.fqn}: embeddings shard over the vocabulary (dim 0) only; "
                                  f"got {ws!r}")
            tp_modules.append(TPModule(mname, "vocab_embed"))
            continue
        if not isinstance(m, nn.Linear) and not conv:
            raise ConfigError(
                f"{w.fqn}: {type(m).__name__} is not a module meshlab can split (nn.Linear, "
                f"nn.Embedding, transformers Conv1D); give it a replicated spec P()")
        out_dim, in_dim = (1, 0) if conv else (0, 1)
        vocab = "vocab" in (w.spec.dim_axes(out_dim) if len(w.spec) > out_dim else ())
        if ws.dim_axes(out_dim) == (axis,):
            kind = "vocab_head" if (vocab or mname == out_name) else "colwise"
            if kind == "vocab_head" and in_region(mname):
                raise ConfigError(f"{mname}: the output head cannot sit inside a TP region")
            tp_modules.append(TPModule(mname, kind, conv1d=conv, packed=packed,
                                       in_region=in_region(mname),
                                       gather_output="colwise_gather_output" in styles and not vocab))
        elif ws.dim_axes(in_dim) == (axis,):
            tp_modules.append(TPModule(mname, "rowwise", conv1d=conv))
            if sp:  # the bias is added to this rank's sequence shard only
                grad_reduce.extend(e.fqn for e in es if e.fqn.endswith("bias"))
        else:
            raise ConfigError(f"{w.fqn}: {ws!r} does not split the weight along its input or "
                              f"output features over {axis!r}")
    if not tp_modules:
        return None, []
    if sp and not regions:
        raise ConfigError("sequence parallelism needs a policy that marks its tensor-parallel "
                          "regions (Policy.regions); the given specs do not")
    # A replicated parameter that sees only this rank's part of the data has a partial
    # gradient: it must be summed over tp, or the run silently diverges.
    tp_fqns = {m.fqn for m in tp_modules}
    reduced = set(grad_reduce)
    blocks = plan.model.blocks
    for e in plan.params:
        if e.fqn in reduced or e.module in tp_fqns or not e.requires_grad:
            continue
        partial_in_region = in_region(e.module) or e.module in regions
        partial_seq = sp and any(e.module == b or e.module.startswith(b + ".") for b in blocks)
        if partial_in_region or partial_seq:
            raise ConfigError(
                f"{e.fqn}: replicated, but under tensor{' and sequence' if sp else ''} "
                f"parallelism it sees only this rank's share of the activations, so its "
                f"gradient is partial. Mark it in the policy (style "
                f"'replicated_with_grad_allreduce', or Policy.sequence_parallel) so meshlab "
                f"sums it over {axis!r}")
    attrs = []
    for a in plan.activations:
        for t in a.tags:
            if t.startswith("local_attr:"):
                attr = t.split(":", 1)[1]
                v = getattr(mods[a.module], attr)
                if v % n:
                    raise ConfigError(f"{a.module}.{attr} = {v} does not divide over tp={n}")
                attrs.append((a.module, attr, v // n))
    for spec in tp_modules:
        if spec.conv1d and spec.kind == "colwise":
            nf = mods[spec.fqn].nf  # Conv1D.forward reshapes its output to nf features
            if nf % n:
                raise ConfigError(f"{spec.fqn}: {nf} output features do not divide over tp={n}")
            attrs.append((spec.fqn, "nf", nf // n))
    for attn, (hq, count) in kv_attn.items():
        attrs.append((attn, "num_key_value_groups", hq // count))
    layout = TPLayout(axis=axis, modules=tuple(tp_modules), regions=regions, sequence_parallel=sp,
                      first_block=blocks[0] if blocks else None,
                      last_block=blocks[-1] if blocks else None, attrs=tuple(attrs))
    return layout, grad_reduce
