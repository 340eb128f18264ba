"""meshlab side by side with real JAX: torch's own idioms inside ``shard_map``'s function
(indexing by a tensor, item assignment, writes through views, in-place arithmetic, custom
autograd functions), each against the functional JAX program that computes the same
(``x.at[i].set``, ``jnp.concatenate``, ...); arguments that are not tensors; sums over
axes in two states; and ``check=False``.

Each of these once gave a silently wrong gradient or value: an operand the same on every
rank (``P()``) that met a varying one through ``x[i]``, an in-place op or a custom
``torch.autograd.Function`` was not broadcast (``pvary``), so its gradient was each rank's
share and not their sum; a buffer filled by ``y[:] = x`` or through a view stayed
"invariant", so a later ``psum`` counted it once per rank; a numpy array given
``P('i')`` reached every rank whole; ``check=False`` counted the gradient of an output
declared ``P()`` once per rank. JAX's side of each case is its documented functional form
(jax.numpy's ``.at`` updates, jax/_src/numpy/array_methods.py; ``lax.psum``'s refusal of
axes in two states, jax/_src/lax/parallel.py; ``shard_map``'s ``check_vma=False``
transpose, jax/_src/shard_map.py), run by ``jax.shard_map`` on 4 host devices here and by
``meshlab.shard_map`` on 4 gloo ranks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.core._jax import (close, compare, jax_mesh, jax_value_and_grads, jx,  # noqa: F401
                             ml_value_and_grads, same_on_every_rank, weights)
from tests.core.test_jax_conformance_shard_map_more import _case, _refusal, data

pytestmark = pytest.mark.timeout(600)


def _mul():
    """A custom autograd function: x * w, its backward written by hand."""
    class Mul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g * w, g * x
    return Mul


def ml_cases(ml, P):
    """(name, function, in_specs, out_specs, mesh, arguments): torch idioms."""
    Mul = _mul()

    def set_buffer(x):                        # a fresh buffer (invariant) filled with x
        y = torch.zeros(x.shape, dtype=x.dtype)
        y[:] = x
        return ml.psum(y, "i")

    def through_views(x):
        n = x.shape[0]
        y = torch.zeros(2 * n, dtype=x.dtype)
        y.narrow(0, 0, n).copy_(x)
        y.narrow(0, n, n).copy_(2 * x)
        return ml.psum(y, "i")

    def view_taken_before(x):                 # a view of the buffer, then a write into it
        y = torch.zeros(x.shape, dtype=x.dtype)
        v = y[: x.shape[0]]
        y[:] = x
        return ml.psum(3 * v, "i")

    def at_my_index(x):
        y = torch.zeros(4, dtype=x.dtype)
        y[ml.axis_index("i")] = x.sum()
        return ml.psum(y, "i")

    def add_mul_(x, w):
        y = x.clone()
        y.add_(w)
        y.mul_(w)
        return y

    def iadd(x, w):
        y = x * 1
        y += w
        return y

    def index_add_(x, w):
        y = x.clone()
        y.index_add_(0, torch.tensor([1, 0]), w)
        return y

    return [
        ("getitem_by_axis_index", lambda x: x[ml.axis_index("i")][None], (P(),), P("i"),
         (data(4, 3),)),
        ("setitem_buffer", set_buffer, (P("i"),), P(), (data(8),)),
        ("writes_through_views", through_views, (P("i"),), P(), (data(8),)),
        ("view_taken_before_the_write", view_taken_before, (P("i"),), P(), (data(8),)),
        ("setitem_at_axis_index", at_my_index, (P("i"),), P(), (data(8),)),
        ("add_mul_in_place_replicated_operand", add_mul_, (P("i"), P()), P("i"),
         (data(8), data(2) + 1)),
        ("iadd_replicated_operand", iadd, (P("i"), P()), P("i"), (data(8), data(2))),
        ("index_add_replicated_source", index_add_, (P("i"), P()), P("i"),
         (data(8), data(2))),
        ("custom_autograd_function", lambda x, w: Mul.apply(x, w), (P("i"), P()), P("i"),
         (data(8), data(2))),
    ]


def jax_cases(jax, P):
    """The same programs in JAX's functional form, in the same order."""
    jnp, lax = jax.numpy, jax.lax
    return [
        ("getitem_by_axis_index", lambda x: x[lax.axis_index("i")][None], (P(),), P("i"),
         (data(4, 3),)),
        ("setitem_buffer", lambda x: lax.psum(jnp.zeros(x.shape).at[:].set(x), "i"), (P("i"),),
         P(), (data(8),)),
        ("writes_through_views", lambda x: lax.psum(jnp.concatenate([x, 2 * x]), "i"),
         (P("i"),), P(), (data(8),)),
        ("view_taken_before_the_write", lambda x: lax.psum(3 * x, "i"), (P("i"),), P(),
         (data(8),)),
        ("setitem_at_axis_index",
         lambda x: lax.psum(jnp.zeros(4).at[lax.axis_index("i")].set(x.sum()), "i"),
         (P("i"),), P(), (data(8),)),
        ("add_mul_in_place_replicated_operand", lambda x, w: (x + w) * w, (P("i"), P()),
         P("i"), (data(8), data(2) + 1)),
        ("iadd_replicated_operand", lambda x, w: x + w, (P("i"), P()), P("i"),
         (data(8), data(2))),
        ("index_add_replicated_source", lambda x, w: x.at[jnp.array([1, 0])].add(w),
         (P("i"), P()), P("i"), (data(8), data(2))),
        ("custom_autograd_function", lambda x, w: x * w, (P("i"), P()), P("i"),
         (data(8), data(2))),
    ]


