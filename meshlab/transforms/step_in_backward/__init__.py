"""step_in_backward: each parameter updated by the optimizer as soon as its gradient is
complete in the backward, and the gradient freed there.

The room: ``StepInBackward`` (a plan value), its check (a mesh of one rank, or one that
only ``zero_shard(3)`` spreads over; the rooms it is not yet shown with are the composition
table's), its estimate (no gradient is held
across the backward: the ``grads`` rows go, and the largest single gradient is added to
the peak) and its runtime part, which builds the optimizer ``meshlab.optimizer`` asks for
as one optimizer per bucket (a repeated block's parameters, or one parameter outside the
blocks) and steps a bucket from its parameters' post-accumulate-grad hooks once all of its
gradients are complete.

Why: an ordinary step holds every gradient at once, between the end of the backward and
``opt.step()``, so the step's peak is at least parameters + optimizer state + all
gradients. Stepped in the backward, at most one block's gradients are alive, and the
memory they took holds activations instead (fewer blocks checkpointed for the same peak). The update is
the optimizer's own, per bucket, so the weights equal the ordinary step's.

What it rules out, each refused with a typed error: gradient clipping and the non-finite
check (they need the global norm before any update), fp16 loss scaling, microbatches
and ``no_sync`` (a gradient is used when it is first complete), and, until shown,
every other room that synchronizes or places gradients (data parallel, ZeRO-1 and 2,
tensor and pipeline parallel, offload, experts). Under ``zero_shard(3)`` FSDP2 calls each
sharded parameter's post-accumulate-grad hooks once its unit's gradients are
reduce-scattered, so a block is stepped on its shard after that reduction. ``opt.step()``
then updates only what the backward did not (a gradient set by hand), and
``opt.zero_grad()`` clears those.

>>> step_in_backward()
step_in_backward()
"""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from typing import ClassVar

import torch

from ...core.errors import ConfigError
from ...planning.plan import Plan
from .._protocol import Part, Phase, Transform

@dataclasses.dataclass(frozen=True)
class StepInBackward(Transform):
    """Update each parameter in the backward, as its gradient completes (module doc)."""

    kind: ClassVar[str] = "step_in_backward"
    phase: ClassVar[Phase] = Phase.OPTIMIZER

    def check(self, plan: Plan) -> None:
        """One rank, or ranks that only ``zero_shard(3)`` spreads over: FSDP2 hands each
        unit's reduce-scattered gradients to the parameters' post-accumulate-grad hooks,
        so a unit is stepped once its gradients are summed over the data ranks."""
        ranks = math.prod(plan.mesh_shape.values())
        if ranks == 1:
            return
        zero = next((r for r in plan.rooms if r.kind == "zero"), None)
        spread = {a for a, n in plan.mesh_shape.items() if n > 1}
        if zero is None or zero.stage != 3 or zero.replicate or not spread <= set(zero.axis):
            raise ConfigError(f"step_in_backward() on a mesh of {ranks} ranks "
                              f"({plan.mesh_shape}): it is shown on one process and under "
                              f"zero_shard(3) over the data axes alone; use a mesh of one "
                              f"rank, zero_shard(3, axis) over every axis of the mesh, or "
                              f"leave it out")

    def install(self, ctx) -> Part:
        return InBackward(tuple(ctx.plan.model.blocks))

    def memory(self, plan: Plan, rows: list) -> list:
        """No gradient is held across the step: the ``grads`` rows go (the activation peak
        keeps the ones alive there, and ``transients`` the largest one)."""
        return [r for r in rows if r.category != "grads"]

    def transients(self, plan: Plan, *, batch: int, seq: int) -> list:
        from ...planning.rows import ActRow
        from ...core.units import dtype_bytes

        sizes: dict[str, int] = {}
        for e in plan.params:
            if e.requires_grad and e.tied_to is None:
                b = bucket_of(e.fqn, plan.model.blocks)
                sizes[b] = sizes.get(b, 0) + e.numel * dtype_bytes(e.dtype)
        if not sizes:
            return []
        b = max(sizes, key=sizes.get)
        return [ActRow(module=b, op="grad", dtype="", shape=(), bytes=float(sizes[b]),
                       note="the largest bucket's gradients, alive until its update")]

    def __repr__(self) -> str:
        return "step_in_backward()"


def step_in_backward() -> StepInBackward:
    """Update each parameter in the backward as soon as its gradient is complete, freeing
    the gradient there (see the module doc)."""
    return StepInBackward()


