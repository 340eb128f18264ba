"""A sum of matrix products, the second and later accumulated into the first's output.

A gradient that reaches one tensor through several linear maps (an MLP's gate and up
projections, a layer's query and key/value projections) is the sum of one product per
map. Eagerly the backward computes the first and adds each later one inside cuBLAS
(``addmm_``, beta = 1), which writes nothing but the products. Traced by ``torch.compile``
the same code becomes out-of-place ``addmm(y, a, b, out=z)``, which cuBLAS runs as a copy of
``y`` into ``z`` and then the product: at TinyLlama's shape one 64 MiB device copy per sum,
two per block, 1.9 ms of a 221 ms step on one H100
(``benchmarks/results/profile_step_tinyllama_ops_blocks_nvidia_h100_80gb_hbm3.json``: 44
``Memcpy DtoD`` under ``aten::addmm`` in the compiled blocks' backward, none eagerly).
Under compilation the sum is therefore one opaque custom op, ``meshlab::mm_sum``, whose
kernel is the eager code.

>>> import torch
>>> a, b, c, d = torch.randn(4, 3), torch.randn(3, 5), torch.randn(4, 2), torch.randn(2, 5)
>>> torch.allclose(mm_sum([a, c], [b, d]), a @ b + c @ d)
True
"""

from __future__ import annotations

import torch
from torch import Tensor


def _sum(a: list[Tensor], b: list[Tensor]) -> Tensor:
    out = a[0] @ b[0]
    for x, y in zip(a[1:], b[1:]):
        out.addmm_(x, y)
    return out


@torch.library.custom_op("meshlab::mm_sum", mutates_args=())
def mm_sum_op(a: list[Tensor], b: list[Tensor]) -> Tensor:
    """``sum(a[i] @ b[i])``: 2-d operands, ``a[i]`` (M, K_i), ``b[i]`` (K_i, N)."""
    return _sum(a, b)


@mm_sum_op.register_fake
def _(a, b):
    return a[0].new_empty((a[0].shape[0], b[0].shape[1]))


def mm_sum(a: list[Tensor], b: list[Tensor]) -> Tensor:
    """``sum(a[i] @ b[i] for i)`` for 2-d ``a[i]`` (M, K_i) and ``b[i]`` (K_i, N) of one
    dtype: the products after the first accumulated into the first's output. No gradient
    (it computes gradients, inside backward passes)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"mm_sum: {len(a)} left and {len(b)} right operands; give one "
                         f"right operand for each left, at least one pair")
    if torch.compiler.is_compiling() and len(a) > 1:
        return torch.ops.meshlab.mm_sum(list(a), list(b))
    return _sum(a, b)
