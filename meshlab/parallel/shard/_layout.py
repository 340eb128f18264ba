"""From a bound plan to what tensor parallelism installs: modules, regions, sums.

Pure and model-free: it reads the plan only (the module kinds and attributes ``trace``
recorded), so ``bind`` runs it on a fake mesh exactly as ``materialize`` does on a real
one, and every combination it cannot run raises ``ConfigError`` there.
"""

from __future__ import annotations

import dataclasses

from ..._errors import ConfigError, NotRunnable
from ..._plan import ModuleInfo, Plan
from ..._spec import P
from ._styles import ColWise, KVReplicated, RowWise, VocabEmbed, VocabHead
from ._tp import TPLayout, TPModule


@dataclasses.dataclass
class _Scan:
    """What one pass over the plan's modules collects."""

    plan: Plan
    axis: str
    n: int
    rank: int
    regions: tuple[str, ...]
    sp: bool
    infos: dict = dataclasses.field(default_factory=dict)   # fqn -> ModuleInfo
    modules: list = dataclasses.field(default_factory=list)
    grad_reduce: list = dataclasses.field(default_factory=list)
    kv_attn: dict = dataclasses.field(default_factory=dict)

    def in_region(self, fqn: str) -> bool:
        return any(fqn.startswith(r + ".") for r in self.regions)


def sequence_parallel(plan: Plan, axis: str) -> bool:
    """Megatron SP: the blocks' outputs are split on the sequence over the TP axis."""
    return any(a.module in plan.model.blocks and a.output is not None and len(a.output) > 1
               and a.output.dim_axes(1) == (axis,) for a in plan.activations)


def tp_layout(plan: Plan, rank: int = 0) -> tuple[TPLayout | None, list[str]]:
    """The TP modules of a bound plan on tensor-parallel rank ``rank``, and the FQNs whose
    gradients are summed over the TP axis (replicated, but computed from partial data)."""
    axis = plan.roles.tp
    if axis is None:
        return None, []
    scan = _Scan(plan, axis, plan.mesh_shape[axis], rank,
                 tuple(a.module for a in plan.activations if "tp_region" in a.tags),
                 sequence_parallel(plan, axis), {m.fqn: m for m in plan.model.modules})
    by_module: dict[str, list] = {}
    for e in plan.params:
        by_module.setdefault(e.module, []).append(e)
    tied = {e.fqn for e in plan.params if e.tied_to} | \
        {e.tied_to for e in plan.params if e.tied_to}
    for mname, es in by_module.items():
        _classify(scan, mname, es, tied)
    if not scan.modules:
        return None, []
    if scan.sp and not scan.regions:
        raise ConfigError("sequence parallelism needs a policy that marks its tensor-parallel "
                          "regions (Policy.regions); the given specs do not")
    _refuse_partial(scan)
    blocks = plan.model.blocks
    layout = TPLayout(axis=axis, modules=tuple(scan.modules), regions=scan.regions,
                      sequence_parallel=scan.sp, first_block=blocks[0] if blocks else None,
                      last_block=blocks[-1] if blocks else None, attrs=tuple(_attrs(scan)))
    return layout, scan.grad_reduce


def _info(scan: "_Scan", mname: str) -> ModuleInfo:
    return scan.infos.get(mname) or ModuleInfo(mname, "?")


def _classify(scan: _Scan, mname: str, es: list, tied: set) -> None:
    m = _info(scan, mname)
    styles = {t for e in es for t in e.tags}
    if "kv_replicated" in styles:
        _kv_replicated(scan, m, es)
        return
    if not any(scan.axis in (e.mesh_spec or P()).axes for e in es):
        if "replicated_with_grad_allreduce" in styles or (scan.sp and "sequence_parallel" in styles):
            scan.grad_reduce.extend(e.fqn for e in es)
        return
    w = next((e for e in es if e.fqn.endswith(".weight") or e.fqn == "weight"), None)
    if w is None and all(e.fqn in tied for e in es):
        return  # tied to a parameter of another module, which shards it
    if w is None:
        raise NotRunnable(f"{mname}: sharded parameters {[e.fqn for e in es]} but no weight; "
                          f"meshlab shards Linear, Embedding and Conv1D modules")
    if m.kind == "embedding":
        if w.mesh_spec.dim_axes(0) != (scan.axis,):
            raise ConfigError(f"{w.fqn}: embeddings shard over the vocabulary (dim 0) only; "
                              f"got {w.mesh_spec!r}")
        scan.modules.append(TPModule(mname, VocabEmbed()))
        return
    if m.kind not in ("linear", "conv1d"):
        raise NotRunnable(
            f"{w.fqn}: {m.cls} is not a module meshlab can split (nn.Linear, "
            f"nn.Embedding, transformers Conv1D); give it a replicated spec P()")
    _linear(scan, m, es, w, styles)


