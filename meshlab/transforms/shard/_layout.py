"""From a bound plan to what tensor parallelism installs: modules, regions, sums.

Pure and model-free: it reads the plan only (the module kinds and attributes ``trace``
recorded), so ``bind`` runs it on a fake mesh exactly as ``materialize`` does on a real
one, and every combination it cannot run raises ``ConfigError`` there.

Two modes. A plan whose policy marks tensor-parallel regions (``tp_region``: every
Hugging Face policy) runs the local-shard path: modules compute on local shards and the
collectives of ``_collectives`` join the regions, so within a region the specs must
agree (a projection left whole beside split ones is refused here, naming both). A plan
without regions (specs dicts on research models) runs in DTensor mode (``_dtensor``):
any consistent layout DTensor can propagate, disagreeing specs included.
"""

from __future__ import annotations

import dataclasses

from ...core.errors import ConfigError, NotRunnable
from ...core.names import ancestors
from ...planning.plan import ModuleInfo, Plan
from ...core.spec import P
from ._dtensor import dtensor_layout
from ._sp_checks import (_refuse_sp_outside_regions, _refuse_sp_regions, _refuse_sp_stacks,
                         _sp_without_regions, sequence_parallel as sequence_parallel)
from ._styles import ColWise, EmbedColWise, KVReplicated, RowWise, VocabEmbed, VocabHead
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
    # (module, its entries) marked 'replicated_with_grad_allreduce': summed over tp where
    # the module sees this rank's share, known once the regions that split nothing are
    # dropped (``_sum_partial``)
    partial: list = dataclasses.field(default_factory=list)

    def in_region(self, fqn: str) -> bool:
        """Whether ``fqn`` lies under one of the regions (its ancestors looked up)."""
        return bool(self.regions_of(fqn))

    def regions_of(self, fqn: str) -> tuple[str, ...]:
        """The regions ``fqn`` lies under (its ancestors that are regions), outermost
        first; looked up by ancestor, so a check over every module and region stays
        linear."""
        rs = self.__dict__.get("_region_set")
        if rs is None:
            rs = self.__dict__["_region_set"] = frozenset(self.regions)
        return tuple(a for a in ancestors(fqn) if a in rs)


_RECENT: list = []        # (plan, rank, result): the bound plans asked last (checks, estimates)


def _same_layout(p: Plan, plan: Plan) -> bool:
    """Whether bound plans ``p`` and ``plan`` have one TP layout: they share what
    ``_tp_layout`` reads (the parameter and activation tables, the model, the TP axis and
    its size), as a plan and the same plan with remat added do, or two meshes that differ
    in other axes (``bind`` gives them one bound table)."""
    if p is plan:
        return True
    if p.params is not plan.params or p.activations is not plan.activations or \
            p.model is not plan.model or p.roles.tp != plan.roles.tp:
        return False
    axis = plan.roles.tp
    return axis is None or p.mesh_shape[axis] == plan.mesh_shape[axis]


def tp_layout(plan: Plan, rank: int = 0) -> tuple[TPLayout | None, list[str]]:
    """The TP modules of a bound plan on tensor-parallel rank ``rank``, and the FQNs whose
    gradients are summed over the TP axis (replicated, but computed from partial data);
    the last few answers are kept, as a plan's check and estimates ask the same."""
    for p, r, (layout, reduce) in _RECENT:
        if r == rank and _same_layout(p, plan):
            return layout, list(reduce)
    layout, reduce = _tp_layout(plan, rank)
    _RECENT.insert(0, (plan, rank, (layout, tuple(reduce))))
    del _RECENT[4:]
    return layout, list(reduce)