class Buckets(torch.optim.Optimizer):
    """``cls`` once per bucket of parameters (a repeated block's, or one parameter outside
    the blocks), behind one optimizer's ``param_groups`` and ``state``: the state dict is
    the one ``cls`` over all of them would have (checkpoints move between the two), and a
    scheduler's change to the group reaches every bucket at its next update. A bucket is
    updated, and its gradients dropped, when the last of its parameters' gradients is
    complete: one launch of a fused optimizer per block, at most one block's gradients
    alive. The hooks hold the optimizer weakly, so a model and an optimizer dropped
    together are freed (a tensor's hooks are out of the garbage collector's sight)."""

    def __init__(self, params: list, buckets: list[list[int]], cls: type, kwargs: dict):
        params = list(params)
        each = [cls([params[i] for i in b], **kwargs) for b in buckets]
        # The defaults cls fills in, so the state dict's groups are the ones cls writes.
        super().__init__(params, dict(each[0].defaults) if each else dict(kwargs))
        self.buckets = [([params[i] for i in b], opt) for b, opt in zip(buckets, each)]
        self.pending = [0] * len(buckets)
        for opt in each:
            opt.state = self.state              # one state, keyed by parameter, for all
        me = weakref.ref(self)
        self.hooks = [params[i].register_post_accumulate_grad_hook(
            functools.partial(_arrived, me, k)) for k, b in enumerate(buckets) for i in b]

    def arrived(self, k: int) -> None:
        """A gradient of bucket ``k`` is complete; update the bucket once all are."""
        self.pending[k] += 1
        if self.pending[k] == len(self.buckets[k][0]):
            self.update(k)

    def update(self, k: int) -> None:
        """Step bucket ``k`` with the gradients it holds, then drop them."""
        params, opt = self.buckets[k]
        group, mine = self.param_groups[0], opt.param_groups[0]
        for key, v in group.items():
            if key != "params" and mine.get(key) is not v:
                mine[key] = v
        opt.step()
        for p in params:
            p.grad = None
        self.pending[k] = 0

    @torch.no_grad()
    def step(self, closure=None):
        """Updates the buckets holding gradients the backward did not use (a parameter
        without a gradient this step kept its bucket waiting, or one set by hand)."""
        for k, (params, _) in enumerate(self.buckets):
            if any(p.grad is not None for p in params):
                self.update(k)
            self.pending[k] = 0

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []


def _arrived(ref, k: int, _param) -> None:
    opt = ref()
    if opt is not None:
        opt.arrived(k)


def bucket_of(name: str, blocks: tuple[str, ...]) -> str:
    """The bucket of parameter ``name``: the repeated block it is in, else itself."""
    return next((b for b in blocks if name.startswith(b + ".")), name)


class InBackward(Part):
    """The runtime's share: the per-parameter optimizer and the refusals that need the
    optimizer or the step to see."""

    def __init__(self, blocks: tuple[str, ...] = ()):
        self.blocks = blocks
        self.optimizer: Buckets | None = None

    def make_optimizer(self, opt, cls: type, kwargs: dict, tensors: list):
        what = ("clip_grad_norm" if opt.clip is not None else
                "nonfinite" if opt.nonfinite is not None else
                "precision('fp16')'s loss scaling" if opt.scaler is not None else None)
        if what is not None:
            raise ConfigError(f"step_in_backward() with {what}: each parameter is updated "
                              f"before the global gradient norm is known; leave one of "
                              f"them out")
        if self.optimizer is not None:          # a new optimizer replaces the last one's hooks
            self.optimizer.remove()
        if len(tensors) != len(opt.params) or any(t is not p for t, (_, p) in
                                                  zip(tensors, opt.params)):
            raise ConfigError("step_in_backward() with a room that gives the optimizer other "
                              "tensors than the parameters is not supported; leave one out")
        index: dict[str, list[int]] = {}
        for i, (name, _) in enumerate(opt.params):
            index.setdefault(bucket_of(name, self.blocks), []).append(i)
        self.optimizer = Buckets(tensors, list(index.values()), cls, kwargs)
        return self.optimizer

    def set_gradient_sync(self, model, enabled: bool) -> None:
        if not enabled:
            raise ConfigError("step_in_backward() updates each parameter when its gradient "
                              "is first complete, so gradients cannot accumulate over "
                              "microbatches or under no_sync; use one microbatch, or leave "
                              "step_in_backward() out")
