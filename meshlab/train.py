"""Training: ``optimizer``, ``step`` and ``dataloader`` for parallelized models.

``opt.step()`` does everything a step needs after ``backward``, in order: gradient
synchronization (data-parallel all-reduce, or the ZeRO-1 reduce-scatter; tensor-parallel
sums for replicated parameters that saw partial data), unscaling and the overflow check
agreed by every rank, global gradient-norm clipping across all mesh axes, the update,
and (ZeRO-1) the all-gather of updated parameters. A plain ``loss.backward();
opt.step()`` loop is therefore correct; ``step`` adds microbatching, mixed precision and
loss scaling around it.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ._collectives import all_gather_into, reduce_scatter_into
from ._errors import ConfigError
from ._materialize import Runtime, runtime_of
from ._scaler import LossScaler
from ._tensors import local as _local


def _scalar_device(rt) -> torch.device:
    """Where small reduced values live: on the GPU for CUDA meshes (an NCCL-only group
    cannot reduce CPU tensors), else on the CPU."""
    if rt.mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _shard_groups(t, rt: Runtime) -> tuple:
    """The process groups over which ``t``'s local data is a disjoint piece."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(t, DTensor):
        return ()
    groups = []
    mesh = t.device_mesh
    for i, pl in enumerate(t.placements):
        if isinstance(pl, (Shard, _StridedShard)) and mesh.size(i) > 1:
            groups.append(mesh.get_group(i))
    return tuple(groups)


def _flat_all_reduce(grads: list[torch.Tensor], group, divide: int = 1) -> None:
    """Sum ``grads`` over ``group`` in place (then divide): one flat all-reduce per dtype
    and device, so a step pays one collective latency per bucket, not per tensor."""
    buckets: dict = {}
    for g in grads:
        buckets.setdefault((g.dtype, g.device), []).append(g)
    for same in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        if divide != 1:
            flat.div_(divide)
        off = 0
        for g in same:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()


def _params_of(cls) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        return set()


