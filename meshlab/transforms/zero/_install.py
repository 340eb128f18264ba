"""What ``zero_shard`` installs and the parts that synchronize gradients at run time."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from .._gradsync import reduce_dtype, require_mesh_optimizer
from .._install import StageRoots
from .._protocol import Part
from ..precision import Precision
from ._batchnorm import BatchStatistics, install as install_batch_statistics
from ._owned import Zero1Whole
from ._zero1 import Zero1Buffers


class HostUnits:
    """The kind of decision a room that keeps parameters in host memory records in
    ``bind`` (``offload``'s ``Choice``): ``units``, the FSDP2 units whose parameters
    stay there (``''``: the root). This room reads it from the plan by this type."""

    units: tuple


@dataclasses.dataclass(frozen=True)
class HostResidency:
    """What a room that keeps training state in host memory (``offload``) tells this
    room's install, from its ``prepare``: the FSDP2 ``units`` whose shards stay on the host
    (``''``: the root), whether those are ``pinned``, and the parameters whose optimizer
    state lives on the host (``optimizer_host``: ZeRO-1 buckets them apart)."""

    units: tuple[str, ...] = ()
    pinned: bool = False
    optimizer_host: frozenset = frozenset()


class UnusedGrads:
    """Parameters without a gradient under FSDP2, as one process treats them.

    FSDP2 reduce-scatters the gradients a rank has: a parameter that one data rank's batch
    used and another's did not would give the ranks reduce-scatters of different sizes (a
    collective mismatch). Each unit therefore reduce-scatters zeros for the parameters a
    rank has no gradient for (FSDP2's ``reduce_scatter_unused_params``), so the sum is one
    process's; and each unit's post-backward records which parameters this rank had a
    gradient for, which the end of the backward that reduces sums over the data ranks
    (one all-reduce of one element per parameter): a parameter no rank had a gradient for
    gets ``grad=None`` back, so the optimizer skips it (no weight decay, no moment update)
    as one process's does, instead of stepping the zeros. Only a rank that missed a
    gradient of its own reads the counts."""

    def __init__(self, root, group, device):
        from torch.distributed.fsdp import FSDPModule

        self.group, self.device = group, device
        self.had: dict[int, bool] = {}
        self.queued = False
        managed: set[int] = set()
        for m in root.modules():
            if not isinstance(m, FSDPModule):
                continue
            pg = m._get_fsdp_state()._fsdp_param_group
            if pg is None:
                continue
            managed |= {id(fp.sharded_param) for fp in pg.fsdp_params}
            self._wrap(pg)
        self.params = [p for p in root.parameters() if id(p) in managed and p.requires_grad]

    def _wrap(self, pg) -> None:
        inner = pg.post_backward

        def post_backward(*args):
            for fp in pg.fsdp_params:
                up = getattr(fp, "_unsharded_param", None)
                got = up is not None and (fp.unsharded_accumulated_grad is not None or
                                          up.grad is not None)
                key = id(fp.sharded_param)
                self.had[key] = self.had.get(key, False) or got
                if pg.reduce_grads and not self.had[key] and up is not None \
                        and fp.sharded_param.requires_grad:
                    # reduce-scatter zeros for it, so every rank runs the same collectives
                    # (FSDP2's set_reduce_scatter_unused_params, which torch 2.11 lacks)
                    up.grad = torch.zeros_like(up)
            if pg.reduce_grads and not self.queued:
                self.queued = True
                if torch._C._current_graph_task_id() != -1:
                    torch.autograd.Variable._execution_engine.queue_callback(self.finish)
                # else a pipeline schedule runs this unit's post-backward itself, after
                # its microbatches' backwards: the counts are summed at the optimizer's
                # step (FSDPPart.sync_grads), once every unit has reported
            return inner(*args)

        pg.post_backward = post_backward

    def flush(self) -> None:
        """Sum the counts a pipeline's post-backward left pending (``_wrap``)."""
        if self.queued:
            self.finish()

    def finish(self) -> None:
        import torch.distributed as dist

        self.queued = False
        had = [self.had.get(id(p), False) for p in self.params]
        self.had.clear()
        if not self.params:
            return
        counts = torch.tensor(had, dtype=torch.float32, device=self.device)
        dist.all_reduce(counts, group=self.group)
        if all(had):                # every parameter had a gradient here: none is unused
            return
        for p, n in zip(self.params, counts.tolist()):
            if n == 0:
                p.grad = None


@dataclasses.dataclass
class FSDPPart(Part):
    """Stages 2/3: FSDP2 reduce-scatters (and averages) the gradients in backward;
    parameters it leaves replicated are all-reduced by ``GradSync``. ``roots``: the FSDP2
    roots, the model or, under a pipeline, each stage module (``StageRoots``), filled as
    the stages are built. Parameters no data rank has a gradient for keep none
    (``UnusedGrads``)."""

    casts_params: ClassVar[bool] = True
    roots: list = dataclasses.field(default_factory=list)

    def set_gradient_sync(self, model, enabled: bool) -> None:
        for root in self.roots:
            root.set_requires_gradient_sync(enabled)

    def sync_grads(self, params: list) -> None:
        """The counts of parameters with a gradient that a pipeline's schedule left
        pending (it runs the units' post-backward outside the backward)."""
        for root in self.roots:
            unused = getattr(root, "_meshlab_unused", None)
            if unused is not None:
                unused.flush()


@dataclasses.dataclass
class Zero1Part(Part):
    """Stage 1: for an elementwise optimizer the inner optimizer updates fp32 slices
    (``Zero1Buffers``); gradients are reduce-scattered into them and the updated slices
    all-gathered back. For any other (``whole=True``: LAMB, Adafactor, Muon, ...) each
    parameter is owned by one data rank, which steps the whole tensor (``Zero1Whole``);
    ``owners`` then records which rank steps which parameter (FQN -> data rank)."""

    order: ClassVar[int] = 10
    reduced: ClassVar[bool] = False     # whether the backward already averaged the gradients
    group: Any
    size: int
    buffers: Zero1Buffers | Zero1Whole | None = None
    apart: frozenset = frozenset()      # FQNs bucketed on their own (offload's host ones)
    reduce: Any = None                  # the dtype gradients are reduce-scattered in
    device: Any = None                  # where the collectives run (the mesh's device)

    def optimizer_params(self, params: list, group_of=None, whole: bool = False
                         ) -> list | None:
        if self.size == 1:
            return None
        if whole:
            self.buffers = Zero1Whole(list(params), self.group, self.size, group_of or {},
                                      reduce=self.reduce)
            return self.buffers.shards
        self.buffers = Zero1Buffers([p for _, p in params], self.group, self.size,
                                    frozenset(id(p) for n, p in params if n in self.apart),
                                    group_of or {}, reduce=self.reduce,
                                    names={id(p): n for n, p in params},
                                    reduced=self.reduced, device=self.device)
        return self.buffers.shards

    @property
    def whole(self) -> bool:
        """Whether the optimizer steps whole parameters, each on its owner."""
        return isinstance(self.buffers, Zero1Whole)

    @property
    def owners(self) -> dict | None:
        """FQN -> the data rank that steps that parameter (whole-tensor mode), else None."""
        return self.buffers.owners if self.whole else None

    def sync_grads(self, params: list) -> None:
        if self.buffers is not None:
            self.buffers.sync()

    def grad_items(self, items: list) -> list:
        if self.buffers is None:
            return items
        if self.whole:
            return self.buffers.grad_items()
        return [(s.grad, b.groups + (self.group,)) for s, b in
                zip(self.buffers.shards, self.buffers.buckets) if s.grad is not None]

    def after_step(self) -> None:
        if self.buffers is not None:
            self.buffers.gather()

    def refresh_master(self) -> None:
        """After a load of the weights: the fp32 master slices take their values."""
        if self.buffers is not None:
            self.buffers.refresh_master()

    def stepped(self) -> list:
        """Each bucket with this rank's fp32 slice of it (none on one data rank)."""
        if self.buffers is None:
            return []
        return list(zip(self.buffers.buckets, self.buffers.shards))

    def state_to_save(self, state) -> list | None:
        """The slices' optimizer state gathered over the data axis into each parameter's
        local block (the step count, the same on every rank, once per parameter)."""
        z = self.buffers
        if z is None:
            return None
        if self.whole:
            raise _no_checkpoint()
        out = []
        for b, shard in zip(z.buckets, z.shards):
            for key, flat_local in state.get(shard, {}).items():
                if flat_local.dim() == 0:
                    out += [(p, key, flat_local.clone()) for p in b.params]
                else:
                    out += [(p, key, loc) for p, loc in zip(b.params, z.full_state(flat_local, b))]
        return out

    def load_saved_state(self, state, read) -> bool:
        """Each slice's optimizer state cut from its parameters' loaded blocks."""
        z = self.buffers
        if z is None:
            return False
        if self.whole:
            raise _no_checkpoint()
        for b, shard in zip(z.buckets, z.shards):
            for key, flat_local in state.get(shard, {}).items():
                if flat_local.dim() == 0:
                    flat_local.copy_(read(b.params[0], key))
                else:
                    flat_local.copy_(z.slice_state([read(p, key) for p in b.params], b,
                                                   flat_local))
        return True


@dataclasses.dataclass
class Zero1OnUnits(Zero1Part):
    """Stage 1 where some parameters rest on the host (``offload(params=...)``): every
    block is an FSDP2 unit over the data axes and a size-1 shard dimension (as plain data
    parallelism's), whose backward all-reduces and averages each unit's gradient over the
    data axes; the slices then take their part of those gradients as they are (no
    reduce-scatter), and the updated slices are all-gathered on the mesh's device into
    the parameters, on the host or the device. FSDP2 casts the parameters (its mixed
    precision), and ``roots`` are its roots, as ``FSDPPart``'s."""

    casts_params: ClassVar[bool] = True
    reduced: ClassVar[bool] = True
    roots: list = dataclasses.field(default_factory=list)

    def set_gradient_sync(self, model, enabled: bool) -> None:
        FSDPPart.set_gradient_sync(self, model, enabled)

    def sync_grads(self, params: list) -> None:
        FSDPPart.sync_grads(self, params)
        super().sync_grads(params)


def _no_checkpoint():
    from ...core.errors import ConfigError

    return ConfigError(
        "meshlab.checkpoint of an optimizer that zero_shard(1) steps whole-tensor (each "
        "parameter on its owner, for an optimizer that is not elementwise) is not supported "
        "yet; save the model without the optimizer (optimizer=None), keep opt.state_dict() "
        "(each parameter's state in torch's layout, gathered from its owner), or use an "
        "elementwise optimizer")


def install_zero(t, ctx) -> Part:
    stats = ctx.plan.decision(BatchStatistics)
    if stats is not None:
        install_batch_statistics(ctx.model, stats, ctx.group(*stats.axes), ctx.dropped)
    group, size = ctx.group(*t.axis), ctx.size(*t.axis)
    if t.stage == 1:
        if size > 1:
            require_mesh_optimizer(ctx.model.parameters(), f"zero_shard(1) keeps its "
                                   f"optimizer state sharded over {'x'.join(t.axis)}")
        host = ctx.kept(HostResidency) or HostResidency()     # none kept: nothing on the host
        if not t.fsdp(ctx.plan):
            return Zero1Part(group, size, apart=host.optimizer_host,
                             reduce=reduce_dtype(ctx.plan), device=ctx.device)
        part = Zero1OnUnits(group, size, apart=host.optimizer_host, device=ctx.device)
        _fully_shard(t, ctx, part.roots)
        return part
    if not t.fsdp(ctx.plan):       # stage 0 with every parameter on the device:
        return None                # GradSync averages every gradient (ZeroShard.reductions)
    part = FSDPPart()
    _fully_shard(t, ctx, part.roots)
    return part


def _fully_shard(t, ctx, roots: list) -> None:
    """FSDP2 over the blocks, then the root: the model, or where stage modules run the
    forward (``StageRoots``, a pipeline) each stage module, as the stage room builds it.
    Each root is added to ``roots``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    prec = ctx.plan.get(Precision)
    # FSDP2 reads reduce_dtype=None as "the compute dtype": name fp32 explicitly.
    mp = MixedPrecisionPolicy(
        param_dtype=getattr(torch, prec.compute) if prec and prec.compute != "float32" else None,
        reduce_dtype=getattr(torch, prec.reduce) if prec else None)
    model, mods = ctx.model, dict(ctx.model.named_modules())
    names = fsdp_ignored(ctx.plan)
    ignored = {p for n, p in model.named_parameters() if n in names}
    if ignored and mp.param_dtype is not None:
        cast_whole(model, ignored, mp.param_dtype)
    placement = _by_spec(ctx) if ctx.roles.fsdp else None
    kw = dict(mesh=_fsdp_mesh(t, ctx), reshard_after_forward=t.stage == 3,
              mp_policy=mp, ignored_params=ignored or None)
    freed = t.resharded(ctx.plan.model.blocks)
    if placement is not None:
        kw["shard_placement_fn"] = placement
    # offload(params=...) names the units whose shards FSDP2 keeps on the host ('' = root).
    host = ctx.kept(HostResidency) or HostResidency()     # none kept: nothing on the host
    if host.units:
        from torch.distributed.fsdp import CPUOffloadPolicy

    def policy(unit: str) -> dict:
        return {"offload_policy": CPUOffloadPolicy(pin_memory=host.pinned)} \
            if unit in host.units else {}

    for b in (b for b in ctx.plan.model.blocks if b in mods and b not in ctx.dropped):
        fully_shard(mods[b], **{**kw, "reshard_after_forward": b in freed}, **policy(b))

    data = ctx.group(*(t.replicate + t.axis))
    # A fused loss on a pipeline's last stage runs the head after the stage's forward has
    # returned (the schedule's loss), where the root's weights are resharded again: the
    # head is a unit of its own there, gathered when the loss calls it.
    fused_head = any(r.kind == "fuse" and "loss" in r.routed(ctx.plan)
                     for r in ctx.plan.rooms)

    def root(module) -> None:
        head = getattr(module, "head", None)
        if fused_head and isinstance(head, torch.nn.Linear):
            fully_shard(head, **kw, **policy(""))
        fully_shard(module, **kw, **policy(""))
        module._meshlab_unused = UnusedGrads(module, data, ctx.device)
        roots.append(module)

    stages = ctx.kept(StageRoots)
    if stages is not None:      # the stage's parameters outside its blocks: its root unit
        stages.wraps.append(root)
    else:
        root(model)


def cast_whole(model, params, dtype) -> None:
    """The parameters FSDP2 leaves whole (``ignored_params``: ``fsdp_ignored``) computed in
    ``dtype`` as its mixed precision computes the ones it shards (``param_dtype``): each
    stays a float32 parameter, which the optimizer steps and whose gradient the backward
    averages over the data axes in the policy's ``reduce_dtype`` (``GradSync``, from
    ``ZeroShard.reductions``); the forward of each module that holds one reads it cast to
    ``dtype`` (a pre-hook, after tensor parallelism's, which shows the module its local
    shard), and the cast is differentiable, so its gradient comes back through it in
    float32. The cast is dropped again after the module's forward."""
    ids = {id(p) for p in params if p.is_floating_point()}
    for m in model.modules():
        held = tuple(n for n, p in m._parameters.items() if p is not None and id(p) in ids)
        if held:
            pre, post = _cast_hooks(held, dtype)
            m.register_forward_pre_hook(pre)
            m.register_forward_hook(post)


