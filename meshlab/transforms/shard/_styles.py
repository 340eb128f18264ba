"""Tensor-parallel styles: how one module's parameters are placed and its forward joined.

A style is a small frozen value with two methods: ``placements(name, ndim)`` gives the
DTensor placements (over the TP axis) of the module's parameter ``name``, and
``hooks(module, tp)`` returns the pre/post forward hooks that run the module's own
``forward`` on local shards and join the regions with the differentiable collectives.

=============  ===========================  ==============================================
style          parameters (DTensor on tp)    forward
=============  ===========================  ==============================================
ColWise        weight/bias split on out      local matmul; region entry does f / gather;
                                             ``gather_output``: all-gathered after
RowWise        weight split on in; bias R    local matmul, then g / reduce-scatter, + bias;
                                             ``split_input``: a whole input sliced first
VocabEmbed     weight split on vocab rows    ids outside the shard masked, then g
EmbedColWise   weight split on columns       local lookup; output stays split (heads)
VocabHead      weight (and bias) on vocab    f / gather on input; logits stay vocab-sharded
KVReplicated   weight/bias replicated        local heads of a replicated K/V projection
=============  ===========================  ==============================================

Why these and not DTensor's stock styles (``parallelize_module`` with ``ColwiseParallel``
/ ``RowwiseParallel``): the stock ones have no replicated K/V heads, head slicing or
column-split embedding, and on the same Llama layout meshlab's step took 0.88x the stock
path's time on 2 CPU gloo ranks (``benchmarks/tp_styles.py``,
``benchmarks/results/tp_styles_cpu_gloo.json``; both exact). Whether to move onto the stock
path is decided on GPU tokens/s, eager and compiled, which that script is to measure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import torch

from ...core import collectives as C
from ...core.placement import dim_block
from ...core.tensors import local as _local
from .._head import mark_vocab_split


_WHOLE = threading.local()


@contextlib.contextmanager
def whole_logits():
    """Inside this block a vocabulary-split head returns the whole logits as a plain
    tensor (all-gathered over tp), as decoding reads them; nested blocks are fine."""
    _WHOLE.depth = getattr(_WHOLE, "depth", 0) + 1
    try:
        yield
    finally:
        _WHOLE.depth -= 1


def _whole() -> bool:
    return getattr(_WHOLE, "depth", 0) > 0


@dataclasses.dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel axis a style installs over."""

    mesh: object          # the 1-D DeviceMesh of the axis
    group: object         # its process group
    rank: int
    size: int
    sp: bool              # Megatron sequence parallelism between the regions


class _LocalParams:
    """Exposes local shards as ``module.weight`` etc. for the module's own forward."""

    def __init__(self, names: tuple[str, ...], zero_bias: bool, conv1d: bool):
        self.names, self.zero_bias, self.conv1d = names, zero_bias, conv1d

    def enter(self, module) -> None:
        for n in self.names:
            # a weight held as a buffer: a pipeline's last stage's copy of a tied head
            p = module._parameters.get(n, module._buffers.get(n))
            if p is None:
                continue
            if n == "bias" and self.zero_bias:
                # Row-parallel: the bias is added once, after the reduction.
                module.__dict__[n] = torch.zeros_like(_local(p)).detach() if self.conv1d \
                    else None
            else:
                module.__dict__[n] = _local(p)

    def exit(self, module) -> None:
        for n in self.names:
            module.__dict__.pop(n, None)


def _shard(dim: int, packed: int):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=packed) if packed > 1 else Shard(dim)


def _names(m) -> tuple[str, ...]:
    return tuple(k for k, v in m._parameters.items() if v is not None)


@dataclasses.dataclass(frozen=True)
class ColWise:
    """Output features split: ``y_local = x W_local^T``."""

    conv1d: bool = False      # GPT-2 Conv1D: weight is (in, out)
    packed: int = 1           # fused projections (q|k|v): each part split
    in_region: bool = False   # input already entered the TP region (no f here)
    gather_output: bool = False   # output all-gathered: what follows runs on all features

    def placements(self, name: str, ndim: int):
        if name == "bias" or ndim == 1:
            return (_shard(0, self.packed),)
        return (_shard(1 if self.conv1d else 0, self.packed),)

    def hooks(self, m, tp: TPGroup):
        local = _LocalParams(_names(m), zero_bias=False, conv1d=self.conv1d)

        def pre(mod, args):
            local.enter(mod)
            if not self.in_region:
                return (C.copy_to_region(args[0], tp.group),) + tuple(args[1:])

        def post(mod, args, out):
            local.exit(mod)
            return C.gather_last(out, tp.group) if self.gather_output else out

        return pre, post