class MeshOptimizer:
    """A torch optimizer driven the way a parallelized model needs (see module doc)."""

    def __init__(self, model: nn.Module, cls: type, *, clip_grad_norm: float | None = None,
                 **kwargs: Any) -> None:
        self.model, self.rt = model, runtime_of(model)
        self.clip = clip_grad_norm
        seen: set[int] = set()
        self.params: list[tuple[str, nn.Parameter]] = []
        for n, p in model.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self.params.append((n, p))
        stage = self.rt.layout.zero_stage
        self.zero1 = stage == 1 and self.rt.dp_size > 1
        tp_reduce = set(self.rt.layout.grad_tp_reduce)
        self.tp_reduce = [p for n, p in self.params if n in tp_reduce]
        prec = self.rt.layout.precision
        ls = prec.get("loss_scale")
        self.scaler = None
        if ls == "dynamic":
            self.scaler = LossScaler(scale=prec.get("init_scale", 2.0 ** 16),
                                     growth_interval=prec.get("growth_interval", 2000))
        elif isinstance(ls, (int, float)):
            self.scaler = LossScaler(scale=float(ls), growth=1.0, backoff=1.0)
        if self.zero1:
            self._build_zero1()
            self.inner = cls([s for s in self.shards], **kwargs)
        else:
            from torch.distributed.tensor import DTensor

            kinds = {isinstance(p, DTensor) for _, p in self.params}
            if len(kinds) > 1 and "foreach" in _params_of(cls) and "foreach" not in kwargs:
                # torch's multi-tensor kernels group by device and dtype, not by tensor
                # type: DTensor and plain parameters in one list fail on CUDA.
                kwargs["foreach"] = False
            self.inner = cls([p for _, p in self.params], **kwargs)
        self.last_grad_norm: float | None = None
        self._synced = False

    # -- ZeRO-1: one flat buffer per (dtype, tp-sharded) bucket, each dp rank owns a slice --
    def _build_zero1(self) -> None:
        dp = self.rt.dp_size
        r = dist.get_rank(self.rt.dp_group)
        buckets: dict = {}
        for _, p in self.params:
            key = (p.dtype, _shard_groups(p, self.rt))
            buckets.setdefault(key, []).append(p)
        self.buckets = []
        self.shards = []
        for (dtype, groups), ps in buckets.items():
            numels = [_local(p).numel() for p in ps]
            total = sum(numels)
            per = -(-total // dp)
            # The master slice is fp32 (fp64 for fp64 parameters).
            mdt = torch.float64 if dtype == torch.float64 else torch.float32
            dev = _local(ps[0]).device
            flat = torch.zeros(per * dp, dtype=mdt, device=dev)
            off = 0
            for p, n in zip(ps, numels):
                flat[off:off + n] = _local(p).detach().reshape(-1).to(mdt)
                off += n
            shard = nn.Parameter(flat[r * per:(r + 1) * per].clone())
            self.buckets.append((ps, numels, per, groups))
            self.shards.append(shard)

    def refresh_master(self) -> None:
        """Copy the parameters into this rank's fp32 master slices (after a load)."""
        r = dist.get_rank(self.rt.dp_group)
        with torch.no_grad():
            for (ps, numels, per, _), shard in zip(self.buckets, self.shards):
                flat = torch.zeros(per * self.rt.dp_size, dtype=shard.dtype, device=shard.device)
                off = 0
                for p, n in zip(ps, numels):
                    flat[off:off + n] = _local(p).detach().reshape(-1).to(shard.dtype)
                    off += n
                shard.copy_(flat[r * per:(r + 1) * per])

    def _flat_grads(self, ps, numels, per, dtype) -> torch.Tensor:
        flat = torch.zeros(per * self.rt.dp_size, dtype=dtype, device=_local(ps[0]).device)
        off = 0
        for p, n in zip(ps, numels):
            if p.grad is not None:
                flat[off:off + n] = _local(p.grad).reshape(-1)
            off += n
        return flat

    # -- the step -------------------------------------------------------------------
    def _sync_grads(self) -> None:
        """Reduce gradients across the mesh (once per step: calling it again is a no-op)."""
        if self._synced:
            return
        self._synced = True
        rt = self.rt
        if rt.tp_group is not None and self.tp_reduce:   # replicated, saw partial data
            _flat_all_reduce([_local(p.grad) for p in self.tp_reduce if p.grad is not None],
                             rt.tp_group)
        if rt.sp_group is not None and rt.sp_reduce:     # blocks saw a slice of the sequence
            names = set(rt.sp_reduce)
            _flat_all_reduce([_local(p.grad) for n, p in self.params
                              if n in names and p.grad is not None], rt.sp_group)
        if rt.dp_group is None or rt.dp_size == 1:
            return
        if rt.layout.zero_stage >= 2:
            # FSDP2 reduce-scattered (and averaged) the gradients, except those it ignored.
            names = set(rt.dp_replicated)
            _flat_all_reduce([_local(p.grad) for n, p in self.params
                              if n in names and p.grad is not None], rt.dp_group, rt.dp_size)
            return
        if self.zero1:
            for (ps, numels, per, _), shard in zip(self.buckets, self.shards):
                flat = self._flat_grads(ps, numels, per, shard.dtype)
                out = torch.empty(per, dtype=shard.dtype, device=shard.device)
                reduce_scatter_into(out, flat, rt.dp_group)
                shard.grad = out.div_(rt.dp_size)
            return
        _flat_all_reduce([_local(p.grad) for _, p in self.params if p.grad is not None],
                         rt.dp_group, rt.dp_size)

    def _grad_items(self) -> list[tuple[torch.Tensor, tuple]]:
        """(local gradient, groups it is sharded over) for the norm and overflow checks."""
        if self.zero1:
            return [(s.grad, g + (self.rt.dp_group,)) for s, (_, _, _, g) in
                    zip(self.shards, self.buckets) if s.grad is not None]
        return [(_local(p.grad), _shard_groups(p.grad, self.rt)) for _, p in self.params
                if p.grad is not None]

    def grad_norm(self) -> float:
        """The global L2 norm of all gradients, over every mesh axis."""
        sums: dict[tuple, torch.Tensor] = {}
        for g, groups in self._grad_items():
            key = tuple(id(x) for x in groups)
            acc = sums.setdefault(key, [torch.zeros((), dtype=torch.float64, device=g.device),
                                        groups])
            acc[0] += g.detach().double().pow(2).sum()
        total = torch.zeros((), dtype=torch.float64, device=_scalar_device(self.rt))
        for s, groups in sums.values():
            for grp in groups:
                dist.all_reduce(s, group=grp)
            total += s.to(total.device)
        if self.rt.pipeline is not None:       # each stage holds different parameters
            dist.all_reduce(total, group=self.rt.pipeline.group)
        return float(total.sqrt())

    def step(self) -> bool:
        """Synchronize, unscale, check overflow, clip, update. Returns False if skipped."""
        self._sync_grads()
        items = self._grad_items()
        if self.scaler is not None:
            inv = 1.0 / self.scaler.scale
            for g, _ in items:
                g.mul_(inv)
            overflow = self.scaler.found_inf([g for g, _ in items], _scalar_device(self.rt))
            self.scaler.update(overflow)
            if overflow:
                self.zero_grad()
                return False
        if self.clip is not None:
            norm = self.grad_norm()
            self.last_grad_norm = norm
            coef = self.clip / (norm + 1e-6)
            if coef < 1.0:
                for g, _ in items:
                    g.mul_(coef)
        self.inner.step()
        if self.zero1:
            self._gather_zero1()
        self._synced = False
        return True

    def _gather_zero1(self) -> None:
        rt = self.rt
        with torch.no_grad():
            for (ps, numels, per, _), shard in zip(self.buckets, self.shards):
                full = torch.empty(per * rt.dp_size, dtype=shard.dtype, device=shard.device)
                all_gather_into(full, shard.detach(), rt.dp_group)
                off = 0
                for p, n in zip(ps, numels):
                    loc = _local(p)
                    loc.copy_(full[off:off + n].view_as(loc).to(loc.dtype))
                    off += n

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._synced = False
        for _, p in self.params:
            p.grad = None
        if self.zero1:
            for s in self.shards:
                s.grad = None
        self.inner.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self):
        return self.inner.param_groups

    def state_dict(self) -> dict:
        d = {"inner": self.inner.state_dict()}
        if self.scaler is not None:
            d["scaler"] = self.scaler.state_dict()
        return d

    def load_state_dict(self, d: Mapping) -> None:
        self.inner.load_state_dict(d["inner"])
        if self.scaler is not None and "scaler" in d:
            self.scaler.load_state_dict(d["scaler"])