def _cast_hooks(names: tuple, dtype):
    """A module's pre- and post-forward hooks that show it ``names`` cast to ``dtype``
    (shadowing the attribute in its ``__dict__``, as tensor parallelism's local shards do)
    and take the cast away again; a cast left by a forward that raised is dropped first."""
    cast: dict = {}

    def drop(mod) -> None:
        for n in names:
            if n in cast and mod.__dict__.get(n) is cast.pop(n):
                del mod.__dict__[n]

    def pre(mod, args):
        drop(mod)
        for n in names:
            v = getattr(mod, n)       # tensor parallelism's local shard, else the parameter
            if v is not None and v.is_floating_point() and v.dtype != dtype:
                mod.__dict__[n] = cast[n] = v.to(dtype)

    def post(mod, args, out):
        drop(mod)

    return pre, post


def _fsdp_mesh(t, ctx):
    """FSDP2's mesh: the shard axes (flattened into one), or under hybrid sharding the
    2-D mesh ``(replicate, shard)`` (HSDP: FSDP2 reduce-scatters over the second dimension
    and all-reduces the shards over the first). Plain data parallelism (stage 0, run by
    FSDP2 where parameters rest on the host) replicates over its axes and shards over a
    size-1 dimension unflattened from them: each rank's shard is the whole parameter;
    so does ZeRO-1 run by FSDP2 (every data axis, its replicate ones too)."""
    if t.stage < 2:
        dm = ctx.device_mesh(*(t.replicate + t.axis))
        if not hasattr(dm, "_unflatten"):
            from ...core.errors import ConfigError

            raise ConfigError(f"{t!r} with offload(params=...): FSDP2 keeps the parameters on "
                              f"the host over a size-1 shard dimension, which this torch "
                              f"{torch.__version__} cannot add to a DeviceMesh "
                              f"(DeviceMesh._unflatten); upgrade torch, or shard over the "
                              f"data axes instead: zero_shard(3, {t.axis!r}) | offload(...)")
        name = "_".join(t.replicate + t.axis)
        return dm._unflatten(0, (dm.size(), 1), (f"{name}_replicas", f"{name}_whole"))
    if not t.replicate:
        return ctx.device_mesh(*t.axis)
    rep, shard = ctx.device_mesh(*t.replicate), ctx.device_mesh(*t.axis)
    if len(t.replicate) == 1 and len(t.axis) == 1:
        return ctx.mesh.device_mesh[t.replicate + t.axis]
    # flattened dimensions are sliced from the root mesh by the names ``_flatten`` gave them
    names = tuple(m.mesh_dim_names[0] for m in (rep, shard))
    return ctx.mesh.device_mesh[names]


