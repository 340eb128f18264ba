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

from ..core.digest import batch_entry, data_coords
from ..core.errors import ConfigError, PlanError
from ..core.log import get_logger
from ..core.sections import inside, section
from ..core.mesh import Mesh
from ..planning.plan import Plan
from ..core.tensors import local as _local
from ..transforms._gradsync import GradSync, bucket_mb, plan_reductions, reduce_dtype
from ..transforms._install import Install, Runtime, attach_runtime, mesh_device
from ..transforms._protocol import Phase
from ..transforms.expert._aux import scope_router_loss


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
        # A composite model (SAM, BLIP-2) holds sub-models with configs of their own:
        # each module is initialized by its nearest enclosing model, as transformers'
        # ``initialize_weights`` dispatches.
        owner: dict[int, object] = {}
        todo = [(model, hf)]
        while todo:
            m, fn = todo.pop()
            fn = getattr(m, "_initialize_weights", None) or fn
            owner[id(m)] = fn
            todo.extend((c, fn) for c in m.children())
        return lambda m: owner.get(id(m), hf)(m)

    def plain(m: nn.Module) -> None:
        # a BatchNorm without affine weights has no parameters: its reset sets its statistics
        reset = getattr(m, "reset_parameters", None)
        if reset is not None and any(True for _ in (*m.parameters(recurse=False),
                                                    *m.buffers(recurse=False))):
            reset()
    return plain


def _unset_buffers(m: nn.Module, before: dict) -> list[str]:
    """The buffers of ``m`` that were on the meta device and that its initialization
    neither wrote nor replaced (``before``: name -> (identity, version) after
    ``to_empty``): their memory holds whatever was there."""
    return [n for n, b in m.named_buffers(recurse=False)
            if n in before and before[n] == (id(b), b._version)]


def _unset_error(model: nn.Module, m: nn.Module, names: list[str]) -> ConfigError:
    path = next((k for k, v in model.named_modules() if v is m), "?")
    full = ", ".join(repr(f"{path}.{n}" if path else n) for n in names)
    one = len(names) == 1
    return ConfigError(
        f"init_weights: {'buffer' if one else 'buffers'} {full} of {type(m).__name__} "
        f"{'was' if one else 'were'} built on the meta device, which keeps no values, and "
        f"nothing set {'it' if one else 'them'} when the model was initialized (the memory "
        f"would hold whatever was there); set {'it' if one else 'them'} in the module's "
        f"reset_parameters() (or the model's _init_weights), or build the module off the "
        f"meta device (`with torch.device('cpu'):` inside the meta block) to keep the "
        f"values its constructor gave")


def init_weights(model: nn.Module, seed: int = 0, *, device: str = "cpu",
                 on_module=None) -> nn.Module:
    """Initialize a model built on the meta device, one module at a time.

    Modules are visited children-first (the order Hugging Face's ``initialize_weights``
    uses) with the global RNG seeded to ``seed``, so the values equal those of the same
    call in any other process; ``on_module(module)`` runs right after each module is
    initialized (the materializer shards it there, so the whole model never exists at
    once). Returns ``model``, initialized in place.

    A model with no meta tensor is refused (``ConfigError``): its values were drawn when
    it was built, from whatever the global RNG held, and handing it back as if ``seed``
    had made them would be a silent no-op. So is a buffer built on the meta device that
    nothing sets (the module's ``reset_parameters``, the model's ``_init_weights``): the
    meta device kept none of its constructor's values. A buffer built off the meta device
    keeps its values.
    """
    if not _has_meta(model):
        raise ConfigError(f"init_weights: {type(model).__name__} holds no meta tensors, so "
                          f"its values came from the global RNG when it was built, not "
                          f"from seed={seed}; build it under `with torch.device('meta'):` "
                          f"and call init_weights on that, or keep the weights it has")
    fn = _init_fn(model)
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        for m in _post_order(model):
            metas = {n for n, b in m.named_buffers(recurse=False) if b.is_meta}
            if any(t.is_meta for t in list(m.parameters(recurse=False)) +
                   list(m.buffers(recurse=False))):
                # to_empty empties every tensor of the module: a buffer built with values
                # (off the meta device) keeps them
                kept = {n: b for n, b in m.named_buffers(recurse=False) if not b.is_meta}
                m.to_empty(device=device, recurse=False)
                m._buffers.update({n: b.to(device) for n, b in kept.items()})
                if hasattr(m, "_is_hf_initialized"):
                    del m._is_hf_initialized
            fresh = {n: (id(b), b._version) for n, b in m.named_buffers(recurse=False)
                     if n in metas}
            with torch.no_grad():
                fn(m)
            unset = _unset_buffers(m, fresh)
            if unset:
                raise _unset_error(model, m, unset)
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


