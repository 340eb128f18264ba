"""DTensor mode: tensor parallelism for models whose specs mark no tensor-parallel regions.

A model sharded by a specs dict (``shard({'blocks.*.attn.q.weight': P('heads', None)},
rules)``), or by a policy without ``regions``, runs its own ``forward`` on DTensors, and
sharding propagates through it as it does in JAX:

* every parameter is a DTensor over the tensor-parallel axis: ``Shard(d)`` on the dim its
  spec gives that axis, ``Replicate()`` where it gives none. Nothing is swapped for local
  shards, so shapes inside the forward are global and natural code
  (``q.view(B, S, self.n_heads, self.head_dim)``) runs as written;
* a root forward pre-hook makes the model's tensor inputs DTensors (``Replicate`` over
  the axis: tensor-parallel peers receive the same batch) and a root post-hook turns the
  outputs back into plain tensors (``full_tensor``; ``to_local`` where replicated), so the
  loss and everything after the model is ordinary code;
* a tensor the forward creates itself (``torch.arange(S)``, a causal mask) is read as
  replicated where it meets a DTensor, as JAX reads an unsharded array: a
  ``TorchFunctionMode`` lifts it above autograd, so the backward sees DTensors only;
* a block's output leaves it reduced (no pending sum crosses a block boundary, so the
  next block's linear layers reduce activations rather than gather weights), and a block
  recomputed on its own (activation checkpointing) re-enters the model's layout;
* ``meshlab.constrain`` is ``redistribute`` there (``P('batch', 'tp', None)`` on the
  residual stream is sequence parallelism), and ``meshlab.shard_map`` runs a function on
  the local blocks.

Gradients: DTensor's autograd gives every parameter its gradient over the axis. A
replicated parameter that saw sharded activations gets a pending sum (``Partial``); a
post-accumulate-grad hook redistributes each gradient to its parameter's placements, so
after the backward ``p.grad`` is laid out as ``p`` and every later consumer (data-parallel
averaging of the local tensor, norms, ZeRO-1, checkpoints) reads a finished gradient, and
``Shard.reductions`` declares no sum over tp. Where specs disagree (only ``q`` split,
``up`` split with ``down`` whole), DTensor redistributes between the modules: slower,
never wrong.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ...core.context import (ModelLayout, current_layout, enter_layout, exit_layout,
                         in_local_region, register_layout)
from ...core.errors import NotRunnable
from ...planning.plan import Plan
from ...core.spec import P
from ._tp import TPLayout, TPModule


@dataclasses.dataclass(frozen=True)
class Placed:
    """The placements of one module's parameters over the TP axis: ``Shard(d)`` on the dim
    the spec gives the axis, else ``Replicate()``. The module runs its own forward on them."""

    dims: tuple[tuple[str, int | None], ...] = ()   # (parameter name, sharded dim or None)
    conv1d: bool = False                            # styles carry it; never special here

    def placements(self, name: str, ndim: int):
        from torch.distributed.tensor import Replicate, Shard

        d = dict(self.dims).get(name)
        return (Replicate(),) if d is None else (Shard(d),)


def dtensor_layout(plan: Plan, axis: str) -> TPLayout | None:
    """The DTensor-mode layout of a bound plan (pure): every module with parameters and
    the dim each parameter is split on over ``axis`` (None: replicated). None when no
    parameter is split over ``axis``."""
    mods: dict[str, list] = {}
    split = False
    for e in plan.params:
        ms = e.mesh_spec or P()
        dims = [d for d in range(len(ms)) if axis in ms.dim_axes(d)]
        if dims and ms.dim_axes(dims[0]) != (axis,):
            raise NotRunnable(
                f"{e.fqn} {e.shape}: {ms!r} splits dim {dims[0]} over "
                f"{ms.dim_axes(dims[0])} together; without a policy the model runs on "
                f"DTensors over {axis!r}, which split a dim over {axis!r} alone. Give "
                f"{axis!r} a dim of its own (P('dp', '{axis}') composes FSDP over dp with "
                f"it) or write a policy for the model (docs/policies.md)")
        leaf = e.fqn[len(e.module) + 1:] if e.module else e.fqn
        mods.setdefault(e.module, []).append((leaf, dims[0] if dims else None))
        split = split or bool(dims)
    if not split:
        return None
    _refuse_hf_attention(plan, axis)
    return TPLayout(axis=axis, modules=tuple(TPModule(m, Placed(tuple(v)))
                                             for m, v in mods.items()), dtensor=True)


def _refuse_hf_attention(plan: Plan, axis: str) -> None:
    """Hugging Face attention has not been shown to run on DTensors (its masks, rotary
    tables and cache code index plain tensors): a Hugging Face model whose attention is
    split by glob specs is refused, and its policy is the way to split it."""
    if plan.model.config_get("model_type") is None:
        return
    cls = {m.fqn: m.cls for m in plan.model.modules}
    for e in plan.params:
        ms = e.mesh_spec or P()
        parent = e.module.rpartition(".")[0]
        if axis in ms.axes and any(w in (cls.get(parent) or "") for w in ("Attention", "Attn")):
            raise NotRunnable(
                f"{e.fqn}: glob specs split a Hugging Face attention module "
                f"({cls.get(parent)}) over {axis!r} with no policy, which would run it on "
                f"DTensors, and Hugging Face attention is not shown to run that way. Use the "
                f"family's policy: shard(policies.auto, rules), adding your globs with "
                f"| shard({{...}})")


def model_layout(ctx, tp_mesh=None) -> ModelLayout:
    """What ``constrain`` and ``shard_map`` read inside this model's forward."""
    return ModelLayout(mesh=ctx.mesh, rules=ctx.plan.rules,
                       data_axes=tuple(ctx.roles.data or ()), tp_axis=ctx.roles.tp,
                       tp_mesh=tp_mesh)


