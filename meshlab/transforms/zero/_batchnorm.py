"""Batch statistics over the data axes.

A BatchNorm normalizes with the mean and variance of the batch it is given. Where the
batch is split over data-parallel ranks, each rank's share alone would give other
statistics than the single process's, another output, other gradients and other running
statistics on each rank. The data-parallel room therefore decides, at bind time, which
BatchNorm modules compute their statistics over the data axes (``BatchStatistics``, in
the plan's decisions) and, at install, gives each a forward that does: every rank's
(mean, biased variance, count) of its share, gathered by one differentiable all-reduce,
combined as the whole batch's (the spread of the shares' means added to their
variances), so the output, the gradients (through the gathered statistics, every rank's
loss reaches every rank's inputs, as torch's ``SyncBatchNorm`` arranges) and the running
statistics (the unbiased variance of the whole batch, ``momentum`` or the cumulative
average as torch's) are the single process's, the same on every rank. Evaluation with
running statistics runs the module's own forward. Under FSDP2's mixed precision, which
casts a BatchNorm's weights to 16 bits but not its float32 running statistics (a mix
``batch_norm`` refuses), the same forward runs on any number of data ranks, with the
statistics and the normalization in float32 and the output in the input's dtype.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types

import torch
from torch import nn

from ...core.errors import ConfigError
from ...planning.decisions import register_decision

BATCH_NORM = re.compile(r"(Lazy)?BatchNorm[123]d|SyncBatchNorm")
INSTANCE_NORM = re.compile(r"(Lazy)?InstanceNorm[123]d")


@dataclasses.dataclass(frozen=True)
class BatchStatistics:
    """The BatchNorm modules whose statistics are the whole batch's, over ``axes``."""

    modules: tuple[str, ...]
    axes: tuple[str, ...]

    def to_json(self) -> dict:
        return {"modules": list(self.modules), "axes": list(self.axes)}

    @classmethod
    def from_json(cls, d: dict) -> "BatchStatistics":
        return cls(tuple(d["modules"]), tuple(d["axes"]))


register_decision("zero.batch_statistics", BatchStatistics)


def batch_norms(plan, instance: bool = False) -> list:
    """The plan's model's BatchNorm modules (``ModuleInfo``), in order; its InstanceNorm
    modules too with ``instance``."""
    return [m for m in plan.model.modules if BATCH_NORM.fullmatch(m.cls) or
            (instance and INSTANCE_NORM.fullmatch(m.cls))]


def choose(plan, cast: bool = False) -> BatchStatistics | None:
    """The model's BatchNorm modules (and InstanceNorm ones, whose running statistics are
    averaged), where the batch is split over more than one rank; its BatchNorm modules
    alone where (``cast``: FSDP2's mixed precision) their weights are cast to 16 bits
    beside float32 running statistics, which ``batch_norm`` does not take together."""
    axes = plan.roles.data
    split = math.prod(plan.mesh_shape[a] for a in axes) > 1
    if not split and not cast:
        return None
    mods = tuple(m.fqn for m in batch_norms(plan, instance=split))
    return BatchStatistics(mods, axes) if mods else None


def comm(plan) -> list:
    """The collectives ``install`` adds to a training step (``plan.comm()``): a BatchNorm's
    all-gather of the ranks' (mean, variance, count) rows in its forward and the
    reduce-scatter of their gradients in its backward, an InstanceNorm's all-reduce of its
    two running statistics; float32 (float64 for float64 weights)."""
    from ...planning.rows import CommOp

    axes = plan.roles.data
    size = math.prod(plan.mesh_shape[a] for a in axes)
    if size == 1:
        return []
    wide = {e.fqn.rpartition(".")[0] for e in plan.params if str(e.dtype) == "float64"}
    ops = []
    for m in batch_norms(plan, instance=True):
        c, nbytes = m.get("num_features") or 0, 8 if m.fqn in wide else 4
        if BATCH_NORM.fullmatch(m.cls):
            table = size * (2 * c + 1) * nbytes
            ops += [CommOp("all_gather", "_".join(axes), 1, table),
                    CommOp("reduce_scatter", "_".join(axes), 1, table)]
        elif m.get("track_running_stats"):
            ops.append(CommOp("all_reduce", "_".join(axes), 2, 2 * c * nbytes))
    return ops


def refuse_in_microbatches(model: nn.Module, where: str, fix: str) -> None:
    """A BatchNorm of ``model`` normalizing with batch statistics (training, or no running
    statistics) sees each microbatch alone, where the step it stands for sees the batch:
    refused by name."""
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and \
                (m.training or not m.track_running_stats):
            raise microbatch_error(where, name, type(m).__name__, False, fix)
        if isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.training and \
                m.track_running_stats:
            raise microbatch_error(where, name, type(m).__name__, True, fix)