_CHUNK = 1 << 22     # elements per pass of ``_checksum`` (bounds its scratch memory)


def _checksum(t: torch.Tensor) -> tuple[int, int]:
    """Two 64-bit sums over the bytes of ``t`` read as integers: plain, and weighted by
    each word's position, so a transposed or permuted tensor differs in the second. The
    arithmetic wraps, so the order of the additions cannot change them: the same bytes
    give the same sums on every rank (NaNs included, which a float sum would not)."""
    flat = _local(t).detach().reshape(-1)
    word = {8: torch.int64, 4: torch.int32, 2: torch.int16}.get(flat.element_size())
    w = flat.view(word) if word is not None else flat.view(torch.uint8)
    s1 = torch.zeros((), dtype=torch.int64, device=w.device)
    s2 = torch.zeros((), dtype=torch.int64, device=w.device)
    for i in range(0, w.numel(), _CHUNK):
        part = w[i:i + _CHUNK].to(torch.int64)
        pos = torch.arange(i + 1, i + 1 + part.numel(), dtype=torch.int64, device=w.device)
        s1 += part.sum()
        s2 += (part * pos).sum()
    return int(s1), int(s2)


def _digests(named: list, group):
    """(this rank's digests, the indices of the tensors whose digest differs across
    ``group``): each tensor's ``_checksum``, reduced with MIN and MAX."""
    import torch.distributed as dist

    mine = torch.tensor([_checksum(t) for _, t in named] or [[0, 0]], dtype=torch.int64)
    lo, hi = mine.clone(), mine.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    return mine, ((lo != hi).any(dim=1).nonzero().flatten().tolist() if named else [])


def _check_same_everywhere(model: nn.Module, group, sync: bool = False) -> None:
    """Parameters built outside meshlab (or loaded from a ``state_dict``) must hold the
    same bytes on every rank before sharding: a digest of each parameter (``_checksum``)
    is reduced with MIN and MAX over the control group, and where they differ every rank
    raises ``RankMismatchError`` naming the first parameter that differs and which ranks
    hold which value. With ``sync`` (``parallelize(sync_module_states=True)``) the
    parameters and buffers that differ take the group's first rank's values instead, as
    torch's DDP does at construction, and a warning says how many did."""
    import torch.distributed as dist

    from ..core.agree import agree
    from ..core.errors import RankMismatchError

    named = list(model.named_parameters())
    if sync:
        named += list(model.named_buffers())
    mine, differ = _digests(named, group)
    if not differ:
        return
    ranks = dist.get_process_group_ranks(group)
    if sync:
        # Every rank holds the whole model here (before tensor parallelism slices it and a
        # pipeline drops other stages' blocks), and parallelize's fingerprint agreed on the
        # names, shapes and dtypes of its parameters and buffers: every rank broadcasts the
        # same tensors in the same order. A rank that cannot take a value keeps
        # broadcasting, and the agreement after the loop makes every rank raise.
        error = None
        with torch.no_grad():
            for i in differ:
                t = named[i][1]
                buf = t.detach().cpu().contiguous()
                dist.broadcast(buf, src=ranks[0], group=group)
                if error is None:
                    try:
                        t.copy_(buf)
                    except RuntimeError as e:
                        error = ConfigError(f"parallelize(sync_module_states=True): rank "
                                            f"{ranks[0]}'s {named[i][0]} could not be "
                                            f"copied into this rank's: {e}")
        agree(group, "parallelize(sync_module_states=True)", None, error)
        get_logger("meshlab.apply").warning(
            "parallelize(sync_module_states=True): %d of %d parameters and buffers differed "
            "across ranks (first %s); every rank now holds rank %d's values",
            len(differ), len(named), named[differ[0]][0], ranks[0])
        return
    i = differ[0]
    held = [torch.zeros(2, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(held, mine[i].clone(), group=group)
    groups: dict = {}
    for r, h in zip(ranks, held):
        groups.setdefault(tuple(h.tolist()), []).append(r)
    who = "; ".join(f"ranks {rs} hold digest {d[1] & 0xffff_ffff_ffff_ffff:016x}"
                    for d, rs in groups.items())
    raise RankMismatchError(
        f"parameter {named[i][0]} differs across ranks ({who}; {len(differ)} of "
        f"{len(named)} parameters differ): data-parallel replicas would train different "
        f"models. Seed every rank the same before building the model and load the same "
        f"weights everywhere, or build it on the meta device and let parallelize "
        f"initialize it (seed=...), or take rank {ranks[0]}'s values everywhere as DDP "
        f"does (parallelize(..., sync_module_states=True))")


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
    import datetime
    import os

    import torch.distributed as dist

    if dist.get_backend() == "fake":
        return dist.new_group()
    # bounded: a rank that never reaches an agreement fails the others after this long
    secs = float(os.environ.get("MESHLAB_CONTROL_TIMEOUT", "600"))
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=secs))