def fsdp_ignored(plan) -> frozenset:
    """The parameters FSDP2 leaves replicated (their gradients are all-reduced instead):
    under 2-D specs, those whose spec keeps them whole on the data axis; otherwise those a
    packed tensor-parallel projection (q|k|v) already strides on dim 0, which FSDP2's
    dim-0 sharding cannot split again; and always those tagged ``KEEP_WHOLE`` (a 4-bit
    packed base weight, frozen)."""
    from ...planning.plan import KEEP_WHOLE

    whole = frozenset(e.fqn for e in plan.params if KEEP_WHOLE in e.tags)
    return whole | _fsdp_ignored(plan)


def _fsdp_ignored(plan) -> frozenset:
    if plan.roles.fsdp:
        fsdp = set(plan.roles.fsdp)
        return frozenset(e.fqn for e in plan.params if not any(
            set(e.mesh_spec.dim_axes(d)) & fsdp for d in range(len(e.mesh_spec))))
    from ..shard import tp_layout
    from torch.distributed.tensor.placement_types import _StridedShard

    layout, _ = tp_layout(plan) if plan.roles.tp else (None, [])
    if layout is None or getattr(layout, "dtensor", False):
        return frozenset()
    by_module: dict = {}
    for e in plan.params:
        by_module.setdefault(e.module, []).append(e)
    out = set()
    for m in layout.modules:
        for e in by_module.get(m.fqn, ()):
            pl = m.style.placements(e.fqn.rsplit(".", 1)[-1], len(e.shape))
            if pl and isinstance(pl[0], _StridedShard) and pl[0].dim == 0:
                out.add(e.fqn)
    return frozenset(out)


def _by_spec(ctx):
    """2-D layouts (``P('fsdp', 'tp')``): each parameter is sharded on the dimension its
    spec gives the data axis (parameters it keeps whole there are ``fsdp_ignored``)."""
    from torch.distributed.tensor import Shard

    fsdp = set(ctx.roles.fsdp)
    dim_of = {}
    for e in ctx.plan.params:
        dims = [d for d in range(len(e.mesh_spec)) if set(e.mesh_spec.dim_axes(d)) & fsdp]
        if dims:
            dim_of[e.fqn] = dims[0]
    by_id = {id(p): Shard(dim_of[n]) for n, p in ctx.model.named_parameters() if n in dim_of}
    return lambda p: by_id.get(id(p), Shard(0))