class _Replicated(TorchFunctionMode):
    """A plain tensor meeting a DTensor of ``mesh`` in one op is read as replicated.

    Lifted above autograd (``DTensor.from_local``), so the backward of that op sees
    DTensors only. Not inside ``shard_map``'s body, where plain tensors are local blocks:
    a DTensor parameter used there raises DTensor's own mixed-tensor error instead of
    computing with a local block read as the whole tensor."""

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh

    def _ours(self, a) -> bool:
        from torch.distributed.tensor import DTensor

        return isinstance(a, DTensor) and (a.device_mesh is self.mesh or
                                           a.device_mesh == self.mesh)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor, Replicate

        kwargs = kwargs or {}
        # Under torch.compile (compile_blocks) no shard_map body is traced (shard_map reads
        # the layout context, which dynamo cannot trace), and neither can this read be.
        if not torch.compiler.is_compiling() and in_local_region():
            return func(*args, **kwargs)
        flat, spec = pytree.tree_flatten((args, kwargs))
        plain = [isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.dim() > 0
                 for a in flat]
        if _data_dependent(func, args, kwargs) and any(self._ours(a) for a in flat):
            local = _replicated_locals(flat)
            if local is not None:     # every rank holds the same input: the same output
                out = func(*pytree.tree_unflatten(local, spec)[0],
                           **pytree.tree_unflatten(local, spec)[1])
                return pytree.tree_map(_to_dtensor(self.mesh), out)
        if any(plain) and any(self._ours(a) for a in flat):
            rep = (Replicate(),) * self.mesh.ndim
            flat = [DTensor.from_local(a, self.mesh, rep, run_check=False) if p else a
                    for a, p in zip(flat, plain)]
            args, kwargs = pytree.tree_unflatten(flat, spec)
        return func(*args, **kwargs)


# Deterministic ops DTensor has no sharding rule for: those whose output shape depends on
# the values (an MoE router's ``nonzero`` over its expert mask) and ``unfold`` (a
# convolution's sliding windows). On replicated inputs every rank computes the same
# result, so they run on the local tensors (differentiably: ``to_local``/``from_local``)
# and the result is replicated; on a sharded input DTensor's own error stands.
_DATA_DEPENDENT = frozenset({
    torch.Tensor.unfold,
    torch.nonzero, torch.Tensor.nonzero, torch.argwhere, torch.Tensor.argwhere,
    torch.unique, torch.Tensor.unique, torch.masked_select, torch.Tensor.masked_select,
    torch.Tensor.nonzero_static, torch.bincount, torch.Tensor.bincount,
})


def _data_dependent(func, args, kwargs) -> bool:
    return func in _DATA_DEPENDENT or (func is torch.where and len(args) + len(kwargs) == 1)


def _replicated_locals(flat):
    """The local tensors of ``flat`` when every DTensor in it is replicated, else None
    (a sharded input: DTensor's own error stands)."""
    from torch.distributed.tensor import DTensor, Replicate

    out = []
    for a in flat:
        if isinstance(a, DTensor):
            if not all(isinstance(p, Replicate) for p in a.placements):
                return None
            a = a.to_local()
        out.append(a)
    return out


def _settle_grad(p) -> None:
    """After accumulation: the gradient laid out as its parameter (a pending sum of a
    replicated parameter is all-reduced, of a sharded one reduce-scattered)."""
    from torch.distributed.tensor import DTensor

    g = p.grad
    if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
        p.grad = g.redistribute(p.device_mesh, p.placements)