def materialize(model: nn.Module, plan: Plan, mesh: Mesh, *, seed: int = 0,
                state_dict: Mapping[str, torch.Tensor] | None = None,
                ctrl_group=None, sync_module_states: bool = False) -> nn.Module:
    """Run the bound ``plan`` on ``model`` over the real ``mesh`` (see the module doc)."""
    if not isinstance(mesh, Mesh) or not plan.is_bound:
        raise ConfigError(f"materialize needs a plan bound to a real Mesh inside launched "
                          f"processes; got {mesh!r}{'' if plan.is_bound else ' and an unbound plan'}")
    if plan.not_runnable:     # what the plan's table shows; nothing has communicated yet
        raise ConfigError(plan.not_runnable[0])
    ctrl = ctrl_group if ctrl_group is not None else control_group()
    ctx = Install(model=model, plan=plan, mesh=mesh, ctrl_group=ctrl)
    # 1. Before any weight exists, each room says what it needs of the initialization
    #    (tensor parallelism: shard each module as soon as it is initialized).
    for t in plan.rooms:
        t.prepare(ctx)
    # 2. The weights, module by module from the seed (the single process's values); the
    #    whole model never exists on one rank.
    _initialize(ctx, seed, state_dict, sync_module_states)
    # 3. The rooms that change the parameters themselves (adapters, tensor parallelism), on
    #    the CPU where the values were made.
    for t in [t for t in plan.rooms if t.phase <= Phase.SHARD]:
        ctx.parts.append(t.install(ctx))
    # 4. Plain tensors move to the mesh's device once: the DTensors are there already.
    _to_device(model, mesh_device(mesh))
    # 5. Every other room in phase order (``Phase`` says why each comes where it does).
    for t in [t for t in plan.rooms if t.phase > Phase.SHARD]:
        ctx.parts.append(t.install(ctx))
    ctx.parts[:] = [p for p in ctx.parts if p is not None]
    # 6. A mixture of experts' router loss over the whole step's tokens, whatever cut them.
    scope_router_loss(ctx)
    rt = Runtime(plan=plan, mesh=mesh, parts=tuple(ctx.parts), ctrl_group=ctrl,
                 grad_sync=_grad_sync(ctx))
    attach_runtime(model, rt)
    _no_cache_in_training(model)
    _forward_in_context(model, rt)
    _check_vocabulary(model, rt)
    return model


def _no_cache_in_training(model: nn.Module) -> None:
    """A training forward (the module in training mode, gradients on) of a model whose
    forward takes ``use_cache`` (a Hugging Face model's, whose config defaults it to True)
    runs with ``use_cache=False`` unless the call passes ``use_cache`` or
    ``past_key_values``, however it is called (``step``, a plain loop, a boosted model):
    a cache built there copies every layer's keys and values and holds them until the
    loss, and compiled blocks would guard each block's graph on its state. Evaluation and
    ``generate`` (which passes ``use_cache`` itself) keep the model's behaviour."""
    import inspect

    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return
    names = [p.name for p in params]
    if "use_cache" not in names:
        return
    position = names.index("use_cache")

    def no_cache(module, args, kwargs):
        if module.training and torch.is_grad_enabled() and len(args) <= position and \
                "use_cache" not in kwargs and "past_key_values" not in kwargs:
            return args, {**kwargs, "use_cache": False}
        return None

    model.register_forward_pre_hook(no_cache, with_kwargs=True)