def _tp_layout(plan: Plan, rank: int = 0) -> tuple[TPLayout | None, list[str]]:
    """The TP modules of a bound plan on tensor-parallel rank ``rank``, and the FQNs whose
    gradients are summed over the TP axis (replicated, but computed from partial data)."""
    axis = plan.roles.tp
    if axis is None:
        return None, []
    scan = _Scan(plan, axis, plan.mesh_shape[axis], rank,
                 tuple(a.module for a in plan.activations if "tp_region" in a.tags),
                 sequence_parallel(plan, axis), {m.fqn: m for m in plan.model.modules})
    _refuse_split_heads(scan)
    if scan.sp:
        _refuse_sp_stacks(scan)
    if not scan.regions:            # no policy marks regions: the model runs on DTensors
        layout = dtensor_layout(plan, axis)
        if layout is not None and scan.sp:
            raise ConfigError(_sp_without_regions(plan, axis))
        return layout, []
    by_module: dict[str, list] = {}
    for e in plan.params:
        by_module.setdefault(e.module, []).append(e)
    tied = {e.fqn for e in plan.params if e.tied_to} | \
        {e.tied_to for e in plan.params if e.tied_to}
    for mname, es in by_module.items():
        _classify(scan, mname, es, tied)
    if not scan.modules:
        return None, []
    _drop_empty_regions(scan)
    _sum_partial(scan)
    _refuse_mixed_regions(scan)
    _refuse_unpaired_rows(scan)
    _refuse_sp_outside_regions(scan)
    all_inputs = _refuse_sp_regions(scan)
    _refuse_partial(scan)
    blocks = plan.model.blocks
    layout = TPLayout(axis=axis, modules=tuple(scan.modules), regions=scan.regions,
                      sequence_parallel=scan.sp, first_block=blocks[0] if blocks else None,
                      last_block=blocks[-1] if blocks else None, attrs=tuple(_attrs(scan)),
                      head_args=tuple(_head_args(scan)), all_inputs=all_inputs)
    return layout, scan.grad_reduce


def _in_gathered(scan: "_Scan", mname: str) -> bool:
    g = scan.__dict__.get("_gathered")
    if g is None:
        g = scan.__dict__["_gathered"] = gathered_regions(scan)
    return any(a in g for a in ancestors(mname))


def _drop_empty_regions(scan: "_Scan") -> None:
    """A region where the policy splits nothing (its plan names only the embedding, say)
    is no tensor-parallel region: its modules run whole, entered and left as they are."""
    hit = set()
    for m in scan.modules:
        hit.add(m.fqn)
        hit.update(ancestors(m.fqn))
    keep = tuple(r for r in scan.regions if r in hit)
    if keep != scan.regions:
        scan.regions = keep
        scan.__dict__.pop("_region_set", None)
        scan.__dict__.pop("_gathered", None)


def _sum_partial(scan: "_Scan") -> None:
    """A module marked 'replicated_with_grad_allreduce' has its gradient summed over tp
    where it sees this rank's share of the features: inside a region that splits them,
    unless the region gathers its outputs. In a region left whole (a policy's heads
    mapped to None) it sees them all, and a sum would count its gradient tp times."""
    for mname, es in scan.partial:
        if _split_region(scan, mname) and not _in_gathered(scan, mname):
            scan.grad_reduce.extend(e.fqn for e in es)


def _split_region(scan: "_Scan", mname: str) -> bool:
    """Whether ``mname`` is, or lies in, a region that splits something."""
    return mname in scan.regions or scan.in_region(mname)


def _info(scan: "_Scan", mname: str) -> ModuleInfo:
    return scan.infos.get(mname) or ModuleInfo(mname, "?")


def _classify(scan: _Scan, mname: str, es: list, tied: set) -> None:
    m = _info(scan, mname)
    styles = {t for e in es for t in e.tags}
    if "kv_replicated" in styles:
        _kv_replicated(scan, m, es)
        return
    if not any(scan.axis in (e.mesh_spec or P()).axes for e in es):
        if scan.sp and "sequence_parallel" in styles:
            scan.grad_reduce.extend(e.fqn for e in es)
        elif "replicated_with_grad_allreduce" in styles:
            scan.partial.append((mname, es))
        return
    w = next((e for e in es if e.fqn.endswith(".weight") or e.fqn == "weight"), None)
    if w is None and all(e.fqn in tied for e in es):
        return  # tied to a parameter of another module, which shards it
    if w is None:
        raise NotRunnable(f"{mname}: sharded parameters {[e.fqn for e in es]} but no weight; "
                          f"meshlab shards Linear, Embedding and Conv1D modules")
    if m.kind == "embedding":
        scan.modules.append(TPModule(mname, _embedding(scan, m, w)))
        return
    if m.kind not in ("linear", "conv1d"):
        raise NotRunnable(
            f"{w.fqn}: {m.cls} is not a module meshlab can split (nn.Linear, "
            f"nn.Embedding, transformers Conv1D); give it a replicated spec P()")
    _linear(scan, m, es, w, styles)