def _to_dtensor(mesh):
    from torch.distributed.tensor import DTensor, Replicate

    rep = (Replicate(),) * mesh.ndim

    def conv(x):
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
            return DTensor.from_local(x, mesh, rep, run_check=False)
        return x
    return conv


def _to_plain(x):
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(x, DTensor):
        return x
    if all(isinstance(p, Replicate) for p in x.placements):
        return x.to_local()
    return x.full_tensor()


def install_context(model: nn.Module, layout: ModelLayout, *, convert: bool = False) -> None:
    """Root hooks marking this model's forward for ``constrain`` and ``shard_map``; with
    ``convert`` (DTensor mode) they also make the inputs DTensors, read plain tensors
    made inside as replicated, and return plain outputs. The post-hook runs even when the
    forward raises, so nothing leaks into the code after the model."""
    stack: list = []
    lift = _to_dtensor(layout.tp_mesh) if convert else None

    def pre(_m, args, kwargs):
        if convert:
            args, kwargs = pytree.tree_map(lift, args), pytree.tree_map(lift, kwargs)
        mode = _Replicated(layout.tp_mesh) if convert else None
        token = enter_layout(layout)
        if mode is not None:
            mode.__enter__()
        stack.append((token, mode))
        return (args, kwargs) if convert else None

    def post(_m, _args, _kwargs, out):
        if not stack:            # an earlier pre-hook raised before ours ran
            return None
        token, mode = stack.pop()
        try:
            if convert and out is not None:
                return pytree.tree_map(_to_plain, out)
            return None
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)
            exit_layout(token)

    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post, with_kwargs=True, always_call=True)


def _reduce_pending(_m, _args, out):
    """A block's output leaves it reduced. DTensor keeps a sum pending (``Partial``) as
    long as the ops allow; carried into the next block it would reach the linear layers,
    which would then all-gather their weights rather than reduce the activation."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    def settle(x):
        if isinstance(x, DTensor) and any(isinstance(p, Partial) for p in x.placements):
            return x.redistribute(x.device_mesh, [Replicate() if isinstance(p, Partial) else p
                                                  for p in x.placements])
        return x
    return pytree.tree_map(settle, out)


def _vocab_lookup(m: nn.Module, mesh) -> None:
    """A vocabulary-split embedding looks up its own rows and sums (``VocabEmbed``).

    On DTensors the lookup would leave a masked pending sum that DTensor reduces only
    while the lookup's mask lives, and whose backward it cannot take from a plain pending
    sum; the embedding's output is a plain replicated tensor instead, which the mode
    reads as replicated where it meets a DTensor."""
    from torch.distributed.tensor import DTensor

    from ._styles import TPGroup, VocabEmbed

    tp = TPGroup(mesh=mesh, group=mesh.get_group(), rank=mesh.get_local_rank(),
                 size=mesh.size(), sp=False)
    pre, post = VocabEmbed().hooks(m, tp)

    def local_pre(mod, args):
        return pre(mod, tuple(a.to_local() if isinstance(a, DTensor) else a for a in args))
    m.register_forward_pre_hook(local_pre)
    m.register_forward_hook(post)


def _within(forward, layout: ModelLayout):
    """A block's ``forward`` that re-enters the model's layout and mode when called on its
    own: activation checkpointing recomputes the block in the backward, outside the
    root forward (``remat`` wraps this, so its recomputation calls it)."""
    @functools.wraps(forward)
    def run(*args, **kwargs):
        # A compiled block is traced inside the root forward, the layout entered and the
        # mode on the stack (dynamo guards on the mode stack), where dynamo could not read
        # the layout's context variable.
        if torch.compiler.is_compiling() or current_layout() is layout:
            return forward(*args, **kwargs)
        token = enter_layout(layout)
        try:
            with _Replicated(layout.tp_mesh):
                return forward(*args, **kwargs)
        finally:
            exit_layout(token)
    return run


def install(model: nn.Module, layout: ModelLayout, blocks=()) -> None:
    """DTensor mode on a model whose parameters are already DTensors (``_Setup``)."""
    from torch.distributed.tensor import DTensor

    register_layout(layout)
    seen: set[int] = set()
    for p in model.parameters():
        if isinstance(p, DTensor) and p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            p.register_post_accumulate_grad_hook(_settle_grad)
    mods = dict(model.named_modules())
    for m in mods.values():
        w = getattr(m, "weight", None)
        if isinstance(m, nn.Embedding) and isinstance(w, DTensor) and any(
                getattr(p, "dim", None) == 0 for p in w.placements):
            _vocab_lookup(m, layout.tp_mesh)
    for b in blocks:
        if b in mods:
            mods[b].forward = _within(mods[b].forward, layout)
            mods[b].register_forward_hook(_reduce_pending)
    install_context(model, layout, convert=True)
