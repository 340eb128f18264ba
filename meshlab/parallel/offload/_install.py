"""What ``offload`` installs: host copies, gradient hooks, and the step's copy pipeline.

Per offloaded tensor an ``Entry`` holds the host fp32 master (pinned on a CUDA mesh), the
host gradient buffer, and the device tensor it mirrors. At run time:

* backward: for gradients offloaded, a post-accumulate-grad hook (after FSDP2's
  reduce-scatter, in the backward that synchronizes) copies the gradient into its host
  buffer on the ``d2h`` stream and drops the device gradient;
* ``meshlab.optimizer``'s step: the remaining offloaded gradients are copied the same
  way (``sync_grads``), then ``host_step`` walks the tensors in order: wait for one
  tensor's gradient, update it with the CPU AdamW (the C++ loop releases the GIL), send
  the result to the device on the ``h2d`` stream, go on with the next while that copy
  runs; the step ends with the compute stream waiting for the last copy.

On a CPU mesh host and device are one memory: the same code runs with plain copies.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

import torch
from torch import nn

from ..._errors import ConfigError
from ..._tensors import local as _local
from .._gradsync import require_mesh_optimizer
from .._protocol import Part
from ._hybrid import HybridAdamW, adamw_family

_CHUNK = 64 << 20          # elements per CPU AdamW call in the step pipeline


@dataclasses.dataclass
class Entry:
    """One offloaded tensor: the model's ``param`` (or ZeRO-1 slice), its host ``master``
    and host gradient ``grad``; ``resident`` when FSDP2 keeps the shard on the host (the
    shard is the master); ``cast`` when the device copy is in the compute dtype."""

    fqn: str
    param: Any
    master: torch.Tensor
    grad: torch.Tensor | None = None
    out: torch.Tensor | None = None
    cast: bool = False
    resident: bool = False
    streamed: bool = False
    event: Any = None
    has_grad: bool = False

    @property
    def device_local(self) -> torch.Tensor:
        """The device tensor this entry mirrors (its storage: a copy into it updates the
        model)."""
        return _local(self.param).detach()


class OffloadPart(Part):
    """The runtime side of ``offload`` (see the module doc)."""

    order: ClassVar[int] = 20              # after ZeRO-1's reduce-scatter

    def __init__(self, t, ctx, choice, cast: frozenset):
        self.t, self.choice, self.cast_names = t, choice, cast
        self.device = ctx.device
        self.cuda = self.device.type == "cuda"
        self.pin = t.pin_memory and self.cuda
        self.compute = getattr(torch, t._compute(ctx.plan))
        self.zero1 = t._stage(ctx.plan) == 1
        self.params = {n: p for n, p in ctx.model.named_parameters() if p.requires_grad}
        self.entries: list[Entry] = []
        self.by_param: dict[int, Entry] = {}
        self.sync_enabled = True
        self.d2h = torch.cuda.Stream() if self.cuda else None
        self.h2d = torch.cuda.Stream() if self.cuda else None
        self.copied = {"d2h_bytes": 0, "h2d_bytes": 0}
        self._hooks = [self.params[n].register_post_accumulate_grad_hook(self._hook(n))
                       for n in sorted(choice.grads - choice.params) if n in self.params]

    # -- building the optimizer ------------------------------------------------------------
    def _host(self, t: torch.Tensor, dtype=None) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=dtype or t.dtype, pin_memory=self.pin)
        out.copy_(t)
        return out

    def make_optimizer(self, opt, cls: type, kwargs: dict, tensors: list):
        device_kwargs = adamw_family(cls, kwargs)
        hyper = {k: v for k, v in kwargs.items() if k not in device_kwargs}
        if self.zero1 and opt.zero1 is not None:
            tensors = self._zero1_entries(opt.zero1, tensors)
        else:
            tensors = [self._entry(n, p) if n in self.choice.optimizer else p
                       for n, p in opt.params]
        self._check_host_memory()
        host = {id(e.master) for e in self.entries}
        return HybridAdamW(tensors, host=host, pipeline=self, device_cls=cls,
                           device_kwargs=device_kwargs, **hyper)

    def _entry(self, fqn: str, p) -> torch.Tensor:
        loc = _local(p).detach()
        resident = fqn in self.choice.params
        if resident:                    # FSDP2 keeps this shard on the host: it is the master
            e = Entry(fqn, p, loc, resident=True)
        else:
            e = Entry(fqn, p, self._host(loc, torch.float32),
                      cast=fqn in self.cast_names, streamed=fqn in self.choice.grads)
            if e.cast:
                p.data = p.data.to(self.compute)
                e.out = torch.empty(loc.shape, dtype=self.compute, pin_memory=self.pin) \
                    if self.compute == torch.bfloat16 else None
        self.entries.append(e)
        self.by_param[id(p)] = e
        return e.master

    def _zero1_entries(self, z, tensors: list) -> list:
        """ZeRO-1: the fp32 slices of the host buckets move to the host; ``Zero1Buffers``
        reduce-scatters into them and all-gathers from them."""
        names = {id(p): n for n, p in self.params.items()}
        for b, shard in zip(z.buckets, z.shards):
            fq = [names[id(p)] for p in b.params]
            if fq[0] not in self.choice.optimizer:
                continue
            shard.data = self._host(shard.data)
            e = Entry(",".join(fq), shard, shard, resident=True)
            self.entries.append(e)
        return tensors

    def _check_host_memory(self) -> None:
        """Refuse before the moments are allocated when the host cannot hold them."""
        need = sum(e.master.numel() * 4 * 2 for e in self.entries)        # exp_avg, exp_avg_sq
        need += sum(self.params[e.fqn].numel() * self.params[e.fqn].element_size()
                    for e in self.entries if e.streamed and e.fqn in self.params)
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if need * ranks > avail:
            from ..._plan_view import _fmt_bytes

            raise ConfigError(
                f"{self.t!r}: the host-resident optimizer state needs {_fmt_bytes(need)} per "
                f"rank ({ranks} on this host), {_fmt_bytes(need * ranks)} in all, and the "
                f"host has {_fmt_bytes(avail)} free; offload a smaller fraction "
                f"(optimizer=...), or add hosts")

    # -- backward: gradients leave as they are reduced --------------------------------------
    def _hook(self, fqn: str):
        def hook(p):
            e = self.by_param.get(id(p))
            if e is None or not self.sync_enabled or p.grad is None:
                return                   # no optimizer yet, or an accumulating microbatch
            self._send_grad(e, p)
            p.grad = None
        return hook

    def _send_grad(self, e: Entry, p) -> None:
        g = _local(p.grad)
        if e.grad is None:
            e.grad = torch.empty(g.shape, dtype=g.dtype, pin_memory=self.pin)
        if e.has_grad:                   # a second backward before the step: accumulate
            if e.event is not None:
                e.event.synchronize()
            e.grad.add_(g.to("cpu"))
            return
        if self.cuda:
            self.d2h.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.d2h):
                e.grad.copy_(g, non_blocking=True)
                e.event = torch.cuda.Event()
                e.event.record()
            g.record_stream(self.d2h)
        else:
            e.grad.copy_(g)
        e.has_grad = True
        self.copied["d2h_bytes"] += g.numel() * g.element_size()

    def set_gradient_sync(self, model, enabled: bool) -> None:
        self.sync_enabled = enabled

    def sync_grads(self, params: list) -> None:
        """Copy the offloaded gradients the backward left on the device to the host."""
        for e in self.entries:
            if e.resident:
                g = getattr(e.param, "grad", None)
                e.master.grad = None if g is None else _local(g)
                continue
            if not e.has_grad and e.param.grad is not None:
                self._send_grad(e, e.param)
            e.master.grad = e.grad if e.has_grad else None

    def grad_items(self, items: list) -> list:
        """The host gradients stand for the device ones (norms and clipping see and scale
        what the CPU AdamW reads)."""
        if not self.entries or self.zero1:
            return items
        from ..zero._zero1 import shard_groups

        dev = {_local(e.param.grad).data_ptr() for e in self.entries
               if not e.resident and e.param.grad is not None}
        out = [(g, grp) for g, grp in items if g.data_ptr() not in dev]
        for e in self.entries:
            if e.resident:
                continue
            if e.event is not None:
                e.event.synchronize()
            if e.has_grad:
                out.append((e.grad, shard_groups(e.param)))
        return out

    # -- the step ----------------------------------------------------------------------------
    def host_step(self, opt, group: dict, host: list) -> None:
        from ...ops.cpu_adam import step_group

        by_master = {id(e.master): e for e in self.entries}
        todo = [by_master[id(m)] for m in host if m.grad is not None]
        i = 0
        while i < len(todo):
            chunk, n = [], 0
            while i < len(todo) and (not chunk or n < _CHUNK):
                chunk.append(todo[i])
                n += todo[i].master.numel()
                i += 1
            for e in chunk:
                if e.event is not None:
                    e.event.synchronize()
            outs = {e.master: e.out for e in chunk if e.out is not None}
            step_group(opt.state, group, [e.master for e in chunk], outs)
            for e in chunk:
                self._send_param(e)
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.h2d)

    def _send_param(self, e: Entry) -> None:
        if e.resident:
            return
        dst = e.device_local
        src = e.out if e.out is not None else e.master
        if self.cuda:
            with torch.cuda.stream(self.h2d):
                if src.dtype == dst.dtype:
                    dst.copy_(src, non_blocking=True)
                else:
                    dst.copy_(src.to(self.device, non_blocking=True))
        else:
            dst.copy_(src)
        self.copied["h2d_bytes"] += src.numel() * src.element_size()

    def zero_grad(self) -> None:
        for e in self.entries:
            e.has_grad, e.event = False, None
            e.master.grad = None

    # -- checkpoints ------------------------------------------------------------------------
    def tensor_of(self, p) -> Any:
        """The tensor the optimizer updates for model parameter ``p``."""
        e = self.by_param.get(id(p))
        return e.master if e is not None else p

    def model_state(self) -> dict:
        """FQN -> fp32 master for parameters whose device copy is in the compute dtype:
        the checkpoint saves (and loads into) those, not the rounded copy."""
        return {e.fqn: e.master for e in self.entries if e.cast}

    def refresh_master(self) -> None:
        """After a load: masters of fp32 device copies from the parameters; compute-dtype
        copies from their (loaded) masters."""
        with torch.no_grad():
            for e in self.entries:
                if e.resident:
                    continue
                if e.cast:
                    e.device_local.copy_(e.master)
                else:
                    e.master.copy_(e.device_local)
        if self.cuda:
            torch.cuda.synchronize()

    def measure(self, opt) -> dict:
        """Bytes per place and category of the tensors that exist now (the model's
        parameters and gradients, the optimizer's state, offload's host copies), read from
        the tensors themselves, for comparison with ``plan.memory()``."""
        out = {"device": dict.fromkeys(("params", "grads", "optimizer"), 0),
               "host": dict.fromkeys(("params", "grads", "optimizer"), 0)}
        seen: set = set()

        def add(t, cat, where=None):
            if t is None:
                return
            t = _local(t)
            key = (t.data_ptr(), t.dtype, t.numel())
            if key in seen or t.numel() == 0:
                return
            seen.add(key)
            place = where or ("host" if self._on_host(t) else "device")
            out[place][cat] += t.numel() * t.element_size()

        res = {id(e.param) for e in self.entries if e.resident and e.fqn in self.choice.params}
        for p in self.params.values():
            add(p, "params", "host" if id(p) in res else None)
            add(p.grad, "grads", "host" if id(p) in res else None)
        for e in self.entries:
            if not e.resident:
                add(e.master, "optimizer", "host")
            add(e.grad if e.has_grad else None, "grads", "host")
        host_ids = {id(e.master) for e in self.entries}
        for t in opt.inner.param_groups[0]["params"]:
            for v in opt.inner.state.get(t, {}).values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    add(v, "optimizer", "host" if id(t) in host_ids else None)
            if self.zero1 and id(t) not in host_ids:
                add(t, "optimizer")
                add(t.grad, "grads")
            elif self.zero1:
                add(t.grad, "grads", "host")
                add(t, "optimizer", "host")
        return out

    def _on_host(self, t) -> bool:
        return t.device.type == "cpu" and self.cuda


def install_offload(t, ctx) -> OffloadPart:
    plan = ctx.plan
    choice = t.choice(plan)
    params = [p for n, p in ctx.model.named_parameters() if n in choice.optimizer]
    require_mesh_optimizer(params, f"keeps optimizer state in host memory ({t!r})")
    return OffloadPart(t, ctx, choice, t.cast(plan, choice))