def _embedding(scan: _Scan, m: ModuleInfo, w):
    """An embedding split over the vocabulary (its rows), or over its columns inside a
    region (``embedding_colwise``: T5's per-head position bias, each rank its heads)."""
    ws = w.mesh_spec
    if ws.dim_axes(0) == (scan.axis,):
        return VocabEmbed()
    if len(ws) < 2 or ws.dim_axes(1) != (scan.axis,) or ws.dim_axes(0):
        raise ConfigError(f"{w.fqn}: embeddings shard over the vocabulary (dim 0), or over "
                          f"their columns (dim 1) inside a tensor-parallel region; got {ws!r}")
    if not scan.in_region(m.fqn):
        raise ConfigError(
            f"{w.fqn}: {ws!r} splits the embedding's columns over {scan.axis!r} outside every "
            f"tensor-parallel region; its output stays split (this rank's columns), which "
            f"only a region's split features can use. List its attention module in the "
            f"policy's regions, or replicate {w.fqn} with P()")
    if w.shape[1] % scan.n:
        raise ConfigError(f"{w.fqn} {w.shape}: {w.shape[1]} columns do not divide over "
                          f"{scan.axis!r} (size {scan.n}); replicate it with P() or use a "
                          f"{scan.axis!r} size that divides {w.shape[1]}")
    return EmbedColWise()


def _packing(mname: str, styles: set, check: bool = True) -> int:
    """How many parts a fused projection packs (q|k|v: 3); ``check`` refuses the packed
    q/k/v whose parts differ under GQA."""
    if "conv1d_packed_colwise" in styles or "packed_qkv_colwise" in styles:
        return 3
    if "packed_colwise" in styles:
        if check and "qkv" in mname:
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
        elif GATHER in styles:
            _gathered_divides(scan, w, out_dim)
            style = ColWise(conv1d=conv, in_region=scan.in_region(m.fqn), gather_output=True)
        else:
            style = ColWise(conv1d=conv, packed=packed, in_region=scan.in_region(m.fqn))
        scan.modules.append(TPModule(m.fqn, style))
    elif ws.dim_axes(in_dim) == (scan.axis,):
        if SPLIT_INPUT in styles:
            _gathered_divides(scan, w, in_dim)
        scan.modules.append(TPModule(m.fqn, RowWise(conv1d=conv,
                                                    split_input=SPLIT_INPUT in styles)))
        if scan.sp:  # the bias is added to this rank's sequence shard only
            scan.grad_reduce.extend(e.fqn for e in es if e.fqn.endswith("bias"))
    else:
        raise ConfigError(f"{w.fqn}: {ws!r} does not split the weight along its input or "
                          f"output features over {scan.axis!r}")


# Hugging Face's styles whose output is gathered again / whose whole input is sliced
GATHER, SPLIT_INPUT = "colwise_gather_output", "rowwise_split_input"


def _gathered_divides(scan: _Scan, w, dim: int) -> None:
    """A gathered output (or sliced input) is joined by an all-gather of equal parts."""
    if w.shape[dim] % scan.n:
        raise ConfigError(f"{w.fqn} {tuple(w.shape)}: its {w.shape[dim]} features (dim {dim}) "
                          f"do not divide over {scan.axis!r} (size {scan.n}), and a gathered "
                          f"output is joined from equal parts; replicate it with P() or use "
                          f"a {scan.axis!r} size that divides {w.shape[dim]}")


def gathered_regions(scan: _Scan) -> frozenset:
    """Regions whose split projections all gather their outputs (or slice a whole input):
    everything between runs on all features, so replicated parameters there see the
    whole activations and their gradients are whole."""
    by_region: dict[str, set] = {}
    for e in scan.plan.params:
        if scan.axis not in (e.mesh_spec or P()).axes or not e.fqn.endswith("weight"):
            continue
        inside = scan.regions_of(e.module)
        r = min(inside, key=scan.regions.index) if inside else None
        if r is not None:
            by_region.setdefault(r, set()).add(
                GATHER in e.tags or SPLIT_INPUT in e.tags)
    return frozenset(r for r, kinds in by_region.items() if kinds == {True})


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


