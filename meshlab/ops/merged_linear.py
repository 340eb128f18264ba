"""Several linear maps of one input as one matrix product: ``merged_linear(x, (wq, wk, wv))``.

An attention layer's query, key and value projections read the same input; run apart,
the small ones (a grouped-query layer's key and value, 256 wide for TinyLlama) reach a
fraction of the GPU's matmul rate, and autograd sums the three input gradients with two
separate full-width adds. Here the forward is one product against the weights stacked
(their copy costs one pass over the weights, not over the tokens) and returns one strided
view per weight; the backward sums the input gradient inside the products (``addmm_``)
and forms each weight's (and bias's) gradient on its own, so the parameters stay as they
are: separate tensors, names and shapes unchanged.

>>> import torch
>>> from meshlab.ops.merged_linear import merged_linear
>>> x, w1, w2 = torch.randn(3, 8), torch.randn(4, 8), torch.randn(2, 8)
>>> a, b = merged_linear(x, (w1, w2))
>>> torch.allclose(a, x @ w1.T) and torch.allclose(b, x @ w2.T)
True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _flat(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


class _Merged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n, *params):
        ws, bs = params[:n], params[n:]
        y = F.linear(x, torch.cat(ws), torch.cat(bs) if bs else None)
        ctx.n, ctx.biased = n, bool(bs)
        ctx.save_for_backward(x, *ws)
        return tuple(y.split([w.shape[0] for w in ws], -1))

    @staticmethod
    def backward(ctx, *dys):
        x, *ws = ctx.saved_tensors
        need = ctx.needs_input_grad
        dx = None
        if need[0]:
            for dy, w in zip(dys, ws):
                if dx is None:
                    dx = _flat(dy) @ w
                else:
                    dx.addmm_(_flat(dy), w)
            dx = dx.view(x.shape)
        dws = [_flat(dy).t() @ _flat(x) if need[2 + i] else None for i, dy in enumerate(dys)]
        dbs = [(_flat(dy).sum(0) if need[2 + ctx.n + i] else None) for i, dy in enumerate(dys)] \
            if ctx.biased else []
        return (dx, None, *dws, *dbs)


def merged_linear(x: Tensor, weights, biases=None) -> tuple[Tensor, ...]:
    """``tuple(F.linear(x, w, b) for w, b in zip(weights, biases))`` as one product
    (module docstring). ``weights``: (out_i, in) of ``x``'s dtype; ``biases``: all or none."""
    weights = tuple(weights)
    biases = tuple(biases) if biases is not None else ()
    if biases and (len(biases) != len(weights) or any(b is None for b in biases)):
        raise ValueError(f"merged_linear: {len(weights)} weights need all or no biases, got "
                         f"{[b is not None for b in biases]}")
    return _Merged.apply(x, len(weights), *weights, *biases)