def optimizer(model: nn.Module, cls: type = torch.optim.AdamW, *,
              clip_grad_norm: float | None = None, **kwargs: Any) -> MeshOptimizer:
    """An optimizer over a parallelized model's parameters (``cls(**kwargs)`` inside).

    ``clip_grad_norm`` clips by the global norm over all mesh axes. ZeRO-1 keeps the
    optimizer state for this rank's slice only.

    >>> opt = optimizer(model, torch.optim.AdamW, lr=3e-4, clip_grad_norm=1.0)  # doctest: +SKIP
    """
    if not isinstance(cls, type):
        raise ConfigError(f"optimizer(model, cls, ...): cls must be an optimizer class such as "
                          f"torch.optim.AdamW, got {cls!r}")
    return MeshOptimizer(model, cls, clip_grad_norm=clip_grad_norm, **kwargs)


def _split(batch, k: int) -> list:
    if isinstance(batch, torch.Tensor):
        if batch.shape[0] % k:
            raise ConfigError(f"step(microbatches={k}): local batch size {batch.shape[0]} does "
                              f"not divide into {k} microbatches")
        return list(batch.chunk(k))
    if isinstance(batch, Mapping):
        parts = {key: _split(v, k) if isinstance(v, torch.Tensor) else [v] * k
                 for key, v in batch.items()}
        return [{key: parts[key][i] for key in batch} for i in range(k)]
    raise ConfigError(f"step: batch must be a tensor or a dict of tensors, got {type(batch).__name__}")


def _autocast(rt: Runtime):
    prec = rt.layout.precision
    dt = prec.get("param", "float32")
    if dt == "float32" or rt.layout.zero_stage >= 2:  # FSDP2 casts parameters itself
        return contextlib.nullcontext()
    device = "cuda" if rt.mesh.device_type == "cuda" else "cpu"
    return torch.autocast(device_type=device, dtype=getattr(torch, dt))


def step(model: nn.Module, opt: MeshOptimizer, batch, loss_fn: Callable | None = None, *,
         microbatches: int = 1) -> float:
    """One training step: forward/backward over ``microbatches`` slices of this rank's
    ``batch``, then ``opt.step()`` and ``opt.zero_grad()``. Returns the loss averaged
    over microbatches and data-parallel ranks (the single-process loss of the global batch).

    ``loss_fn(output, batch) -> loss`` defaults to the causal-LM loss.
    """
    from .losses import causal_lm_loss

    rt = runtime_of(model)
    fused = getattr(model, "_meshlab_fused_loss", False)
    if fused and loss_fn is not None:
        raise ConfigError("this model's loss is fused (fuse('loss')): its head returns the "
                          "causal-LM loss, not logits, so a loss_fn cannot run; leave 'loss' "
                          "out of fuse() to pass one")
    loss_fn = loss_fn or causal_lm_loss
    if rt.pipeline is not None:
        return _pipeline_step(rt, opt, batch, loss_fn)
    mbs = _split(batch, microbatches)
    fsdp = rt.layout.zero_stage >= 2
    total = 0.0
    for i, mb in enumerate(mbs):
        last = i == len(mbs) - 1
        if fsdp:
            model.set_requires_gradient_sync(last)
        with _autocast(rt):
            # Labels go to loss_fn, not to the model (a Hugging Face model would compute
            # its own, non-parallel loss from them).
            if fused:
                from .ops.hf import causal_lm_loss as fused_causal_lm_loss

                loss = fused_causal_lm_loss(model, mb) / len(mbs)
            else:
                out = model(**{k: v for k, v in mb.items() if k != "labels"}) \
                    if isinstance(mb, Mapping) else model(mb)
                loss = loss_fn(out, mb) / len(mbs)
        scaled = loss * opt.scaler.scale if opt.scaler is not None else loss
        scaled.backward()
        total += float(loss.detach())
    opt.step()
    opt.zero_grad()
    if rt.dp_group is not None and rt.dp_size > 1:
        t = torch.tensor([total], dtype=torch.float64, device=_scalar_device(rt))
        dist.all_reduce(t, group=rt.dp_group)
        total = float(t) / rt.dp_size
    return total


