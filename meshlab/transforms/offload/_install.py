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

from ...core.errors import ConfigError
from ...core.tensors import local as _local
from .._gradsync import require_mesh_optimizer
from .._protocol import Part
from ._hybrid import HybridAdamW, adamw_family


@dataclasses.dataclass
class Entry:
    """One offloaded tensor: the model's ``param`` (or ZeRO-1 slice), its host ``master``
    and host gradient ``grad``; ``resident`` when FSDP2 keeps the shard on the host (the
    shard is the master); ``cast`` when the device copy is in the compute dtype."""

    fqn: str
    param: Any
    master: torch.Tensor
    grad: torch.Tensor | None = None
    out_dtype: torch.dtype | None = None        # bf16 copy the C++ loop writes for the device
    cast: bool = False
    resident: bool = False
    streamed: bool = False
    event: Any = None
    has_grad: bool = False       # the backward sent the gradient to ``grad``

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
        self.chunk = t.chunk_elements     # elements per CPU AdamW call
        self._staging: list | None = None
        # host tensor -> its gradient for the step (bf16 gradients of fp32 masters cannot
        # be a ``.grad``): host buffers, FSDP2's host shards' gradients, staging views
        self.grads: dict = {}
        self._hooks = [self.params[n].register_post_accumulate_grad_hook(self._hook(n))
                       for n in sorted(choice.grads - choice.params) if n in self.params]

    # -- building the optimizer ------------------------------------------------------------
    def _host(self, t: torch.Tensor, dtype=None, pin: bool = True) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=dtype or t.dtype, pin_memory=self.pin and pin)
        out.copy_(t)
        return out

    def make_optimizer(self, opt, cls: type, kwargs: dict, tensors: list):
        device_kwargs = adamw_family(cls, kwargs)
        # The update's hyper-parameters (torch's neutral defaults the check let through,
        # amsgrad=False and the like, are the CPU AdamW's own behaviour).
        hyper = {k: v for k, v in kwargs.items() if k in ("lr", "betas", "eps", "weight_decay")}
        self._check_host_memory(opt)
        if self.zero1 and opt.shards:
            tensors = self._zero1_entries(opt, tensors)
            groups = opt.torch_groups(tensors)
        else:
            pairs = [(p, self._entry(n, p) if n in self.choice.optimizer else p)
                     for n, p in opt.params]
            groups = opt.torch_groups([t for _, t in pairs], {id(t): p for p, t in pairs})
        host = {id(e.master) for e in self.entries}
        return HybridAdamW(groups, host=host, pipeline=self, device_cls=cls,
                           device_kwargs=device_kwargs, **hyper)

    def _entry(self, fqn: str, p) -> torch.Tensor:
        loc = _local(p).detach()
        resident = fqn in self.choice.params
        if resident:                    # FSDP2 keeps this shard on the host: it is the master
            e = Entry(fqn, p, loc, resident=True)
        else:
            cast = fqn in self.cast_names
            # A bf16 device copy the C++ loop writes itself (no fp32 copy crosses).
            device_dtype = self.compute if cast else loc.dtype
            out = torch.bfloat16 if device_dtype == torch.bfloat16 else None
            # Pinned only where the device copy is sent from it (fp32 device copies).
            # float32 masters (float64 for a float64 model, which float32 would round)
            master = torch.promote_types(loc.dtype, torch.float32)
            e = Entry(fqn, p, self._host(loc, master, pin=out is None), out_dtype=out,
                      cast=cast, streamed=fqn in self.choice.grads)
            if cast:
                p.data = p.data.to(self.compute)
        self.entries.append(e)
        self.by_param[id(p)] = e
        return e.master

    def _zero1_entries(self, opt, tensors: list) -> list:
        """ZeRO-1: the fp32 slices of the host buckets (``opt.buckets``, ``opt.shards``)
        move to the host; ZeRO-1 reduce-scatters into them and all-gathers from them."""
        names = {id(p): n for n, p in self.params.items()}
        for b, shard in zip(opt.buckets, opt.shards):
            fq = [names[id(p)] for p in b.params]
            if fq[0] not in self.choice.optimizer:
                continue
            shard.data = self._host(shard.data)
            e = Entry(",".join(fq), shard, shard, resident=True)
            self.entries.append(e)
        return tensors

    def _check_host_memory(self, opt) -> None:
        """Refuse before anything is allocated on the host when it cannot hold the masters,
        the moments and the offloaded gradients (12 bytes per element, plus the gradient)."""
        need = 0
        for n, p in opt.params:
            if n in self.choice.optimizer:
                k = _local(p).numel()
                need += k * (8 if n in self.choice.params or self.zero1 else 12)
                if n in self.choice.grads and n not in self.choice.params:
                    need += k * p.element_size()
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if need * ranks > avail:
            from ...core.units import fmt_bytes

            raise ConfigError(
                f"{self.t!r}: the host-resident optimizer state needs {fmt_bytes(need)} per "
                f"rank ({ranks} on this host), {fmt_bytes(need * ranks)} in all, and the "
                f"host has {fmt_bytes(avail)} free; offload a smaller fraction "
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
        """Point the host masters at their gradients: FSDP2's host shards' and those the
        backward already sent; the rest are fetched by ``host_step``, chunk by chunk."""
        self.grads.clear()
        for e in self.entries:
            if e.resident:
                g = getattr(e.param, "grad", None)
                if g is not None:
                    self.grads[e.master] = _local(g)
            elif e.has_grad:
                self.grads[e.master] = e.grad

    def grad_items(self, items: list) -> list:
        """Gradients the backward sent to the host stand for the device ones (norms and
        clipping see and scale what the CPU AdamW reads)."""
        if not self.entries or self.zero1:
            return items
        from ...core.tensors import shard_groups

        out = list(items)
        for e in self.entries:
            if e.has_grad:
                if e.event is not None:
                    e.event.synchronize()
                out.append((e.grad, shard_groups(e.param)))
        return out

    # -- the step ----------------------------------------------------------------------------
    def host_step(self, opt, groups: list) -> None:
        """Update the host tensors of each ``(group, tensors)`` of ``groups`` chunk by
        chunk (a chunk within one group, stepped with its options): while the CPU AdamW runs
        on one chunk, the next chunk's gradients come in and the previous chunk's results
        go out."""
        from ...ops.cpu_adam import step_group

        by_master = {id(e.master): e for e in self.entries}
        chunks, options = [], []
        for group, host in groups:
            todo = [by_master[id(m)] for m in host]
            todo = [e for e in todo if e.master.grad is not None or e.master in self.grads
                    or self._fetched(e)]
            for c in chunk_indices([e.master.numel() for e in todo], self.chunk):
                chunks.append([todo[i] for i in c])
                options.append(group)
        if not chunks:
            return
        slots = self._slots(chunks)
        self._fetch(chunks[0], slots[0])
        for i, (chunk, group) in enumerate(zip(chunks, options)):
            slot = slots[i % 2]
            if i + 1 < len(chunks):
                self._fetch(chunks[i + 1], slots[(i + 1) % 2])
            slot.wait_in()
            for e in chunk:
                if e.event is not None:
                    e.event.synchronize()
            outs = {e.master: slot.out_view(e) for e in chunk if e.out_dtype is not None}
            step_group(opt.state, group, [e.master for e in chunk], outs, self.grads)
            self._send(chunk, slot, outs)
        self.grads.clear()                     # views into staging slots among them
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.h2d)

    def _fetched(self, e: Entry) -> bool:
        """Whether the step copies ``e``'s gradient from the device itself."""
        return not e.resident and e.master.grad is None and e.master not in self.grads and \
            e.param.grad is not None

    def _slots(self, chunks) -> list:
        need_g = max(sum(_aligned(_local(e.param.grad).numel() * e.param.grad.element_size())
                         for e in c if self._fetched(e)) for c in chunks)
        need_o = max(sum(_aligned(e.master.numel() * 2) for e in c if e.out_dtype is not None)
                     for c in chunks)
        if self._staging is None or self._staging[0].cap_g < need_g or \
                self._staging[0].cap_o < need_o:
            self._staging = [_Slot(need_g, need_o, self.pin) for _ in range(2)]
        return self._staging

    def _fetch(self, chunk, slot) -> None:
        """Copy a chunk's device gradients into ``slot`` (on the ``d2h`` stream)."""
        slot.wait_out()                       # the slot's previous results have left
        slot.reset()
        todo = [e for e in chunk if self._fetched(e)]
        if not todo:
            return
        if self.cuda:
            self.d2h.wait_stream(torch.cuda.current_stream())
        for e in todo:
            g = _local(e.param.grad)
            buf = slot.grad_view(g)
            if self.cuda:
                with torch.cuda.stream(self.d2h):
                    buf.copy_(g, non_blocking=True)
            else:
                buf.copy_(g)
            self.grads[e.master] = buf.view(e.master.shape)
            self.copied["d2h_bytes"] += g.numel() * g.element_size()
        if self.cuda:
            slot.d2h = torch.cuda.Event()
            slot.d2h.record(self.d2h)

    def _send(self, chunk, slot, outs) -> None:
        """The updated chunk to the device (on the ``h2d`` stream)."""
        if self.cuda:
            self.h2d.wait_stream(torch.cuda.current_stream())
        for e in chunk:
            if e.resident:
                continue
            dst = e.device_local
            src = outs.get(e.master, e.master)
            if self.cuda:
                with torch.cuda.stream(self.h2d):
                    if src.dtype == dst.dtype:
                        dst.copy_(src.view_as(dst), non_blocking=True)
                    else:      # cast on the host: no full-size fp32 copy on the device
                        dst.copy_(src.to(dst.dtype).view_as(dst), non_blocking=True)
            else:
                dst.copy_(src.view_as(dst))
            self.copied["h2d_bytes"] += src.numel() * src.element_size()
        if self.cuda:
            slot.h2d = torch.cuda.Event()
            slot.h2d.record(self.h2d)

    def zero_grad(self) -> None:
        self.grads.clear()
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

        # the parameters FSDP2 keeps on the host (under ZeRO-1 too, whose entries are slices)
        res = {id(p) for n, p in self.params.items() if n in self.choice.params}
        for p in self.params.values():
            add(p, "params", "host" if id(p) in res else None)
            add(p.grad, "grads", "host" if id(p) in res else None)
        for e in self.entries:
            if not e.resident:
                add(e.master, "optimizer", "host")
            add(e.grad if e.has_grad else None, "grads", "host")
        out["host"]["staging"] = sum(s.g.numel() + s.o.numel() for s in self._staging or ())
        host_ids = {id(e.master) for e in self.entries}
        for t in (t for g in opt.inner.param_groups for t in g["params"]):
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