def _packing(mname: str, styles: set) -> int:
    if "conv1d_packed_colwise" in styles:
        return 3
    if "packed_colwise" in styles:
        if "qkv" in mname:
            raise ConfigError(f"{mname}: packed q/k/v projections have unequal parts under "
                              f"GQA; give this module a replicated spec")
        return 2
    return 1


def _linear(scan: _Scan, m: ModuleInfo, es: list, w, styles: set) -> None:
    conv = m.kind == "conv1d"
    packed = _packing(m.fqn, styles)
    out_dim, in_dim = (1, 0) if conv else (0, 1)
    ws = w.mesh_spec
    vocab = "vocab" in (w.spec.dim_axes(out_dim) if len(w.spec) > out_dim else ())
    if ws.dim_axes(out_dim) == (scan.axis,):
        if vocab or m.fqn == scan.plan.model.head:
            if scan.in_region(m.fqn):
                raise ConfigError(f"{m.fqn}: the output head cannot sit inside a TP region")
            style = VocabHead(conv1d=conv, packed=packed,
                              gather_output="colwise_gather_output" in styles and not vocab)
        else:
            style = ColWise(conv1d=conv, packed=packed, in_region=scan.in_region(m.fqn))
        scan.modules.append(TPModule(m.fqn, style))
    elif ws.dim_axes(in_dim) == (scan.axis,):
        scan.modules.append(TPModule(m.fqn, RowWise(conv1d=conv)))
        if scan.sp:  # the bias is added to this rank's sequence shard only
            scan.grad_reduce.extend(e.fqn for e in es if e.fqn.endswith("bias"))
    else:
        raise ConfigError(f"{w.fqn}: {ws!r} does not split the weight along its input or "
                          f"output features over {scan.axis!r}")


def _kv_replicated(scan: _Scan, m: ModuleInfo, es: list) -> None:
    cfg = scan.plan.model
    H = cfg.config_get("num_attention_heads") or cfg.config_get("n_head")
    KV = cfg.config_get("num_key_value_heads") or H
    if m.kind != "linear" or H is None:
        raise ConfigError(f"{m.fqn}: K/V replication needs an nn.Linear projection in a "
                          f"model whose config gives the head counts")
    n = scan.n
    hq, g = H // n, H // KV
    if hq % g and g % hq:
        raise ConfigError(f"{m.fqn}: {H} query heads and {KV} KV heads over tp={n}: each "
                          f"rank's {hq} query heads must map to whole KV groups")
    first, count = (scan.rank * hq) // g, max(1, hq // g)
    head_dim = m.get("out_features") // KV
    scan.modules.append(TPModule(m.fqn, KVReplicated(heads=(first, count), head_dim=head_dim)))
    scan.grad_reduce.extend(e.fqn for e in es)
    scan.kv_attn[m.fqn.rsplit(".", 1)[0]] = (hq, count)


def _refuse_partial(scan: _Scan) -> None:
    """A replicated parameter that sees only this rank's part of the data has a partial
    gradient: it must be summed over tp, or the run silently diverges."""
    tp_fqns = {m.fqn for m in scan.modules}
    reduced = set(scan.grad_reduce)
    blocks = scan.plan.model.blocks
    for e in scan.plan.params:
        if e.fqn in reduced or e.module in tp_fqns or not e.requires_grad:
            continue
        partial_in_region = scan.in_region(e.module) or e.module in scan.regions
        partial_seq = scan.sp and any(e.module == b or e.module.startswith(b + ".")
                                      for b in blocks)
        if partial_in_region or partial_seq:
            raise ConfigError(
                f"{e.fqn}: replicated, but under tensor{' and sequence' if scan.sp else ''} "
                f"parallelism it sees only this rank's share of the activations, so its "
                f"gradient is partial. Mark it in the policy (style "
                f"'replicated_with_grad_allreduce', or Policy.sequence_parallel) so meshlab "
                f"sums it over {scan.axis!r}")


def _attrs(scan: _Scan) -> list:
    """Module attributes that hold global sizes and must hold this rank's share."""
    n, out = scan.n, []
    for a in scan.plan.activations:
        for attr in a.local_attrs:
            v = _info(scan, a.module).get(attr)
            if v is None:
                raise ConfigError(f"{a.module} has no integer attribute {attr!r} to divide "
                                  f"over tp; fix the policy's local_attrs")
            if v % n:
                raise ConfigError(f"{a.module}.{attr} = {v} does not divide over tp={n}")
            out.append((a.module, attr, v // n))
    for spec in scan.modules:
        if spec.style.conv1d and isinstance(spec.style, ColWise):
            nf = _info(scan, spec.fqn).get("nf")  # Conv1D reshapes its output to nf
            if nf % n:
                raise ConfigError(f"{spec.fqn}: {nf} output features do not divide over tp={n}")
            out.append((spec.fqn, "nf", nf // n))
    for attn, (hq, count) in scan.kv_attn.items():
        out.append((attn, "num_key_value_groups", hq // count))
    return out
