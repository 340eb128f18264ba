"""Module outputs for ``verify``: forward hooks that keep each module's first output of a
step, and their comparison, module by module in the reference's execution order.

A layout's output is compared as a whole value: a DTensor is gathered (``full_tensor``);
a plain tensor is either the rank's rows of the whole value (its share of the batch, or the
first microbatch of it), or a shard along another dimension. Such a shard is gathered where
the plan records the module's output layout (``plan.activations``, e.g. Megatron sequence
parallelism's blocks) and otherwise skipped with a note: gathering by a guessed layout
could report a divergence that is not there (ring attention's blocks are not contiguous).
Compiled modules and what is inside them are not hooked: a hook inside a compiled graph
would break it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from ._verify_report import Diff

# Wrappers that rename a module without changing what it computes.
_WRAPPERS = re.compile(r"(^|\.)(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)"
                       r"(?=\.|$)")


def clean(name: str) -> str:
    """``name`` without the segments wrappers add (compiled, checkpointed modules)."""
    return _WRAPPERS.sub("", name).lstrip(".")


def tensors(out) -> list:
    """The tensors of a module's output, in order (tuples, lists, mappings, model
    outputs); anything else (caches, None) is left out."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, Mapping):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in tensors(o)]
    return []


@dataclasses.dataclass
class Record:
    """A module's last output of a step (its tensors, whole where they were DTensors),
    the order of its first call, and the sample of the global batch the rank's share ends
    before: the last call holds the share's last rows (its last microbatch)."""

    order: int
    values: list
    end: int


def aligned(a: torch.Tensor, a_end: int, b: torch.Tensor, b_end: int, b_samples: int):
    """``a`` (the layout's, rows ending at sample ``a_end``) and ``b`` (the reference's,
    ``b_samples`` samples ending at ``b_end``) cut to the samples both hold, or None where
    their shapes do not line up. A first dimension that is a multiple of the samples holds
    ``k`` rows per sample (the batch, or its tokens flattened); any other is compared
    whole."""
    if a.dim() and b.dim() and b_samples and b.shape[0] % b_samples == 0 \
            and a.shape[1:] == b.shape[1:]:
        k = b.shape[0] // b_samples
        if k and a.shape[0] % k == 0 and (a.shape != b.shape or a_end != b_end):
            a_start, b_start = a_end - a.shape[0] // k, b_end - b_samples
            lo, hi = max(a_start, b_start), min(a_end, b_end)
            if lo >= hi:
                return None
            return (a[(lo - a_start) * k:(hi - a_start) * k],
                    b[(lo - b_start) * k:(hi - b_start) * k])
    return (a, b) if a.shape == b.shape else None


class Watch:
    """Forward hooks on every module of ``model`` (compiled ones and their insides
    excepted): the last output of each module per step, in the order of first calls.

    The last call, not the first: a pipeline stage's first call of a step may be the
    schedule's shape inference on uninitialized tensors; later calls are microbatches, and
    a recompute (remat) repeats its forward's values."""

    def __init__(self, model: nn.Module, end: int, gather=None):
        self.end, self.gather = end, gather
        self.records: dict[str, Record] = {}
        self.skipped: list[str] = []
        self.handles = []
        compiled = [n for n, m in model.named_modules()
                    if getattr(m, "_compiled_call_impl", None) is not None]
        for name, m in model.named_modules():
            if any(name == c or name.startswith(c + ".") or c == "" for c in compiled):
                continue
            self.handles.append(m.register_forward_hook(self._hook(clean(name) or "(model)")))
        self.skipped += [f"{c or 'the model'} is compiled: the outputs of it and of the modules "
                         f"inside it are not observed" for c in compiled]

    def _hook(self, name: str):
        def hook(_module, _args, out):
            with torch.no_grad():
                values = [self._whole(name, i, t) for i, t in enumerate(tensors(out))]
            old = self.records.get(name)
            self.records[name] = Record(len(self.records) if old is None else old.order,
                                        values, self.end)
        return hook

    def _whole(self, name: str, i: int, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        t = t.detach()
        if isinstance(t, DTensor):
            # gloo gathers no 16-bit floats; the comparison is in float64 anyway
            return (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).full_tensor()
        if self.gather is not None:
            return self.gather(name, i, t)
        return t.clone()

    def reset(self, end: int | None = None) -> None:
        """Forget the step's outputs; the next step's share ends before sample ``end``."""
        self.records = {}
        if end is not None:
            self.end = end

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def compare(layout: Watch, reference: Watch, samples: int, atol: float, rtol: float):
    """The modules both recorded, in the reference's execution order, as ``Diff`` values
    (the largest over a module's output tensors), and the names of those whose output is
    a part of the reference's in a layout the plan does not record (not compared)."""
    diffs, skipped = [], []
    for name, ref in sorted(reference.records.items(), key=lambda kv: kv[1].order):
        got = layout.records.get(name)
        if got is None:
            continue
        worst, scale, compared = 0.0, 0.0, False
        for a, b in zip(got.values, ref.values):
            pair = aligned(a, got.end, b, ref.end, samples)
            if pair is None:
                if name not in skipped:
                    skipped.append(name)
                continue
            x, y = (v.to(torch.float64) for v in pair)
            if x.numel():
                worst = max(worst, (x - y).abs().max().item())
                scale = max(scale, y.abs().max().item())
            compared = True
        if compared:
            diffs.append(Diff(name, worst, scale, worst <= atol + rtol * scale))
    return diffs, skipped


def plan_gather(rt, reference: Watch, samples: int):
    """A gather for the layout's ``Watch``: a plain tensor that is a shard, along a
    dimension the plan records as split over a mesh axis, of the reference's output is
    gathered over that axis; anything else is kept as it is."""
    outputs = {clean(a.module): a.output for a in rt.plan.activations if a.output is not None}
    data = set(rt.roles.data)

    def gather(name: str, i: int, t: torch.Tensor) -> torch.Tensor:
        ref = reference.records.get(name)
        spec = outputs.get(name)
        if ref is None or spec is None or i >= len(ref.values):
            return t.clone()
        want = ref.values[i]
        if aligned(t, 0, want, 0, samples) is not None or t.dim() != want.dim():
            return t.clone()
        for d, entry in enumerate(tuple(spec)):
            axes = tuple(x for x in ((entry,) if isinstance(entry, str) else (entry or ()))
                         if x not in data)
            if d == 0 or not axes or t.shape[d] * rt.size(*axes) != want.shape[d]:
                continue
            t = _all_gather(t, d, rt.group(*axes), rt.size(*axes))
        return t

    return gather


def _all_gather(t: torch.Tensor, dim: int, group, size: int) -> torch.Tensor:
    t = (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).contiguous()
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts, dim)
