"""materialize: the one place that mutates a model to run a bound plan.

Order: validate (``build_layout``) -> initialize parameters module by module, sharding
each tensor-parallel module as soon as it exists -> install the TP hooks -> activation
checkpointing -> FSDP2 for ZeRO-2/3 -> attach the runtime the optimizer and ``step`` read.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Iterator, Mapping

import torch
from torch import nn

from ._errors import ConfigError, PlanError
from ._layout import Layout, build_layout
from ._mesh import Mesh
from ._plan import Plan
from . import _tp


@dataclasses.dataclass
class Runtime:
    """What a parallelized model carries for ``optimizer``/``step``/checkpoints."""

    plan: Plan
    mesh: Mesh
    layout: Layout
    tp_group: object | None
    dp_group: object | None
    dp_mesh: object | None
    tp_mesh: object | None
    dp_replicated: tuple[str, ...] = ()   # FSDP-ignored parameters: gradients all-reduced
    pipeline: object | None = None        # _PipelineRuntime when the plan has a pipeline
    sp_group: object | None = None        # Ulysses sequence group
    sp_reduce: tuple[str, ...] = ()       # parameters whose gradients are summed over it
    ctrl_group: object | None = None      # gloo group for checkpoint agreement and barriers

    @property
    def dp_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(self.dp_group) if self.dp_group is not None else 1

    @property
    def tp_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(self.tp_group) if self.tp_group is not None else 1


def runtime_of(model: nn.Module) -> Runtime:
    rt = getattr(model, "_meshlab", None)
    if rt is None:
        raise ConfigError("this model was not parallelized by meshlab; call "
                          "meshlab.parallelize(model, spec, mesh) first")
    return rt


def _post_order(m: nn.Module) -> Iterator[nn.Module]:
    for c in m.children():
        yield from _post_order(c)
    yield m


def _has_meta(m: nn.Module) -> bool:
    return any(t.is_meta for t in list(m.parameters()) + list(m.buffers()))


def _init_fn(model: nn.Module):
    """The function that initializes one module the way the model itself would."""
    hf = getattr(model, "_initialize_weights", None)
    if hf is not None:
        return lambda m: hf(m)

    def plain(m: nn.Module) -> None:
        reset = getattr(m, "reset_parameters", None)
        if reset is not None and any(True for _ in m.parameters(recurse=False)):
            reset()
    return plain


def init_weights(model: nn.Module, seed: int = 0, *, device: str = "cpu",
                 on_module=None) -> nn.Module:
    """Initialize a model built on the meta device, one module at a time.

    Modules are visited children-first (the order Hugging Face's ``initialize_weights``
    uses) with the global RNG seeded to ``seed``, so the values equal those of the same
    call in any other process; ``on_module(module)`` runs right after each module is
    initialized (the materializer shards it there, so the whole model never exists at
    once). Returns ``model``, initialized in place.
    """
    if not _has_meta(model):
        return model
    fn = _init_fn(model)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for m in _post_order(model):
            if any(t.is_meta for t in list(m.parameters(recurse=False)) +
                   list(m.buffers(recurse=False))):
                m.to_empty(device=device, recurse=False)
                if hasattr(m, "_is_hf_initialized"):
                    del m._is_hf_initialized
            with torch.no_grad():
                fn(m)
            if on_module is not None:
                on_module(m)
    finally:
        torch.random.set_rng_state(gen_state)
    tie = getattr(model, "tie_weights", None)
    if tie is not None:
        tie()
    return model


def _load_state(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    own = dict(model.named_parameters(remove_duplicate=False))
    own.update(dict(model.named_buffers()))
    missing = [k for k, p in model.named_parameters() if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if missing or unexpected:
        raise PlanError(f"state_dict does not fit the model: missing {missing[:5]}"
                        f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                        f"{'...' if len(unexpected) > 5 else ''}")
    with torch.no_grad():
        for k, v in state_dict.items():
            t = own[k]
            if tuple(t.shape) != tuple(v.shape):
                raise PlanError(f"{k}: state_dict has shape {tuple(v.shape)}, the model "
                                f"{tuple(t.shape)}")
            t.copy_(v)


def _check_same_everywhere(model: nn.Module, group) -> None:
    """Parameters built outside meshlab must agree on every rank before sharding."""
    import torch.distributed as dist

    s = torch.zeros(1, dtype=torch.float64)
    for p in model.parameters():
        s += p.detach().double().sum().cpu()
    lo, hi = s.clone(), s.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    if not torch.equal(lo, hi):
        raise ConfigError("the model's parameters differ across ranks; seed every rank the same "
                          "before building it, or build it on the meta device and let "
                          "parallelize initialize it (seed=...)")


def _to_device(model: nn.Module, device: torch.device) -> None:
    """Move the plain parameters and buffers (initialized on the CPU, so that values equal
    ``init_weights`` in one process) to the mesh's device; DTensors already live there."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for m in model.modules():
            for k, p in m._parameters.items():
                if p is not None and not isinstance(p, DTensor) and p.device != device:
                    p.data = p.data.to(device)
            for k, b in m._buffers.items():
                if b is not None and not isinstance(b, DTensor) and b.device != device:
                    m._buffers[k] = b.to(device)