def _refuse_mixed_regions(scan: _Scan) -> None:
    """Inside a region the local-shard path runs every projection on this rank's share of
    the features, and the region's split outputs are joined by a row-parallel module: a
    projection left whole beside split ones, or a split region nothing joins, computes on
    mismatched shapes (or silently on the wrong heads)."""
    styles = {m.fqn: m.style for m in scan.modules}
    # replicated on purpose beside split peers (LoRA's factors): whole gradients, or
    # partial ones summed over tp
    whole_ok = {e.module for e in scan.plan.params
                if {"full_grad", "replicated_with_grad_allreduce"} & set(e.tags)}
    by_region: dict[str, list] = {}
    for m in scan.plan.model.modules:
        if m.kind in ("linear", "conv1d") and m.fqn not in whole_ok:
            for r in scan.regions_of(m.fqn):
                by_region.setdefault(r, []).append(m)
    # regions a row-parallel module sits in; modules that one outside every region is under
    rows_in, rows_out_under, rows_out = set(), set(), False
    for f, st in styles.items():
        if isinstance(st, RowWise):
            inside = scan.regions_of(f)
            rows_in.update(inside)
            if not inside:
                rows_out = True
                rows_out_under.update(ancestors(f))
    for r in scan.regions:
        inside = by_region.get(r, [])
        split = [m for m in inside if m.fqn in styles]
        whole = [m for m in inside if m.fqn not in styles]
        if split and whole:
            raise ConfigError(_mixed_message(scan, r, split[0], whole[0]))
        col = [m.fqn for m in split if isinstance(styles[m.fqn], ColWise)]
        parent = r.rpartition(".")[0]
        # a row-parallel module inside the region, or after it outside any
        joined = r in rows_in or (rows_out and (not parent or parent in rows_out_under))
        if col and not joined:
            raise ConfigError(
                f"{col[0]}: split over {scan.axis!r} on its output features inside the "
                f"tensor-parallel region {r}, but no row-parallel module in "
                f"{parent or 'the model'} joins the region's split outputs again. Shard the "
                f"projection that reads {r}'s output on its input features (an nn.Linear "
                f"weight P(None, {scan.axis!r})), or drop {r} from the policy's regions so "
                f"the model runs in DTensor mode, where DTensor redistributes")


def _mixed_message(scan: _Scan, region: str, peer: ModuleInfo, whole: ModuleInfo) -> str:
    specs = {e.module: e for e in scan.plan.params if e.fqn.endswith("weight")}
    ps, ws = specs.get(peer.fqn), specs.get(whole.fqn)
    row = _reads_split(scan, region, peer, whole)
    out_dim = 1 if whole.kind == "conv1d" else 0
    fix = [None, None]
    fix[(1 - out_dim) if row else out_dim] = scan.axis
    how = "on its input features (row-parallel: it reads the split features)" if row else \
        "on its output features, as its peer (column-parallel: it reads the region's input)"
    return (f"{whole.fqn}: replicated ({ws.spec if ws else P()!r}) inside the "
            f"tensor-parallel region {region}, where {peer.fqn} is split over {scan.axis!r} "
            f"({ps.spec if ps else '?'!r} -> {ps.mesh_spec if ps else '?'!r}); the "
            f"local-shard path runs each module of a region on this rank's share of the "
            f"features, so {peer.fqn} and {whole.fqn} disagree. Shard {whole.fqn}.weight "
            f"{how}: P{tuple(fix)!r}, or drop {region} from the policy's regions so the "
            f"model runs in DTensor mode, where DTensor redistributes between them")


def _reads_split(scan: _Scan, region: str, peer: ModuleInfo, whole: ModuleInfo) -> bool:
    """Whether ``whole`` most likely reads ``peer``'s split output (so the fix is
    row-parallel) rather than the region's input (column-parallel), from feature sizes
    and, where they are square, from where the region's outputs are joined."""
    inside = [m for m in scan.plan.model.modules
              if m.fqn.startswith(region + ".") and m.kind in ("linear", "conv1d")]
    width = inside[0].get("in_features")
    n_in = whole.get("in_features")
    reads_input, reads_peer = n_in == width, n_in == peer.get("out_features")
    if reads_input != reads_peer:
        return reads_peer
    parent = region.rpartition(".")[0]
    joined_outside = any(isinstance(m.style, RowWise) and not scan.in_region(m.fqn) and
                         (not parent or m.fqn.startswith(parent + ".")) for m in scan.modules)
    return whole.fqn == inside[-1].fqn and not joined_outside


