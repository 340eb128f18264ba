"""materialize: the one place that mutates a model to run a bound plan.

Every check ran in ``bind``. Here: each room's ``prepare`` -> the parameters are
initialized module by module (rooms may act on each module as soon as it exists: tensor
parallelism shards it then) -> each room's ``install`` in phase order (``Phase``), plain
tensors moved to the mesh's device after the sharding phase -> the ``Runtime`` the
optimizer, ``step`` and checkpoints read.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Mapping

import torch
from torch import nn

from ._errors import ConfigError, PlanError
from ._mesh import Mesh
from ._plan import Plan
from .parallel._gradsync import GradSync, plan_reductions
from .parallel._install import Install, Runtime, mesh_device
from .parallel._protocol import Phase


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


def control_group():
    """A gloo group beside whatever the mesh runs on, for CPU-side agreement (fingerprints,
    weights, checkpoints); torch's fake backend, for dry runs of large meshes, has no gloo
    to pair with. Collective: every rank calls it."""
    import torch.distributed as dist

    return dist.new_group() if dist.get_backend() == "fake" else dist.new_group(backend="gloo")


def materialize(model: nn.Module, plan: Plan, mesh: Mesh, *, seed: int = 0,
                state_dict: Mapping[str, torch.Tensor] | None = None,
                ctrl_group=None) -> nn.Module:
    """Run the bound ``plan`` on ``model`` over the real ``mesh`` (see the module doc)."""
    if mesh.fake or not plan.is_bound:
        raise ConfigError(f"materialize needs a plan bound to a real Mesh inside launched "
                          f"processes; got {mesh!r}{'' if plan.is_bound else ' and an unbound plan'}")
    if plan.not_runnable:     # what the plan's table shows; nothing has communicated yet
        raise ConfigError(plan.not_runnable[0])
    ctrl = ctrl_group if ctrl_group is not None else control_group()
    ctx = Install(model=model, plan=plan, mesh=mesh, ctrl_group=ctrl)
    for t in plan.rooms:
        t.prepare(ctx)
    _initialize(ctx, seed, state_dict)
    # Plain tensors (initialized on the CPU, as in one process) move once sharding is done.
    for t in [t for t in plan.rooms if t.phase <= Phase.SHARD]:
        ctx.parts.append(t.install(ctx))
    _to_device(model, mesh_device(mesh))
    for t in [t for t in plan.rooms if t.phase > Phase.SHARD]:
        ctx.parts.append(t.install(ctx))
    ctx.parts[:] = [p for p in ctx.parts if p is not None]
    model._meshlab = Runtime(plan=plan, mesh=mesh, parts=tuple(ctx.parts), ctrl_group=ctrl,
                             grad_sync=_grad_sync(ctx))
    _forward_in_context(model, model._meshlab)
    return model


def _forward_in_context(model: nn.Module, rt: Runtime) -> None:
    """The model's forward runs in the runtime's context (``precision``'s autocast)
    however it is called: ``model(x)`` in a plain loop computes as ``step`` does."""
    if isinstance(rt.autocast(), contextlib.nullcontext):
        return
    inner = model.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with rt.autocast():
            return inner(*args, **kwargs)

    model.forward = forward


def _grad_sync(ctx: Install):
    """The backward hooks that run every room's gradient reductions (or None)."""
    reductions = plan_reductions(ctx.plan)
    if not reductions:
        return None
    params = [(n, p) for n, p in ctx.model.named_parameters() if p.requires_grad]
    return GradSync(params, reductions, ctx)


def _initialize(ctx: Install, seed: int, state_dict) -> None:
    """Meta parameters are initialized (each room's ``on_module`` sees every module right
    after); real ones must agree across ranks. ``state_dict`` then overrides."""
    model = ctx.model
    if _has_meta(model):
        names = {id(m): n for n, m in model.named_modules()}
        hooks = ctx.on_module if state_dict is None else []

        def on_module(m: nn.Module) -> None:
            for fn in hooks:
                fn(names.get(id(m)), m)

        init_weights(model, seed, on_module=on_module if hooks else None)
    else:
        _check_same_everywhere(model, ctx.ctrl_group)
    if state_dict is not None:
        _load_state(model, state_dict)
    for fn in ctx.after_init:
        fn(model)
