"""Shared by the side-by-side suites against real JAX (``test_jax_conformance*.py``): JAX
itself on 4 host devices in the pytest process (the root ``conftest.py`` sets
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` before anything imports jax), in
float64 so values compare to 1e-12; and the forms both sides' results are compared in.

Nothing here imports jax at import time: the gloo ranks import the test modules for their
cases and never need it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

RTOL = ATOL = 1e-11


@pytest.fixture(scope="module")
def jx():
    """``jax`` with 4 CPU devices and float64 enabled."""
    import jax

    jax.config.update("jax_enable_x64", True)
    assert len(jax.devices()) == 4, (
        f"JAX sees {len(jax.devices())} devices; the root conftest.py sets XLA_FLAGS="
        f"--xla_force_host_platform_device_count=4 before jax is imported")
    return jax


def jax_mesh(jax, shape, names):
    """A JAX mesh over the 4 devices in order: device i is meshlab's rank i."""
    devices = np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, names)


def key(spec) -> tuple:
    """A JAX or meshlab PartitionSpec as one tuple of mesh axes per dimension, trailing
    replicated dimensions dropped (``P('a')``, ``P('a', None)`` and ``P(('a',))`` alike)."""
    dims = []
    for e in tuple(spec):
        dims.append(() if e is None else (e,) if isinstance(e, str) else tuple(e))
    while dims and not dims[-1]:
        dims.pop()
    return tuple(dims)


def jax_blocks(x) -> dict:
    """Device id -> the (offset, length) of each dimension of the block it holds."""
    out = {}
    for d, idx in x.sharding.devices_indices_map(x.shape).items():
        out[d.id] = tuple((s.start or 0, (s.stop if s.stop is not None else n) - (s.start or 0))
                          for s, n in zip(idx, x.shape))
    return out


def close(got, want, rtol: float = RTOL, atol: float = ATOL) -> None:
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=atol)


def same_on_every_rank(outs: list) -> object:
    """The per-rank results of a world case that computed global values: all equal."""
    for r, o in enumerate(outs[1:], 1):
        _assert_same(outs[0], o, f"rank {r}")
    return outs[0]


def _assert_same(a, b, where: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)) and not isinstance(a, str):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=where)
    else:
        assert a == b, (where, a, b)


# -- the meshlab side, run on the gloo ranks ---------------------------------------------
def full(x) -> np.ndarray:
    """A DTensor's (or tensor's) global value as float64 numpy."""
    from torch.distributed.tensor import DTensor

    x = x.full_tensor() if isinstance(x, DTensor) else x
    return x.detach().double().numpy()


def spec_key(x) -> tuple:
    """``key`` of a DTensor's spec, with its pending sums: ``(dims, partial)``."""
    import meshlab as ml

    s = ml.spec_of(x)
    return key(s), tuple(s.partial)


# -- shard_map examples: a value and its gradients on each side ---------------------------
def weights(shape) -> np.ndarray:
    """The cotangent each example's gradient is taken against: sum(out * weights)."""
    n = int(np.prod(shape))
    return np.linspace(0.5, 2.0, n).reshape(shape)


def ml_value_and_grads(sm, args):
    """Run meshlab's shard-mapped ``sm`` on global float64 numpy ``args``: the global
    output and the gradient of sum(out * weights) for each argument."""
    xs = [torch.from_numpy(a).requires_grad_() for a in args]
    out = sm(*xs)
    value = full(out)
    total = (out.full_tensor() * torch.from_numpy(weights(value.shape))).sum()
    grads = torch.autograd.grad(total, xs)
    return value, [g.numpy() for g in grads]


def jax_value_and_grads(jax, sm, args):
    import jax.numpy as jnp

    value = sm(*args)
    grads = jax.grad(lambda *a: jnp.sum(sm(*a) * weights(value.shape)),
                     argnums=tuple(range(len(args))))(*args)
    return value, grads


def compare(got, want) -> None:
    (v, gs), (jv, jgs) = got, want
    assert v.shape == jv.shape
    close(v, jv)
    for g, jg in zip(gs, jgs):
        close(g, jg)


class TorchLax:
    """meshlab's collectives under jax.lax's names, so one example list serves both."""

    def __init__(self):
        import meshlab as ml

        self.psum, self.pmean, self.all_gather = ml.psum, ml.pmean, ml.all_gather
        self.psum_scatter = ml.psum_scatter
        self.remat_gather, self.remat_layer = (lambda f: f), ml.remat     # see the FSDP port
        self.ppermute, self.axis_size, self.axis_index = ml.ppermute, ml.axis_size, ml.axis_index
        self.all_to_all = lambda x, a, split, concat, tiled: ml.all_to_all(
            x, a, split, concat, tiled=tiled)

    @staticmethod
    def add_at(x, i, u):
        return x.index_add(0, i.reshape(1).long(), u.unsqueeze(0))