def _check_vocabulary(model: nn.Module, rt: Runtime) -> None:
    """Every forward checks its token ids and labels against the vocabulary
    (``meshlab.transforms.losses.guard_model``); the ranks agree on the outcome where they read
    different batches (data-parallel ranks), outside a pipeline."""
    from ..transforms.losses import guard_model

    guard_model(model, rt.ctrl_group, agreed=rt.dp_size > 1, pipelined=rt.roles.pp is not None,
                tp_axis=rt.roles.tp)


def _forward_in_context(model: nn.Module, rt: Runtime) -> None:
    """The model's forward runs in the runtime's context (``precision``'s autocast)
    however it is called: ``model(x)`` in a plain loop computes as ``step`` does.

    Over several ranks a training forward (grad enabled: its backward reduces gradients)
    is also a collective section (``core.sections``): an exception on one rank reaches
    every rank at its end as ``PeerError`` instead of leaving them in the backward's
    reductions, and the ranks that read one batch agree on its contents there (``step``
    agrees on both itself; the forward inside it does not again). An evaluation under
    ``torch.no_grad()`` may run on one rank alone, and is left as it is."""
    from ..core.agree import agree, alone
    from ..transforms._buffers import FirstForward

    plain = isinstance(rt.autocast(), contextlib.nullcontext)
    if plain and alone(rt.ctrl_group):
        return
    inner = model.forward
    what = f"{type(model).__name__}.forward"
    # The first training forward called by hand over data-parallel ranks is watched, as
    # ``step`` watches its own (a forward inside its section is not watched here again).
    unwatched = [rt.dp_size > 1 and rt.roles.pp is None]

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        # inputs on a device are compared where ``step`` reads them once per step; the
        # forward would wait for the device here
        peers = lambda: batch_entry({"args": list(args), **kwargs}, data_coords(rt),
                                    "the forward's inputs", device_reads=False)
        watch = None
        if unwatched[0] and model.training and torch.is_grad_enabled() and not inside():
            unwatched[0] = False
            watch = FirstForward(model)
        try:
            with section(rt.ctrl_group, what, active=torch.is_grad_enabled(), peers=peers), \
                    rt.autocast():
                out = inner(*args, **kwargs)
                if watch is not None:     # every rank, before the backward reduces
                    error, changed = watch.finish(f"{what} (the first training forward)")
                    agree(rt.ctrl_group, f"{what}: buffers after the first training forward",
                          error=error, peers=changed)
                return out
        finally:
            if watch is not None:
                watch.close()

    model.forward = forward


def _grad_sync(ctx: Install):
    """The backward hooks that run every room's gradient reductions (or None)."""
    reductions = plan_reductions(ctx.plan)
    if not reductions:
        return None
    params = [(n, p) for n, p in ctx.model.named_parameters() if p.requires_grad]
    return GradSync(params, reductions, ctx, bucket_mb=bucket_mb(ctx.plan),
                    reduce_dtype=reduce_dtype(ctx.plan))


def _initialize(ctx: Install, seed: int, state_dict, sync: bool = False) -> None:
    """Meta parameters are initialized from ``seed`` (which ``parallelize`` agreed on; each
    room's ``on_module`` sees every module right after); ``state_dict`` then overrides.
    Values that did not come from the seed (real weights, a ``state_dict``) must hold the
    same bytes on every rank, or with ``sync`` take the first rank's
    (``_check_same_everywhere``)."""
    model = ctx.model
    seeded = _has_meta(model)
    if seeded:
        # the values come from the seed alone; parallelize's fingerprint agreed on it
        names = {id(m): n for n, m in model.named_modules()}
        hooks = ctx.on_module if state_dict is None else []

        def on_module(m: nn.Module) -> None:
            for fn in hooks:
                fn(names.get(id(m)), m)

        init_weights(model, seed, on_module=on_module if hooks else None)
    if state_dict is not None:
        _load_state(model, state_dict)
    if not seeded or state_dict is not None:
        _check_same_everywhere(model, ctx.ctrl_group, sync)
    for fn in ctx.after_init:
        fn(model)