@dataclasses.dataclass(frozen=True)
class RowWise:
    """Input features split: partial outputs summed (or reduce-scattered under SP)."""

    conv1d: bool = False
    split_input: bool = False   # the input is whole (a gathered output): keep this rank's part

    def placements(self, name: str, ndim: int):
        from torch.distributed.tensor import Replicate, Shard

        if name == "bias" or ndim == 1:
            return (Replicate(),)
        return (Shard(0 if self.conv1d else 1),)

    def hooks(self, m, tp: TPGroup):
        local = _LocalParams(_names(m), zero_bias=True, conv1d=self.conv1d)

        def pre(mod, args):
            local.enter(mod)
            if self.split_input:
                x = args[0]
                return (C.split_seq(x, tp.group, x.dim() - 1),) + tuple(args[1:])

        def post(mod, args, out):
            local.exit(mod)
            out = C.scatter_seq(out, tp.group, 1) if tp.sp else C.reduce_from_region(out, tp.group)
            b = mod._parameters.get("bias")
            return out if b is None else out + _local(b)

        return pre, post


@dataclasses.dataclass(frozen=True)
class VocabEmbed:
    """Vocabulary rows split: ids outside this rank's rows give zeros, then summed."""

    conv1d: bool = False

    def placements(self, name: str, ndim: int):
        from torch.distributed.tensor import Shard

        return (Shard(0),)

    def hooks(self, m, tp: TPGroup):
        local = _LocalParams(_names(m), zero_bias=False, conv1d=False)
        lo, cnt = dim_block(m._parameters["weight"].shape[0], [tp.size], [tp.rank])
        state: dict = {}

        def pre(mod, args):
            ids = args[0]
            state["mask"] = (ids < lo) | (ids >= lo + cnt)
            state["pad"] = pad = mod.padding_idx
            # F.embedding only uses padding_idx to zero that row's gradient.
            mod.padding_idx = pad - lo if pad is not None and lo <= pad < lo + cnt else None
            local.enter(mod)
            return ((ids - lo).clamp(0, max(cnt - 1, 0)),) + tuple(args[1:])

        def post(mod, args, out):
            local.exit(mod)
            mod.padding_idx = state.pop("pad")
            out = out.masked_fill(state.pop("mask").unsqueeze(-1), 0.0)
            return C.reduce_from_region(out, tp.group)

        return pre, post


@dataclasses.dataclass(frozen=True)
class EmbedColWise:
    """Embedding columns split, inside a TP region: each rank looks up its own columns
    (T5's relative position bias, (buckets, heads): this rank's heads); no collective."""

    conv1d: bool = False

    def placements(self, name: str, ndim: int):
        from torch.distributed.tensor import Shard

        return (Shard(1),)

    def hooks(self, m, tp: TPGroup):
        local = _LocalParams(_names(m), zero_bias=False, conv1d=False)

        def pre(mod, args):
            local.enter(mod)

        def post(mod, args, out):
            local.exit(mod)
            return out

        return pre, post


@dataclasses.dataclass(frozen=True)
class VocabHead:
    """The output head split over the vocabulary: logits stay vocab-sharded (a DTensor the
    vocab-parallel loss reads), or are gathered with ``gather_output``."""

    conv1d: bool = False
    packed: int = 1
    gather_output: bool = False

    def placements(self, name: str, ndim: int):
        return ColWise(self.conv1d, self.packed).placements(name, ndim)

    def hooks(self, m, tp: TPGroup):
        local = _LocalParams(_names(m), zero_bias=False, conv1d=self.conv1d)
        w = m._parameters["weight"]
        vocab = w.shape[1] if self.conv1d else w.shape[0]
        # fuse('loss') reads its rows of the vocabulary from here
        mark_vocab_split(m, tp.group, dim_block(vocab, [tp.size], [tp.rank])[0], vocab)

        def pre(mod, args):
            local.enter(mod)
            return (C.copy_to_region(args[0], tp.group),) + tuple(args[1:])

        def post(mod, args, out):
            from torch.distributed.tensor import DTensor, Shard

            local.exit(mod)
            if out.dim() == 0:
                return out          # a fused head's loss (fuse('loss')), already whole
            if self.gather_output:
                return C.gather_last(out, tp.group)
            shape = tuple(out.shape[:-1]) + (vocab,)
            logits = DTensor.from_local(out, tp.mesh, (Shard(out.dim() - 1),),
                                        run_check=False, shape=torch.Size(shape),
                                        stride=torch.empty(shape, device="meta").stride())
            # decoding: the whole logits (DTensor gathers a vocabulary split unevenly too)
            return logits.full_tensor() if _whole() else logits

        return pre, post


@dataclasses.dataclass(frozen=True)
class KVReplicated:
    """A K/V projection with fewer heads than TP ranks: replicated weights, each rank
    keeping the heads its query heads use; gradients summed over tp."""

    heads: tuple[int, int] = (0, 0)     # (first head, count) kept on this rank
    head_dim: int = 0
    conv1d: bool = False

    def placements(self, name: str, ndim: int):
        return None                      # stays a plain replicated parameter

    def hooks(self, m, tp: TPGroup):
        local = _LocalParams(_names(m), zero_bias=False, conv1d=False)
        first, count = self.heads
        lo, hi = first * self.head_dim, (first + count) * self.head_dim

        def pre(mod, args):
            local.enter(mod)

        def post(mod, args, out):
            local.exit(mod)
            return out[..., lo:hi]

        return pre, post