def _pipeline_step(rt: Runtime, opt: MeshOptimizer, batch, loss_fn) -> float:
    """The schedule runs the microbatches; the loss comes from the last stage."""
    pp = rt.pipeline
    x = batch["input_ids"] if isinstance(batch, Mapping) else batch
    target = batch.get("labels", x) if isinstance(batch, Mapping) else x
    losses: list = []
    sched = pp.schedule(loss_fn)
    with _autocast(rt):
        if pp.first:
            sched.step(x, target=target if pp.last else None, losses=losses)
        elif pp.last:
            sched.step(target=target, losses=losses)
        else:
            sched.step()
    opt.step()
    opt.zero_grad()
    t = torch.tensor([sum(float(l.detach()) for l in losses) / len(losses) if losses else 0.0],
                     dtype=torch.float64, device=_scalar_device(rt))
    dist.all_reduce(t, group=pp.group)      # only the last stage holds a loss
    if rt.dp_group is not None and rt.dp_size > 1:
        dist.all_reduce(t, group=rt.dp_group)
        t /= rt.dp_size
    return float(t)


def dataloader(dataset, mesh, batch_size: int, *, axes: Iterable[str] | None = None,
               shuffle: bool = True, seed: int = 0, drop_last: bool = True, **kwargs):
    """A DataLoader giving each data-parallel rank distinct samples and tensor-parallel
    peers the same ones. ``batch_size`` is the *global* batch; each data-parallel rank
    gets ``batch_size / dp``. ``axes`` are the data-parallel mesh axes (default: those of
    ``dp``, ``fsdp``, ``data`` present in the mesh)."""
    from torch.utils.data.distributed import DistributedSampler

    axes = tuple(axes) if axes is not None else tuple(a for a in mesh.axis_names
                                                      if a in ("dp", "fsdp", "data", "ddp"))
    for a in axes:
        mesh.axis_size(a)
    dp = math.prod(mesh.axis_size(a) for a in axes) if axes else 1
    if batch_size % dp:
        raise ConfigError(f"dataloader: global batch {batch_size} does not divide over the "
                          f"{dp} data-parallel ranks of {axes}; use a multiple of {dp}")
    coord = mesh.coordinate(mesh.rank)
    rank = 0
    for a in axes:
        rank = rank * mesh.axis_size(a) + coord[a]
    sampler = DistributedSampler(dataset, num_replicas=dp, rank=rank, shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)
    # An own generator: starting an epoch must not draw from the global RNG (a resumed
    # run starts its iterator at a different moment than the uninterrupted one).
    kwargs.setdefault("generator", torch.Generator().manual_seed(seed))
    return MeshDataLoader(dataset, batch_size=batch_size // dp, sampler=sampler,
                          drop_last=drop_last, **kwargs)


class MeshDataLoader(torch.utils.data.DataLoader):
    """A DataLoader that knows its position: each pass over it is a new epoch (the
    sampler reshuffles), and ``state_dict`` / ``load_state_dict`` resume mid-epoch (a
    checkpoint saves it with ``dataloader=``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._epoch, self._served, self._skip = 0, 0, 0

    def __iter__(self):
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self._epoch)
        skip, self._skip = self._skip, 0
        self._served = skip
        for i, batch in enumerate(super().__iter__()):
            if i < skip:
                continue
            self._served = i + 1
            yield batch
        self._epoch += 1
        self._served = 0

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "served": self._served}

    def load_state_dict(self, state: Mapping) -> None:
        self._epoch, self._skip, self._served = int(state["epoch"]), int(state["served"]), 0