def _remat_forward(forward, policy: str):
    from torch.utils.checkpoint import checkpoint

    if policy == "selective":
        from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

        keep = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                torch.ops.aten.bmm.default,
                torch.ops.aten._scaled_dot_product_flash_attention.default,
                torch.ops.aten._scaled_dot_product_efficient_attention.default}

        def policy_fn(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

        context_fn = functools.partial(create_selective_checkpoint_contexts, policy_fn)
    else:
        context_fn = None

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        kw = {"use_reentrant": False}
        if context_fn is not None:
            kw["context_fn"] = context_fn
        return checkpoint(forward, *args, **kw, **kwargs)

    return wrapped


def _check_fuse(plan: Plan, layout, model: nn.Module) -> tuple[str, ...]:
    """The ops ``fuse`` routes, after refusing combinations it cannot run."""
    opt = plan.option("fuse")
    if opt is None:
        return ()
    ops = tuple(opt["ops"])
    if "loss" in ops:
        if plan.option("pipeline") is not None:
            raise ConfigError("fuse('loss') with pipeline(): the last stage's loss comes from the "
                              "schedule's loss_fn on logits; leave 'loss' out of fuse()")
        get = getattr(model, "get_output_embeddings", None)
        head = get() if get is not None else None
        tp_fqns = {m.fqn for m in layout.tp.modules} if layout.tp else set()
        names = [n for n, m in model.named_modules() if m is head]
        if head is not None and names and names[0] in tp_fqns:
            raise ConfigError(f"fuse('loss') with {names[0]} sharded by shard(): the fused loss "
                              f"needs the whole vocabulary on each rank; leave 'loss' out of "
                              f"fuse() (the vocabulary-parallel cross-entropy runs instead)")
    if "attention" in ops and plan.option("sequence") is not None:
        raise ConfigError("fuse('attention') with sequence(): sequence parallelism installs its "
                          "own attention; leave 'attention' out of fuse()")
    return ops


def materialize(model: nn.Module, plan: Plan, mesh: Mesh, *, seed: int = 0,
                state_dict: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    import torch.distributed as dist

    if mesh.fake:
        raise ConfigError(f"{mesh!r} is fake (planning only); parallelize needs a real Mesh "
                          f"inside launched processes")
    dm = mesh.device_mesh
    # Everything that can be checked is checked before the first collective.
    probe = build_layout(plan, model, 0)
    tp_axis, dp_axes = probe.tp_axis, probe.dp_axes
    tp_mesh = dm[tp_axis] if tp_axis else None
    tp_group = tp_mesh.get_group() if tp_mesh is not None else None
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    layout = build_layout(plan, model, tp_rank) if tp_rank else probe
    fuse_ops = _check_fuse(plan, layout, model)
    dp_mesh = None
    if dp_axes:
        dp_mesh = dm[dp_axes[0]] if len(dp_axes) == 1 else dm[dp_axes]._flatten("_".join(dp_axes))
    dp_group = dp_mesh.get_group() if dp_mesh is not None else None

    # gloo beside whatever the mesh runs on: CPU-side agreement (weights, checkpoints).
    # (torch's fake backend, for dry runs of large meshes, has no gloo to pair with.)
    fake_pg = dist.get_backend() == "fake"
    ctrl_group = dist.new_group() if fake_pg else dist.new_group(backend="gloo")
    tp = layout.tp
    tp_specs = {m.fqn: m for m in tp.modules} if tp else {}
    pp = _pipeline_setup(plan, mesh, layout)
    mods = dict(model.named_modules())
    names_by_id = {id(m): n for n, m in mods.items()}
    uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    tied = {i for i, c in uses.items() if c > 1}
    blocks = set(layout.blocks)
    swapped: dict[int, tuple] = {}
    done: set[str] = set()
    versions: dict[str, int] = {}

    def shard(name: str) -> None:
        m = mods[name]
        _tp.shard_module(m, tp_specs[name], tp_mesh, tp_group, swapped)
        done.add(name)
        for k, p in m._parameters.items():
            if p is not None:
                versions[f"{name}.{k}"] = p._version

    def on_module(m: nn.Module) -> None:
        # A block's modules are sharded once the whole block is initialized: a parent's
        # init may still rewrite its children (GPT-2 rescales c_proj from the block).
        # Tied parameters wait for the end (the model ties them after initialization).
        name = names_by_id.get(id(m))
        if name not in blocks:
            return
        if pp is not None and name not in pp.kept:
            return  # dropped right after initialization (prune below)
        for sub in tp_specs:
            if sub.startswith(name + ".") and sub not in done and not any(
                    id(p) in tied for p in mods[sub].parameters(recurse=False)):
                shard(sub)

    if _has_meta(model):
        init_weights(model, seed, on_module=on_module if state_dict is None else None)
        for name, v in versions.items():  # nothing may have rewritten a sharded parameter
            mname, _, k = name.rpartition(".")
            if mods[mname]._parameters[k]._version != v:
                raise ConfigError(f"{name} was re-initialized after its block finished; "
                                  f"initialize this model with state_dict= instead")
    else:
        _check_same_everywhere(model, ctrl_group)
    if state_dict is not None:
        _load_state(model, state_dict)
    if pp is not None:
        pp.prune(model)
        mods = {n: m for n, m in model.named_modules()
                if n == "" or next(m.parameters(), None) is not None}
        tp_specs = {k: v for k, v in tp_specs.items() if k in mods}
        if tp is not None:
            tp = dataclasses.replace(
                tp, modules=tuple(m for m in tp.modules if m.fqn in mods),
                regions=tuple(r for r in tp.regions if r in mods),
                attrs=tuple(a for a in tp.attrs if a[0] in mods))
    for name in tp_specs:
        if name not in done:
            shard(name)
    if swapped:
        # Every module that held a replaced tensor (tied names) now holds the DTensor.
        for m in model.modules():
            for k, p in list(m._parameters.items()):
                if p is not None and id(p) in swapped and swapped[id(p)][0] is p:
                    m._parameters[k] = swapped[id(p)][1]
    if mesh.device_type != "cpu":
        _to_device(model, torch.device(mesh.device_type, torch.cuda.current_device())
                   if mesh.device_type == "cuda" else torch.device(mesh.device_type))
    if tp is not None:
        _tp.install_hooks(model, tp, tp_mesh, tp_group)

    if fuse_ops:
        from .ops.hf import fuse as fuse_model

        fuse_model(model, fuse_ops)

    if layout.remat != "none":
        cfg = getattr(model, "config", None)
        if getattr(cfg, "use_cache", False):
            # A KV cache would grow again on every recomputed block (HF does the same).
            cfg.use_cache = False
        for b in (b for b in layout.blocks if b in mods):   # this rank's blocks
            blk = mods[b]
            blk.forward = _remat_forward(blk.forward, layout.remat)

    if layout.zero_stage >= 2:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        prec = layout.precision
        # FSDP2 reads reduce_dtype=None as "the compute dtype": name fp32 explicitly.
        mp = MixedPrecisionPolicy(
            param_dtype=getattr(torch, prec["param"]) if prec.get("param", "float32") != "float32" else None,
            reduce_dtype=getattr(torch, prec.get("grad", "float32")) if prec else None,
        )
        reshard = layout.zero_stage == 3
        # FSDP2 shards dim 0; a parameter already strided on dim 0 by TP (a packed q|k|v
        # bias) stays replicated over dp and meshlab all-reduces its gradient instead.
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.placement_types import _StridedShard

        ignored = {p for p in model.parameters() if isinstance(p, DTensor) and any(
            isinstance(pl, _StridedShard) and pl.dim == 0 for pl in p.placements)}
        for b in (b for b in layout.blocks if b in mods):
            fully_shard(mods[b], mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp,
                        ignored_params=ignored or None)
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp,
                    ignored_params=ignored or None)
        dp_replicated = tuple(n for n, p in model.named_parameters() if p in ignored)
    else:
        dp_replicated = ()

    sp_group, sp_reduce = None, ()
    sq = plan.option("sequence")
    if sq is not None:
        from . import _ulysses

        if pp is not None:
            raise ConfigError(f"sequence({sq['mode']}) with pipeline is not supported")
        sp_mesh = dm[sq["axis"]]
        sp_group = sp_mesh.get_group()
        if sq["mode"] == "ring":
            from . import _ring

            _ring.install(model, layout.blocks, sp_group)
        else:
            _ulysses.check(model, sp_mesh.size())
            _ulysses.install(model, layout.blocks, sp_group)
        # Every block parameter sees this rank's slice of the sequence only.
        sp_reduce = tuple(n for n, p in model.named_parameters()
                          if any(n.startswith(b + ".") for b in layout.blocks))
    if pp is not None:
        pp.build_stages(model, layout)
    model._meshlab = Runtime(plan=plan, mesh=mesh, layout=layout, tp_group=tp_group,
                             dp_group=dp_group, dp_mesh=dp_mesh, tp_mesh=tp_mesh,
                             dp_replicated=dp_replicated,
                             ctrl_group=ctrl_group, pipeline=pp,
                             sp_group=sp_group, sp_reduce=sp_reduce)
    return model


class _PipelineRuntime:
    """This rank's pipeline stages and the schedule that runs them."""

    def __init__(self, plan: Plan, mesh: Mesh, layout: Layout):
        from .transforms.pipeline import stages

        opt = plan.option("pipeline")
        self.axis, self.schedule_name = opt["axis"], opt["schedule"]
        self.microbatches = opt["microbatches"]
        self.all = stages(plan)
        from ._pipeline import check_untied

        check_untied(plan, self.all)
        if layout.zero_stage >= 2:
            raise ConfigError("pipeline with zero_shard(stage >= 2) is not supported; use "
                              "zero_shard(1, ...) on the data-parallel axis")
        if layout.tp is not None and layout.tp.sequence_parallel:
            raise ConfigError("pipeline with sequence parallelism is not supported; map 'seq' "
                              "to None in Rules")
        self.pp_mesh = mesh.device_mesh[self.axis]
        self.group = self.pp_mesh.get_group()
        self.rank = mesh.coordinate(mesh.rank)[self.axis]
        self.mine = [s for s in self.all if s.rank == self.rank]
        self.kept = {b for s in self.mine for b in s.blocks}
        self.first = any(s.first for s in self.mine)
        self.last = any(s.last for s in self.mine)
        self._schedules: dict = {}

    def prune(self, model: nn.Module) -> None:
        from ._pipeline import prune

        prune(model, self.kept)
        base = getattr(model, model.base_model_prefix)
        if not self.first:
            base.embed_tokens = nn.Module()
        if not self.last:
            base.norm = nn.Module()
            model.lm_head = nn.Module()

    def build_stages(self, model: nn.Module, layout: Layout) -> None:
        from torch.distributed.pipelining import PipelineStage

        from ._pipeline import DecoderStage

        device = torch.device("cpu") if self.pp_mesh.device_type == "cpu" else \
            torch.device(self.pp_mesh.device_type, torch.cuda.current_device())
        n = len(self.all)
        self.stages = []
        for s in self.mine:
            ids = [int(b.rsplit(".", 1)[1]) for b in s.blocks]
            self.stages.append(PipelineStage(DecoderStage(model, ids, s.first, s.last), s.index,
                                             n, device, group=self.group))

    def schedule(self, loss_fn):
        from torch.distributed import pipelining as P

        key = id(loss_fn)
        if key not in self._schedules:
            def stage_loss(out, target):
                return loss_fn(out, {"input_ids": target, "labels": target})

            cls = {"gpipe": P.ScheduleGPipe, "1f1b": P.Schedule1F1B,
                   "interleaved": P.ScheduleInterleaved1F1B,
                   "zero_bubble": P.ScheduleInterleavedZeroBubble,
                   "zbv": P.ScheduleZBVZeroBubble}[self.schedule_name]
            stage = self.stages if self.schedule_name not in ("gpipe", "1f1b") else self.stages[0]
            self._schedules[key] = cls(stage, self.microbatches, loss_fn=stage_loss)
        return self._schedules[key]


def _pipeline_setup(plan: Plan, mesh: Mesh, layout: Layout):
    return _PipelineRuntime(plan, mesh, layout) if plan.option("pipeline") else None