def _refuse_unpaired_rows(scan: _Scan) -> None:
    """A row-parallel module runs on this rank's share of its input features, which a
    column-parallel module of the region it joins has split. With none (only ``down_proj``
    sharded, outside any region or alone in one), its whole input meets a slice of its
    weight and the forward fails on mismatched shapes."""
    styles = {m.fqn: m.style for m in scan.modules}
    cols = {r for f, st in styles.items() if isinstance(st, ColWise) for r in scan.regions_of(f)}
    split = [r for r in scan.regions if r in cols]
    split_set = set(split)
    parents = {r.rpartition(".")[0] for r in split}
    for f, st in styles.items():
        if not isinstance(st, RowWise) or st.split_input:
            continue
        inside = scan.regions_of(f)          # _joins over every split region, by ancestor
        if split_set.intersection(inside) or (
                not inside and ("" in parents or parents.intersection(ancestors(f)))):
            continue
        e = next((e for e in scan.plan.params if e.module == f and e.fqn.endswith("weight")),
                 None)
        spec = f" ({e.spec!r} -> {e.mesh_spec!r})" if e is not None else ""
        where = next((r for r in scan.regions if f.startswith(r + ".")), None)
        place = f"inside the tensor-parallel region {where}" if where else \
            "outside every tensor-parallel region"
        out_spec = "P(None, 'tp')" if st.conv1d else "P('tp', None)"
        raise ConfigError(
            f"{f}: split over {scan.axis!r} on its input features{spec} (row-parallel), "
            f"{place}, but no column-parallel module splits the features it reads: the "
            f"local-shard path would multiply its whole input by this rank's slice of the "
            f"weight. Shard the projections that feed {f} on their output features (a "
            f"weight {out_spec.replace('tp', scan.axis)}) in a region it joins, or replicate "
            f"{f}.weight with P()")


def _is_attention(info: ModuleInfo | None) -> bool:
    return info is not None and ("Attention" in info.cls or "Attn" in info.cls)


def _head_dim(scan: _Scan, attn: ModuleInfo) -> int | None:
    """The width of one head of attention module ``attn``: its own integer attribute,
    else the config's ``head_dim``, else the hidden size over the head count."""
    for attr in ("head_dim", "attention_head_size", "head_size"):
        if attn.get(attr):
            return attn.get(attr)
    model = scan.plan.model
    if model.config_get("head_dim"):
        return model.config_get("head_dim")
    hidden = model.config_get("hidden_size") or model.config_get("n_embd")
    heads = model.config_get("num_attention_heads") or model.config_get("n_head")
    return hidden // heads if hidden and heads and hidden % heads == 0 else None