TABLE, IDS = data(4, 2), np.array([0, 3, 2, 0])


def case_idioms(rank, world):
    import meshlab as ml
    from meshlab import P

    mesh, out = ml.Mesh(i=4), {}
    for name, fn, ins, outs, args in ml_cases(ml, P):
        out[name] = ml_value_and_grads(ml.shard_map(fn, in_specs=ins, out_specs=outs,
                                                    mesh=mesh), args)
    # a data-parallel embedding written as table[ids]: ids split, the table replicated
    table = torch.from_numpy(TABLE).requires_grad_()
    y = ml.shard_map(lambda t, i: t[i], in_specs=(P(), P("i")), out_specs=P("i"),
                     mesh=mesh)(table, torch.from_numpy(IDS))
    (g,) = torch.autograd.grad((y.full_tensor() * torch.from_numpy(weights((4, 2)))).sum(),
                               [table])
    out["embedding_by_getitem"] = g.numpy()
    return out


def test_torch_idioms_match_jax_values_and_gradients(world4, jx):
    from jax.sharding import PartitionSpec as JP

    got = same_on_every_rank(world4.run(case_idioms))
    mesh, failed = jax_mesh(jx, (4,), ("i",)), []
    for name, fn, ins, outs, args in jax_cases(jx, JP):
        sm = jx.shard_map(fn, mesh=mesh, in_specs=ins, out_specs=outs)
        with _case(name, failed):
            compare(got[name], jax_value_and_grads(jx, sm, args))
    emb = jx.shard_map(lambda t, i: t[i], mesh=mesh, in_specs=(JP(), JP("i")),
                       out_specs=JP("i"))
    want = jx.grad(lambda t: (emb(t, IDS) * weights((4, 2))).sum())(TABLE)
    with _case("embedding_by_getitem", failed):
        close(got["embedding_by_getitem"], want)
    assert not failed, "\n".join(failed)


# -- arguments that are not tensors ------------------------------------------------------
def case_arguments(rank, world):
    import meshlab as ml
    from meshlab import P

    mesh = ml.Mesh(i=4)
    f = ml.shard_map(lambda b: ml.psum(torch.as_tensor(b).sum()[None], "i"),
                     in_specs=(P("i"),), out_specs=P(), mesh=mesh)
    out = {"numpy": f(data(8)).full_tensor().numpy()}
    scalar = ml.shard_map(lambda s, b: b * s, in_specs=(P(), P("i")), out_specs=P("i"),
                          mesh=mesh)
    out["scalar_replicated"] = scalar(2.5, torch.from_numpy(data(8))).full_tensor().numpy()
    out["list_split"] = _refusal(lambda: f([1.0, 2.0, 3.0, 4.0]))
    out["float_split"] = _refusal(lambda: f(2.0))
    out["partial_plain"] = _refusal(lambda: ml.shard_map(
        lambda x: x * 2, in_specs=(P(partial="i"),), out_specs=P(partial="i"),
        mesh=mesh)(torch.from_numpy(data(8))))
    return out


def test_arguments_that_are_not_tensors(world4, jx):
    from jax.sharding import PartitionSpec as JP

    got = same_on_every_rank(world4.run(case_arguments))
    mesh = jax_mesh(jx, (4,), ("i",))
    f = jx.shard_map(lambda b: jx.lax.psum(b.sum()[None], "i"), mesh=mesh, in_specs=(JP("i"),),
                     out_specs=JP())
    close(got["numpy"], f(data(8)))             # a numpy array is split as JAX splits it
    scalar = jx.shard_map(lambda s, b: b * s, mesh=mesh, in_specs=(JP(), JP("i")),
                          out_specs=JP("i"))
    close(got["scalar_replicated"], scalar(2.5, data(8)))
    with pytest.raises(ValueError):             # JAX cannot split a Python scalar either
        f(2.0)
    for name in ("list_split", "float_split"):
        kind, msg = got[name]
        assert kind == "SpecError" and "not a tensor" in msg and "torch.as_tensor" in msg, \
            got[name]
    kind, msg = got["partial_plain"]
    assert kind == "SpecError" and "pending sum" in msg, got["partial_plain"]