def _aligned(n: int) -> int:
    return -(-n // 64) * 64


def chunk_indices(numels: list[int], cap: int) -> list[list[int]]:
    """Consecutive tensors grouped into chunks of at most ``cap`` elements (a larger
    tensor is a chunk of its own)."""
    out: list[list[int]] = []
    n = 0
    for i, k in enumerate(numels):
        if not out or n + k > cap:
            out.append([])
            n = 0
        out[-1].append(i)
        n += k
    return out


class _Slot:
    """Pinned staging for one chunk: its device gradients in, its bf16 results out."""

    def __init__(self, cap_g: int, cap_o: int, pin: bool):
        self.cap_g, self.cap_o = cap_g, cap_o
        self.g = torch.empty(max(cap_g, 1), dtype=torch.uint8, pin_memory=pin)
        self.o = torch.empty(max(cap_o, 1), dtype=torch.uint8, pin_memory=pin)
        self.d2h = self.h2d = None
        self.off_g = self.off_o = 0

    def reset(self) -> None:
        self.off_g = self.off_o = 0

    def grad_view(self, g: torch.Tensor) -> torch.Tensor:
        n = g.numel() * g.element_size()
        v = self.g[self.off_g:self.off_g + n].view(g.dtype).view(g.shape)
        self.off_g += _aligned(n)
        return v

    def out_view(self, e: Entry) -> torch.Tensor:
        n = e.master.numel() * 2
        v = self.o[self.off_o:self.off_o + n].view(torch.bfloat16).view(e.master.shape)
        self.off_o += _aligned(n)
        return v

    def wait_in(self) -> None:
        if self.d2h is not None:
            self.d2h.synchronize()

    def wait_out(self) -> None:
        if self.h2d is not None:
            self.h2d.synchronize()
