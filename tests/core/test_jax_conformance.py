"""meshlab side by side with real JAX: JAX's "Distributed arrays and automatic
parallelization" page (jax-ml/jax, docs/notebooks/Distributed_arrays_and_automatic_
parallelization.md), each example written again in our own code, run by JAX on 4 host
devices in this process and by meshlab on 4 gloo ranks, and compared: values and gradients
to float64 rounding, layouts (which rank holds which block) and the resulting specs
exactly. The page's meshes of 8 devices are halved (4x2 -> 2x2, 8 -> 4) and its arrays
made tiny.

The shard_map page is ``test_jax_conformance_shard_map.py``, flax's and MaxText's rules
``test_jax_conformance_rules.py``; ``docs/jax.md`` lists each example with both
spellings, and what meshlab lacks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.core._jax import (close, full, jax_blocks, jax_mesh, jx, key,  # noqa: F401
                             same_on_every_rank, spec_key)

pytestmark = pytest.mark.timeout(600)

SPECS = (("a", "b"), ("b", "a"), ("a", None), (None, "b"), (None, "a"), (("a", "b"), None))
X = np.arange(8 * 8, dtype=np.float64).reshape(8, 8)


def _block(local: torch.Tensor) -> tuple:
    """The (offset, length) per dimension of the block of ``X`` a rank holds, read off its
    values (``X`` is ``arange``: the first element names the offset)."""
    first = int(local.reshape(-1)[0]) if local.numel() else 0
    return ((first // 8, local.shape[0]), (first % 8, local.shape[1]))


# -- "Sharding describes how array values are laid out": device_put + visualize ---------
def case_layouts(rank, world):
    import meshlab as ml
    from meshlab import P

    mesh = ml.Mesh(a=2, b=2)
    out = {}
    for s in SPECS:
        y = ml.distribute(torch.from_numpy(X), mesh, P(*s))
        view = ml.visualize(y, show=False)
        out[s] = {"held": _block(y.to_local()), "shown": view.rank_block(rank),
                  "spec": spec_key(y)}
    return out


def test_layouts_match_device_put(world4, jx):
    from jax.sharding import NamedSharding, PartitionSpec as JP

    mesh = jax_mesh(jx, (2, 2), ("a", "b"))
    outs = world4.run(case_layouts)
    for s in SPECS:
        y = jx.device_put(X, NamedSharding(mesh, JP(*s)))
        want = jax_blocks(y)
        for rank, out in enumerate(outs):
            assert out[s]["held"] == want[rank], (s, rank)     # what the rank holds
            assert out[s]["shown"] == want[rank], (s, rank)    # what visualize says
            assert out[s]["spec"] == (key(y.sharding.spec), ())


# -- "Computation follows data sharding": sin, dot, copy ---------------------------------
def case_follows_sharding(rank, world, x):
    import meshlab as ml
    from meshlab import P

    mesh = ml.Mesh(a=2, b=2)
    x = torch.from_numpy(x)
    y = ml.distribute(x, mesh, P("a", "b"))
    z = torch.sin(y)
    lhs, rhs = ml.distribute(x, mesh, P("a", None)), ml.distribute(x, mesh, P(None, "b"))
    w = lhs @ rhs
    c = w.clone()
    return {k: (full(v), spec_key(v)) for k, v in (("sin", z), ("dot", w), ("copy", c))}


def test_computation_follows_sharding(world4, jx):
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as JP

    mesh = jax_mesh(jx, (2, 2), ("a", "b"))
    x = np.random.default_rng(0).standard_normal((8, 8))
    got = same_on_every_rank(world4.run(case_follows_sharding, x=x))
    y = jx.device_put(x, NamedSharding(mesh, JP("a", "b")))
    z = jnp.sin(y)
    w = jnp.dot(jx.device_put(x, NamedSharding(mesh, JP("a", None))),
                jx.device_put(x, NamedSharding(mesh, JP(None, "b"))))
    for name, want in (("sin", z), ("dot", w), ("copy", jnp.copy(w))):
        close(got[name][0], want)
        assert got[name][1] == (key(want.sharding.spec), ()), name


# -- "Constraining shardings of intermediates": with_sharding_constraint -> constrain -----
def case_constrain(rank, world, x):
    import meshlab as ml
    from meshlab import P

    mesh = ml.Mesh(x=2, y=2)
    xs = ml.distribute(torch.from_numpy(x), mesh, P("x", "y"))
    out = {}
    for s in (("y", "x"), ()):
        r = ml.constrain(xs + 1, P(*s))
        out[s] = (full(r), spec_key(r))
    return out


def test_constrain_is_with_sharding_constraint(world4, jx):
    from jax.sharding import NamedSharding, PartitionSpec as JP

    mesh = jax_mesh(jx, (2, 2), ("x", "y"))
    x = np.random.default_rng(1).standard_normal((8, 8))
    got = same_on_every_rank(world4.run(case_constrain, x=x))
    xs = jx.device_put(x, NamedSharding(mesh, JP("x", "y")))
    for s in (("y", "x"), ()):
        f = jx.jit(lambda v, s=s: jx.lax.with_sharding_constraint(
            v + 1, NamedSharding(mesh, JP(*s))))
        want = f(xs)
        close(got[s][0], want)
        assert got[s][1] == (key(want.sharding.spec), ())


# -- "Examples: neural networks": data parallelism, then data x tensor parallelism --------
SIZES = (8, 16, 16, 16, 4)
STEPS, LR = 3, 1e-2


def _init():
    rng = np.random.default_rng(0)
    params = [(rng.standard_normal((n, m)) / np.sqrt(n), rng.standard_normal(m))
              for n, m in zip(SIZES[:-1], SIZES[1:])]
    return params, (rng.standard_normal((16, SIZES[0])), rng.standard_normal((16, SIZES[-1])))


def _predict(params, x):
    for w, b in params:
        out = x @ w + b
        x = torch.relu(out)
    return out


def _loss(params, batch):
    inputs, targets = batch
    return ((_predict(params, inputs) - targets) ** 2).sum(-1).mean()


# (the page's 8-way and 4x2 meshes, halved) -> mesh axes and each parameter's spec
LAYOUTS = {
    "dp": ({"batch": 4}, ("batch",), [((), ())] * 4),
    "dp_tp": ({"batch": 2, "model": 2}, ("batch", None),
              [((), ()), ((None, "model"), ("model",)), (("model", None), ()), ((), ())]),
}


def case_network(rank, world, layout, params, batch):
    """The page's training loop on DTensors: loss, gradients, three SGD steps."""
    import meshlab as ml
    from meshlab import P

    axes, batch_spec, specs = LAYOUTS[layout]
    mesh = ml.Mesh(axes)
    params = [tuple(ml.distribute(torch.from_numpy(t), mesh, P(*s)).requires_grad_()
                    for t, s in zip(wb, ws)) for wb, ws in zip(params, specs)]
    batch = tuple(ml.distribute(torch.from_numpy(t), mesh, P(*batch_spec)) for t in batch)
    out = {"loss": full(_loss(params, batch))}
    for step in range(STEPS):
        loss = _loss(params, batch)
        loss.backward()
        grads = [(w.grad, b.grad) for w, b in params]
        if step == 0:
            # autograd leaves a replicated parameter's gradient as a pending sum over the
            # batch axes (JAX's jit returns it reduced): constrain reduces it
            out["raw_grad_specs"] = [tuple(spec_key(g) for g in gb) for gb in grads]
            out["grads"] = [tuple(full(g) for g in gb) for gb in grads]
        with torch.no_grad():
            params = [tuple((t - LR * ml.constrain(g, ml.spec_of(t))).requires_grad_()
                            for t, g in zip(wb, gb)) for wb, gb in zip(params, grads)]
    out["loss_after"] = full(_loss(params, batch))
    out["specs_after"] = [tuple(spec_key(t) for t in wb) for wb in params]
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_neural_network_examples(world4, jx, layout):
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as JP

    params, batch = _init()
    got = same_on_every_rank(world4.run(case_network, layout=layout, params=params,
                                        batch=batch))
    axes, batch_spec, specs = LAYOUTS[layout]
    mesh = jax_mesh(jx, tuple(axes.values()), tuple(axes))

    def loss(params, batch):
        inputs, targets = batch
        for w, b in params:
            outputs = jnp.dot(inputs, w) + b
            inputs = jnp.maximum(outputs, 0)
        return jnp.mean(jnp.sum((outputs - targets) ** 2, axis=-1))

    put = lambda t, s: jx.device_put(t, NamedSharding(mesh, JP(*s)))  # noqa: E731
    jp = [tuple(put(t, s) for t, s in zip(wb, ws)) for wb, ws in zip(params, specs)]
    jb = tuple(put(t, batch_spec) for t in batch)
    loss_jit, gradfun = jx.jit(loss), jx.jit(jx.grad(loss))
    close(got["loss"], loss_jit(jp, jb))
    grads = gradfun(jp, jb)
    for (gw, gb), (mw, mb), raw in zip(grads, got["grads"], got["raw_grad_specs"]):
        close(mw, gw)
        close(mb, gb)
        for g, (dims, partial) in zip((gw, gb), raw):
            # the layout is JAX's; what JAX has summed may still be pending (docs/jax.md)
            assert dims == key(g.sharding.spec) and set(partial) <= set(axes), (dims, partial)
    for _ in range(STEPS):
        jp = [(w - LR * dw, b - LR * db) for (w, b), (dw, db) in zip(jp, gradfun(jp, jb))]
    close(got["loss_after"], loss_jit(jp, jb))
    assert got["specs_after"] == [tuple((key(t.sharding.spec), ()) for t in wb) for wb in jp]
