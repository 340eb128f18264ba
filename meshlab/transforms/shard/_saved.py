"""``shard``'s share of the activation estimate (``meshlab.estimate.activations``).

Tensor parallelism splits, by its degree n, what a rank saves between a column- and a
row-parallel linear: the outputs of column-parallel linears, the inputs of row-parallel
ones, and everything a module holding sharded linears makes itself (attention scores,
the gated MLP's products). Inputs of column-parallel linears and the residual stream
(norms, the block's adds) stay whole, unless sequence parallelism splits them over the
sequence too (a column-parallel linear then keeps its gathered input whole). Outside the blocks, a vocabulary-parallel head splits the logits and the
loss's per-token-per-word tensors.
"""

from __future__ import annotations

from ...core.names import ancestors, owner
from ...planning.plan import Plan
from ._layout import sequence_parallel


def _styles(plan: Plan, axis: str) -> dict[str, tuple[str, object]]:
    """Module FQN -> (``'col'``/``'row'``, its ModuleInfo) for modules whose weight is
    split over ``axis``."""
    mods = {m.fqn: m for m in plan.model.modules}
    out = {}
    for e in plan.params:
        if not e.fqn.endswith("weight") or e.mesh_spec is None or axis not in e.mesh_spec.axes:
            continue
        m = mods.get(e.module)
        if m is None:
            continue
        dim = next(i for i in range(len(e.shape)) if axis in e.mesh_spec.dim_axes(i))
        col = dim == (1 if m.kind == "conv1d" else 0)
        out[e.module] = ("col" if col else "row", m)
    return out


def _regions(plan: Plan, styles: dict) -> set[str]:
    """Modules inside a block (the block itself excluded) that hold a sharded linear."""
    blocks = set(plan.model.blocks)
    out = set()
    for fqn in styles:
        block = owner(fqn, blocks)
        if block is None:
            continue
        parts = fqn[len(block) + 1:].split(".")
        for i in range(1, len(parts)):
            out.add(block + "." + ".".join(parts[:i]))
    return out


_RECENT: list = []   # (params, model, axis, (styles, regions)): the tables asked last


def _styles_and_regions(plan: Plan, axis: str) -> tuple[dict, set[str]]:
    """``_styles`` and ``_regions`` of ``plan``, read-only: they follow from its parameter
    table and model alone, so the last few are kept for the plans that share those (a
    layout's saved and peak rows, the same layout with remat added)."""
    for params, model, a, got in _RECENT:
        if params is plan.params and model is plan.model and a == axis:
            return got
    styles = _styles(plan, axis)
    got = (styles, _regions(plan, styles))
    _RECENT.insert(0, (plan.params, plan.model, axis, got))
    del _RECENT[4:]
    return got


def _inside(module: str, regions: set[str]) -> bool:
    """Whether ``module`` is one of ``regions`` or lies under one (looked up by its
    ancestors, not by scanning every region)."""
    return module in regions or any(a in regions for a in ancestors(module))


def tp_activations(plan: Plan, rows: list) -> list:
    axis = plan.roles.tp
    if axis is None or plan.mesh_shape[axis] == 1:
        return rows
    n = plan.mesh_shape[axis]
    sp = sequence_parallel(plan, axis)
    styles, regions = _styles_and_regions(plan, axis)
    vocab = plan.model.config_get("vocab_size")
    head_split = plan.model.head in styles
    out = []
    for r in rows:
        if r.grad:
            out.append(r)
            continue
        style = styles.get(r.module)
        last = r.shape[-1] if r.shape else None
        if style is not None:
            kind, m = style
            is_out = last == (m.get("out_features") or m.get("nf") or m.get("embedding_dim"))
            if m.kind == "embedding":
                split = False
            elif kind == "col":
                split = is_out
            else:
                split = not is_out or sp
        elif r.in_block:
            # Under SP a column-parallel linear keeps its gathered (whole) input instead
            # of the norm's split output.
            split = _inside(r.module, regions) or (
                sp and not any(styles.get(u, ("",))[0] == "col" for u in r.users))
        elif head_split and last == vocab and r.module == "":
            out += _parallel_loss(r, n)
            continue
        else:
            split = head_split and last == vocab
        out.append(r.split(n, f"/{n} tp") if split else r)
    return out


def _parallel_loss(r, n: int) -> list:
    """The vocabulary-parallel cross-entropy (``meshlab.transforms.losses.cross_entropy`` on sharded
    logits) keeps, in place of the whole-vocabulary log-softmax, its shard of the shifted
    logits in float32 and their exponentials."""
    import dataclasses
    import math

    if r.op != "_log_softmax":
        return []               # the log-softmax's gradient and the like: not kept
    tokens = math.prod(r.shape[:-1])
    local = -(-r.shape[-1] // n)
    part = dataclasses.replace(r, op="parallel cross-entropy", dtype="float32",
                               shape=(tokens, local), bytes=float(tokens * local * 4),
                               note="vocab-parallel loss")
    return [part, dataclasses.replace(part, op="parallel cross-entropy exp")]