def microbatch_error(where: str, name: str, cls: str, running: bool,
                     fix: str) -> ConfigError:
    """The refusal of a norm that microbatches would see one at a time: a BatchNorm
    normalizing with each one's statistics, or (``running``) an InstanceNorm updating its
    running statistics once per microbatch."""
    what = "update its running statistics once per microbatch, where one step over the " \
        "whole batch updates them once" if running else "normalize each microbatch with " \
        "its own statistics, where one step over the whole batch normalizes with the batch's"
    return ConfigError(f"{where}: {name} ({cls}) would {what}; {fix}")


def install(model: nn.Module, stats: BatchStatistics, group, dropped=()) -> None:
    """Each of ``stats.modules`` this rank holds computes its batch statistics over
    ``group``."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    mods = dict(model.named_modules())
    for name in stats.modules:
        m = mods.get(name) if name not in dropped else None
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.forward = types.MethodType(_forward_over(group, size), m)
        elif isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.track_running_stats:
            m.register_forward_hook(_running_mean_over(group, size))


def _running_mean_over(group, size: int):
    """An InstanceNorm's running statistics are the batch's mean of its instances'; each
    rank's update, averaged over the (equal) shares, is the whole batch's (the update is
    linear in the mean)."""
    import torch.distributed as dist

    def hook(module, args, out):
        if module.training:
            with torch.no_grad():
                for buf in (module.running_mean, module.running_var):
                    dist.all_reduce(buf, group=group)
                    buf.div_(size)
        return None

    return hook


def _forward_over(group, size: int):
    own = nn.modules.batchnorm._BatchNorm.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and self.running_mean is not None:
            if x.dtype == self.running_mean.dtype and (
                    self.weight is None or self.weight.dtype == x.dtype):
                return own(self, x)         # evaluation with running statistics
            self._check_input_dim(x)        # the same, from 16-bit weights or input
            return _normalized(self, x, self.running_mean, self.running_var)
        self._check_input_dim(x)
        mean, var, n = _whole_batch(x, group, size)
        if self.training and self.track_running_stats and self.running_mean is not None:
            self.num_batches_tracked.add_(1)
            f = 1.0 / float(self.num_batches_tracked) if self.momentum is None \
                else self.momentum
            with torch.no_grad():
                unbiased = var.detach() * n / (n - 1).clamp(min=1)
                self.running_mean.mul_(1 - f).add_(mean.detach().to(self.running_mean.dtype),
                                                  alpha=f)
                self.running_var.mul_(1 - f).add_(unbiased.to(self.running_var.dtype),
                                                 alpha=f)
        return _normalized(self, x, mean, var)

    return forward


def _normalized(bn, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """``x`` normalized with ``mean`` and ``var`` and scaled by ``bn``'s weight and bias,
    in the statistics' precision (float32 at least), returned in ``x``'s dtype."""
    shape = (1, -1) + (1,) * (x.dim() - 2)
    dt = torch.promote_types(mean.dtype, torch.float32)
    y = (x.to(dt) - mean.to(dt).view(shape)) * torch.rsqrt(var.to(dt) + bn.eps).view(shape)
    if bn.weight is not None:
        y = y * bn.weight.to(dt).view(shape) + bn.bias.to(dt).view(shape)
    return y.to(x.dtype)


def _whole_batch(x: torch.Tensor, group, size: int):
    """(mean, biased variance, count) of the whole batch, as tensors the host does not
    read, from each rank's share: one all-gather of the ranks' rows into a table,
    differentiable (its backward reduce-scatters: each rank gets the sum of every rank's
    gradient of its row)."""
    from torch.distributed._functional_collectives import all_gather_single_autograd

    dims = [0, *range(2, x.dim())]
    xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
    n = xf.numel() // max(xf.shape[1], 1)
    mean = xf.sum(dims) / max(n, 1)
    shape = (1, -1) + (1,) * (x.dim() - 2)
    var = (xf - mean.view(shape)).square().sum(dims) / max(n, 1)
    if size == 1:
        return mean, var, mean.new_full((), float(n))
    row = torch.cat([mean, var, mean.new_full((1,), float(n))])
    table = all_gather_single_autograd(row[None], 0, group)
    c = x.shape[1]
    means, variances, counts = table[:, :c], table[:, c:2 * c], table[:, 2 * c:]
    total = counts.sum()
    whole = (counts * means).sum(0) / total
    spread = (counts * (variances + (means - whole).square())).sum(0) / total
    return whole, spread, total.detach()