def _refuse_split_heads(scan: _Scan) -> None:
    """Attention projections split on their output features are split at head
    boundaries: each rank must hold whole heads (of each packed part), or the forward's
    reshape to (batch, seq, heads, head_dim) fails on the local shard, and DTensor cannot
    unflatten a dim split mid-head. Logical ``kv_heads`` fewer than the shards are
    replicated by ``bind``; mesh-axis specs and axis overrides arrive here as written."""
    for e in scan.plan.params:
        m = scan.infos.get(e.module)
        if m is None or m.kind not in ("linear", "conv1d") or e.mesh_spec is None or \
                e.fqn != f"{e.module}.weight":
            continue
        out_dim = 1 if m.kind == "conv1d" else 0
        attn = scan.infos.get(e.module.rpartition(".")[0])
        if scan.axis not in e.mesh_spec.dim_axes(out_dim) or not _is_attention(attn) or \
                GATHER in e.tags:       # gathered again before any reshape by heads
            continue
        hd, parts = _head_dim(scan, attn), _packing(e.module, set(e.tags), check=False)
        out = e.shape[out_dim]
        if parts == 3 and hd:
            _refuse_unequal_parts(scan, e, attn, hd, out)
        if not hd or out % (hd * parts) or (out // (hd * parts)) % scan.n == 0:
            continue
        heads = out // (hd * parts)
        raise ConfigError(
            f"{e.fqn} {e.shape}: {e.spec!r} -> {e.mesh_spec!r} splits the {heads} "
            f"head{'s' if heads != 1 else ''} "
            f"(head_dim {hd}{f', in each of {parts} packed parts' if parts > 1 else ''}) of "
            f"{e.module} over {scan.axis!r} (size {scan.n}), but {heads} % {scan.n} != 0: "
            f"a rank would hold part of a head, and the attention's reshape to (batch, seq, "
            f"heads, head_dim) fails. Replicate it with P(), spell the dim with the logical "
            f"axis 'kv_heads' (K/V heads fewer than the shards are then replicated), or use "
            f"a {scan.axis!r} size that divides {heads}")


def _refuse_unequal_parts(scan: _Scan, e, attn: ModuleInfo, hd: int, out: int) -> None:
    """A packed q|k|v style splits three equal parts, each over the TP axis. A fused
    projection whose K and V have fewer heads than q (grouped or multi-query K/V packed
    behind the queries, as ChatGLM2's ``query_key_value``) packs unequal parts: three equal
    cuts would hand each rank queries for keys, so it is refused. The part widths must be
    whole heads and, where the config describes this attention (its head_dim derived from
    the config's head count), q's width that head count's."""
    model = scan.plan.model
    heads = model.config_get("num_attention_heads") or model.config_get("n_head")
    own_hd = any(attn.get(a) for a in ("head_dim", "attention_head_size", "head_size"))
    if out % (3 * hd) == 0 and (own_hd or not heads or out == 3 * heads * hd):
        return
    q = f"{heads} heads x {hd}" if heads and not own_hd else f"whole heads of {hd}"
    raise ConfigError(
        f"{e.fqn} {e.shape}: {e.tags[0] if e.tags else 'packed'} splits three equal parts "
        f"(q|k|v, each {q} features), but it has {out} output features: its parts differ "
        f"(K/V of fewer heads than the queries, packed behind them), and three equal cuts "
        f"would give each rank the wrong heads. Leave this attention whole: 'replicate' its "
        f"projections and drop it from the policy's regions (its MLP can still be split), "
        f"or shard a layout with one K/V head per query head")


def _head_args(scan: _Scan) -> list:
    """``(module, keyword, dim, heads, first, count)`` for each tensor argument that
    carries every head (``Policy.head_args``): this rank keeps heads [first, first+count),
    the contiguous share its split projections hold."""
    from ...policies._policy import parse_head_arg

    out = []
    for a in scan.plan.activations:
        if not _split_region(scan, a.module):
            continue
        for tag in a.tags:
            parsed = parse_head_arg(tag)
            if parsed is None:
                continue
            kw, attr, dim = parsed
            heads = _info(scan, a.module).get(attr)
            if heads is None or heads % scan.n:
                raise ConfigError(
                    f"{a.module}.{kw}: carries one slice per head, counted by {attr!r} "
                    f"({heads}), which must be an integer attribute that divides over "
                    f"tp={scan.n}; fix the policy's head_args or the tp size")
            count = heads // scan.n
            out.append((a.module, kw, dim, heads, scan.rank * count, count))
    return out


def _refuse_partial(scan: _Scan) -> None:
    """A replicated parameter that sees only this rank's part of the data has a partial
    gradient: it must be summed over tp, or the run silently diverges."""
    tp_fqns = {m.fqn for m in scan.modules}
    reduced = set(scan.grad_reduce)
    blocks = scan.plan.model.blocks
    for e in scan.plan.params:
        if e.fqn in reduced or e.module in tp_fqns or not e.requires_grad:
            continue
        if "full_grad" in e.tags and not scan.sp:
            continue          # replicated, its gradient whole on every rank (LoRA's factors)
        partial_in_region = (scan.in_region(e.module) or e.module in scan.regions) and \
            not _in_gathered(scan, e.module)
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
        if not _split_region(scan, a.module):    # its projections run whole
            continue
        for attr in a.local_attrs:
            v = _info(scan, a.module).get(attr)
            if v is None:
                raise ConfigError(f"{a.module} has no integer attribute {attr!r} to divide "
                                  f"over tp; fix the policy's local_attrs")
            if v % n:
                raise ConfigError(
                    f"{a.module}.{attr} = {v} does not divide over tp={n}: the policy gives "
                    f"each rank 1/{n} of {a.module}'s projections, and its forward reshapes "
                    f"by {attr}, so a rank would hold part of one of them. "
                    + (f"Use a tp size that divides {v}, or replicate" if v > 1 else
                       "With one, it cannot be split: replicate") +
                    f" {a.module}'s projections with P()")
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