# -- sums over axes in two states, and in-place writes JAX cannot express -----------------
def refused(lax, P, shard_map, mesh):
    """(name, thunk): a sum over ('i', 'j') of a value that varies along 'i' alone."""
    return [
        ("psum_two_states", lambda: shard_map(lambda x: lax.psum(x, ("i", "j")), P("i"), P(),
                                              mesh)(data(4))),
        ("pmean_two_states", lambda: shard_map(lambda x: lax.pmean(x, ("i", "j")), P("i"),
                                               P(), mesh)(data(4))),
        ("psum_scatter_two_states", lambda: shard_map(
            lambda x: lax.psum_scatter(x, ("i", "j"), tiled=True), P("i"), P(("i", "j")),
            mesh)(data(8))),
    ]


def case_two_states(rank, world):
    import meshlab as ml
    from meshlab import P

    mesh = ml.Mesh(i=2, j=2)

    def sm(f, ins, outs, m):
        return lambda *a: ml.shard_map(f, in_specs=ins, out_specs=outs, mesh=m)(
            *[torch.from_numpy(x) for x in a])

    out = {name: _refusal(thunk) for name, thunk in refused(ml, P, sm, mesh)}
    # pcast first, as the message says: a sum over both axes then (JAX's pcast too)
    fixed = ml.shard_map(lambda x: ml.psum(ml.pcast(x, "j", to="varying"), ("i", "j")),
                         in_specs=P("i"), out_specs=P(), mesh=mesh)
    out["pcast_then_psum"] = ml_value_and_grads(fixed, (data(4),))

    # in place, a varying value into a tensor the same on every rank that needs a gradient
    def into_replicated(x, w):
        y = w * 1
        y.add_(x)
        return y
    out["in_place_into_replicated"] = _refusal(lambda: ml.shard_map(
        into_replicated, in_specs=(P("i"), P()), out_specs=P("i"), mesh=mesh)(
        torch.from_numpy(data(4)).requires_grad_(), torch.from_numpy(data(2)).requires_grad_()))
    return out


def test_sums_over_axes_in_two_states_are_refused(world4, jx):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as JP

    got = same_on_every_rank(world4.run(case_two_states))
    mesh = jax_mesh(jx, (2, 2), ("i", "j"))

    def sm(f, ins, outs, m):
        return lambda *a: jx.shard_map(f, mesh=m, in_specs=ins, out_specs=outs)(
            *[jx.device_put(x, NamedSharding(m, ins)) for x in a])

    for name, thunk in refused(jx.lax, JP, sm, mesh):
        with _case(name):
            with pytest.raises(ValueError, match="can only accept axis_name"):
                thunk()
            kind, msg = got[name]
            assert kind == "SpecError" and "both states" in msg and "pcast" in msg, got[name]
    fixed = jx.shard_map(lambda x: jx.lax.psum(jx.lax.pcast(x, "j", to="varying"), ("i", "j")),
                         mesh=mesh, in_specs=JP("i"), out_specs=JP())
    compare(got["pcast_then_psum"], jax_value_and_grads(jx, fixed, (data(4),)))
    kind, msg = got["in_place_into_replicated"]
    assert kind == "SpecError" and "in place" in msg and "out of place" in msg, msg


# -- check=False: an output declared P() that varies along 'i' ----------------------------
def case_unchecked(rank, world):
    import meshlab as ml
    from meshlab import P

    f = ml.shard_map(lambda x: ml.all_gather(x, "i", tiled=True), in_specs=P("i"),
                     out_specs=P(), mesh=ml.Mesh(i=4), check=False)
    return ml_value_and_grads(f, (data(8),))


def test_unchecked_output_gradient_is_counted_once(world4, jx):
    from jax.sharding import PartitionSpec as JP

    got = same_on_every_rank(world4.run(case_unchecked))
    f = jx.shard_map(lambda x: jx.lax.all_gather(x, "i", tiled=True),
                     mesh=jax_mesh(jx, (4,), ("i",)), in_specs=JP("i"), out_specs=JP(),
                     check_vma=False)
    compare(got, jax_value_and_grads(jx, f, (data(8),)))


# -- collectives over no axis: JAX returns the input ----------------------------------------
def no_axes(lax):
    return [("psum", lambda x: lax.psum(x, ())), ("pmean", lambda x: lax.pmean(x, ())),
            ("all_gather", lambda x: lax.all_gather(x, ())),
            ("all_gather_tiled", lambda x: lax.all_gather(x, (), tiled=True)),
            ("psum_scatter", lambda x: lax.psum_scatter(x, (), tiled=True)),
            ("axis_index", lambda x: x * (1 + lax.axis_index(())))]


def case_no_axes(rank, world):
    import meshlab as ml
    from meshlab import P

    return {name: ml_value_and_grads(ml.shard_map(fn, in_specs=P("i"), out_specs=P("i"),
                                                  mesh=ml.Mesh(i=4)), (data(8),))
            for name, fn in no_axes(ml)}


def test_collectives_over_no_axis(world4, jx):
    from jax.sharding import PartitionSpec as JP

    got = same_on_every_rank(world4.run(case_no_axes))
    mesh = jax_mesh(jx, (4,), ("i",))
    for name, fn in no_axes(jx.lax):
        with _case(name):
            sm = jx.shard_map(fn, mesh=mesh, in_specs=JP("i"), out_specs=JP("i"))
            compare(got[name], jax_value_and_grads(jx, sm, (data(8),)))
