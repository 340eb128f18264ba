"""meshlab side by side with real JAX: the collectives' documented options that the
shard_map page's examples leave out, and the inputs JAX's ``shard_map`` refuses. Each case
is written again from the docstrings of ``jax.lax.psum``, ``pmean``, ``pmax``, ``pmin``,
``all_gather``, ``psum_scatter``, ``ppermute``, ``all_to_all`` and ``axis_index``
(jax-ml/jax, jax/_src/lax/parallel.py) and from the page's sections on ``in_specs``,
``out_specs`` and varying axes (docs/notebooks/shard_map.md); run by ``jax.shard_map`` on 4
host devices in this process and by ``meshlab.shard_map`` on 4 gloo ranks: values,
gradients (of a weighted sum of the output), the axes the function's result varies along
and, for integer and bool values, dtypes compared; refusals by both.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from tests.core._jax import (close, compare, jax_mesh, jax_value_and_grads, jx,  # noqa: F401
                             ml_value_and_grads, same_on_every_rank)

pytestmark = pytest.mark.timeout(600)


def data(*shape) -> np.ndarray:
    """Distinct, unsorted float64 values (no ties for pmax, no symmetry to hide a swap)."""
    n = int(np.prod(shape))
    return ((np.arange(n) * 7) % 97 + 0.25 * np.arange(n)).reshape(shape).astype(np.float64)


SHIFT = [(i, (i + 1) % 4) for i in range(4)]
INTS = np.array([5, 1, 9, 2, 3, 8, 0, 4])
BOOLS = np.array([True, False, False, False, True, True, False, False])


# -- differentiable cases: (name, function, in_specs, out_specs, mesh, arguments) --------
# mesh "1" is ('i',) of 4, mesh "2" is ('i', 'j') of 2 x 2; ``lax`` is jax.lax or meshlab
def reductions(lax, P):
    """lax.psum / pmean / pmax / pmin: over a tuple of axes in either order, and over an
    axis the value does not vary along (broadcast first: n * x)."""
    return [
        ("psum_ji", lambda x: lax.psum(x, ("j", "i")), (P("i", "j"),), P(), "2", (data(4, 4),)),
        ("psum_invariant", lambda x: lax.psum(x, "j"), (P("i"),), P("i"), "2", (data(4, 4),)),
        ("psum_invariant_both", lambda x: lax.psum(x, ("i", "j")), (P(),), P(), "2",
         (data(4, 4),)),
        ("pmean_invariant", lambda x: lax.pmean(x, "j"), (P("i"),), P("i"), "2",
         (data(4, 4),)),
        ("psum_scalar", lambda x: lax.psum(x.sum(), "i"), (P("i"),), P(), "1", (data(8),)),
    ]


def gathers(lax, P):
    """lax.all_gather with ``axis`` (negative too) stacked and tiled, over a tuple of axes
    in either order, of a replicated input and of a scalar; lax.psum_scatter with
    ``scatter_dimension`` 1, tiled and not, and over both axes of a replicated input."""
    return [
        ("ag_axis1", lambda x: lax.all_gather(x, "i", axis=1), (P("i"),), P("i"), "1",
         (data(4, 3),)),
        ("ag_axis1_tiled", lambda x: lax.all_gather(x, "i", axis=1, tiled=True),
         (P(None, "i"),), P(None, "i"), "1", (data(3, 8),)),
        ("ag_axis_last", lambda x: lax.all_gather(x, "i", axis=-1), (P("i"),), P("i"), "1",
         (data(4, 3),)),
        ("ag_ij_tiled", lambda x: lax.all_gather(x, ("i", "j"), tiled=True), (P("i", "j"),),
         P("i", "j"), "2", (data(4, 4),)),
        ("ag_ji_axis1", lambda x: lax.all_gather(x, ("j", "i"), axis=1), (P("i", "j"),),
         P("i", "j"), "2", (data(4, 4),)),
        ("ag_replicated", lambda x: lax.all_gather(x, "i", tiled=True), (P(),), P("i"), "1",
         (data(2, 3),)),
        ("ag_scalar", lambda x: lax.all_gather(x.sum(), "i"), (P("i"),), P("i"), "1",
         (data(8),)),
        ("ps_dim1_tiled", lambda x: lax.psum_scatter(x, "i", scatter_dimension=1, tiled=True),
         (P("i"),), P(None, "i"), "1", (data(4, 8),)),
        ("ps_dim1", lambda x: lax.psum_scatter(x, "i", scatter_dimension=1), (P("i"),),
         P("i"), "1", (data(4, 4),)),
        ("ps_ij_replicated", lambda x: lax.psum_scatter(x, ("i", "j"), tiled=True), (P(),),
         P(("i", "j")), "2", (data(8, 2),)),
        ("ps_ji_dim1", lambda x: lax.psum_scatter(x, ("j", "i"), scatter_dimension=1,
                                                  tiled=True),
         (P("i", "j"),), P(None, ("i", "j")), "2", (data(4, 16),)),
    ]


def exchanges(lax, P):
    """lax.ppermute: a partial permutation (ranks no pair sends to get zeros), one axis of
    a 2-d mesh, a replicated input; lax.all_to_all with
    split_axis != concat_axis (tiled), on one axis of a 2-d mesh, of a replicated input;
    lax.axis_index over a tuple of axes in either order (the first major); in_specs that
    split one dimension over both axes, P(('i', 'j'))."""
    def index(axes):
        return lambda x: x * (1 + lax.axis_index(axes))
    return [
        ("pp_partial", lambda x: lax.ppermute(x, "i", [(0, 1), (1, 2)]), (P("i"),), P("i"),
         "1", (data(8),)),
        ("pp_on_j", lambda x: lax.ppermute(x, "j", [(0, 1), (1, 0)]), (P("i", "j"),),
         P("i", "j"), "2", (data(4, 4),)),
        ("pp_on_i_partial", lambda x: lax.ppermute(x, "i", [(1, 0)]), (P("i", "j"),),
         P("i", "j"), "2", (data(4, 4),)),
        ("pp_replicated", lambda x: lax.ppermute(x, "i", SHIFT), (P(),), P("i"), "1",
         (data(2),)),
        ("a2a_s1c0_tiled", lambda x: lax.all_to_all(x, "i", 1, 0, tiled=True), (P("i"),),
         P(None, "i"), "1", (data(4, 8),)),
        ("a2a_s1c1_tiled", lambda x: lax.all_to_all(x, "i", 1, 1, tiled=True), (P("i"),),
         P("i"), "1", (data(8, 4),)),
        ("a2a_on_j", lambda x: lax.all_to_all(x, "j", 0, 1, tiled=True), (P("i", "j"),),
         P("i", "j"), "2", (data(8, 4),)),
        ("a2a_replicated", lambda x: lax.all_to_all(x, "i", 0, 0, tiled=True), (P(),),
         P("i"), "1", (data(8),)),
        ("index_ij", index(("i", "j")), (P("i", "j"),), P("i", "j"), "2", (data(4, 4),)),
        ("index_ji", index(("j", "i")), (P("i", "j"),), P("i", "j"), "2", (data(4, 4),)),
        ("joint_in_spec", index(("i", "j")), (P(("i", "j")),), P(("i", "j")), "2",
         (data(8, 2),)),
        ("joint_in_spec_psum", lambda x: lax.psum(x, "j"), (P(("i", "j")),), P("i"), "2",
         (data(8, 2),)),
    ]


def differentiable(lax, P):
    return reductions(lax, P) + gathers(lax, P) + exchanges(lax, P)


def discrete(lax, P):
    """Integer and bool values (no gradient): lax.psum sums bools as int32 (its docstring:
    boolean inputs are converted to integers), so pmean of bools is the fraction of True;
    pmax / pmin of bools, and the data-moving collectives, keep the dtype."""
    return [
        ("psum_bool", lambda x: lax.psum(x, "i"), (P("i"),), P(), "1", (BOOLS,)),
        ("psum_bool_ij", lambda x: lax.psum(x, ("i", "j")), (P(("i", "j")),), P(), "2",
         (BOOLS,)),
        ("psum_bool_invariant", lambda x: lax.psum(x, "j"), (P("i"),), P("i"), "2", (BOOLS,)),
        ("pmean_bool", lambda x: lax.pmean(x, "i"), (P("i"),), P(), "1", (BOOLS,)),
        ("pmax_bool", lambda x: lax.pmax(x, "i"), (P("i"),), P(), "1", (BOOLS,)),
        ("pmin_bool", lambda x: lax.pmin(x, "i"), (P("i"),), P(), "1", (BOOLS,)),
        ("psum_int", lambda x: lax.psum(x, "i"), (P("i"),), P(), "1", (INTS,)),
        ("pmax_int", lambda x: lax.pmax(x, "i"), (P("i"),), P(), "1", (INTS,)),
        ("pmin_ij", lambda x: lax.pmin(x, "j"), (P("i", "j"),), P("i"), "2",
         (data(4, 4),)),
        ("pmax_ji", lambda x: lax.pmax(x, ("j", "i")), (P("i", "j"),), P(), "2",
         (data(4, 4),)),
        ("ag_bool", lambda x: lax.all_gather(x, "i", tiled=True), (P("i"),), P("i"), "1",
         (BOOLS,)),
        ("ag_int", lambda x: lax.all_gather(x, "i"), (P("i"),), P("i"), "1", (INTS,)),
        ("pp_bool", lambda x: lax.ppermute(x, "i", SHIFT), (P("i"),), P("i"), "1", (BOOLS,)),
        ("ps_int", lambda x: lax.psum_scatter(x, "i", tiled=True), (P(),), P("i"), "1",
         (INTS,)),
        ("a2a_bool", lambda x: lax.all_to_all(x, "i", 0, 0, tiled=True), (P(),), P("i"), "1",
         (BOOLS,)),
    ]


def _recording(fn, seen: list, varying):
    """``fn``, noting the axes its first result varies along (``varying`` of either side)."""
    def f(*args):
        y = fn(*args)
        if not seen:
            seen.append(set(varying(y)))
        return y
    return f


@contextlib.contextmanager
def _case(name: str, failed: list | None = None):
    """Name the case in its failure; with ``failed``, note it there and go on, so one run
    lists every case that disagrees."""
    try:
        yield
    except AssertionError as e:
        if failed is None:
            e.add_note(f"case {name!r}")
            raise
        failed.append(f"{name}: {str(e).splitlines()[0][:300]}")


def _ml_meshes():
    import meshlab as ml

    return {"1": ml.Mesh(i=4), "2": ml.Mesh(i=2, j=2)}


def _jax_meshes(jax):
    return {"1": jax_mesh(jax, (4,), ("i",)), "2": jax_mesh(jax, (2, 2), ("i", "j"))}


def _jax_varying(jax):
    return lambda y: jax.typeof(y).manual_axis_type.varying


def case_differentiable(rank, world):
    import meshlab as ml
    from meshlab import P
    from meshlab.core.varying import vma

    meshes, out = _ml_meshes(), {}
    for name, fn, ins, outs, mesh, args in differentiable(ml, P):
        seen: list = []
        sm = ml.shard_map(_recording(fn, seen, vma), in_specs=ins, out_specs=outs,
                          mesh=meshes[mesh])
        out[name] = ml_value_and_grads(sm, args), seen[0]
    return out


def test_collectives_options_values_gradients_and_varying_axes(world4, jx):
    from jax.sharding import PartitionSpec as JP

    got = same_on_every_rank(world4.run(case_differentiable))
    meshes, failed = _jax_meshes(jx), []
    for name, fn, ins, outs, mesh, args in differentiable(jx.lax, JP):
        seen: list = []
        sm = jx.shard_map(_recording(fn, seen, _jax_varying(jx)), mesh=meshes[mesh],
                          in_specs=ins, out_specs=outs)
        with _case(name, failed):
            compare(got[name][0], jax_value_and_grads(jx, sm, args))
            assert got[name][1] == seen[0], (got[name][1], seen[0])
    assert not failed, "\n".join(failed)


def case_discrete(rank, world):
    import meshlab as ml
    from meshlab import P

    meshes, out = _ml_meshes(), {}
    for name, fn, ins, outs, mesh, args in discrete(ml, P):
        sm = ml.shard_map(fn, in_specs=ins, out_specs=outs, mesh=meshes[mesh])
        out[name] = sm(*[torch.from_numpy(a) for a in args]).full_tensor().numpy()
    return out


def test_integer_and_bool_values_and_dtypes(world4, jx):
    from jax.sharding import PartitionSpec as JP

    got = same_on_every_rank(world4.run(case_discrete))
    meshes, failed = _jax_meshes(jx), []
    for name, fn, ins, outs, mesh, args in discrete(jx.lax, JP):
        want = np.asarray(jx.shard_map(fn, mesh=meshes[mesh], in_specs=ins,
                                       out_specs=outs)(*args))
        with _case(name, failed):
            assert got[name].dtype == want.dtype, (got[name], want)
            np.testing.assert_array_equal(got[name], want)
    assert not failed, "\n".join(failed)


# -- all_to_all without tiled: split_axis dropped, a dim of the axis size inserted at -----
# concat_axis (lax.all_to_all's docstring). JAX's own gradient of it fails to transpose
# (a cotangent of the wrong shape), so the reference gradient is JAX's of the same map
# written with all_gather: block r of rank q is the index r of q's split_axis.
A2A = [(0, 1, (None, "i"), (4, 8)), (1, 0, ("i",), (8, 4)), (2, 0, ("i",), (8, 3, 4)),
       (0, 2, (None, "i"), (4, 8, 3)), (1, 1, ("i",), (8, 4))]


def case_all_to_all_stacked(rank, world):
    import meshlab as ml
    from meshlab import P

    mesh, out = ml.Mesh(i=4), []
    for split, concat, spec, shape in A2A:
        sm = ml.shard_map(lambda x: ml.all_to_all(x, "i", split, concat), in_specs=(P(*spec),),
                          out_specs=P("i"), mesh=mesh)
        out.append(ml_value_and_grads(sm, (data(*shape),)))
    return out


def test_all_to_all_stacked(world4, jx):
    from jax.sharding import PartitionSpec as JP

    jnp, lax = jx.numpy, jx.lax
    got = same_on_every_rank(world4.run(case_all_to_all_stacked))
    mesh = jax_mesh(jx, (4,), ("i",))

    def by_gather(x, split, concat):
        every = lax.all_gather(x, "i")                   # (4, *x.shape): source first
        mine = jnp.take(every, lax.axis_index("i"), axis=split + 1)
        return jnp.moveaxis(mine, 0, concat)

    for k, (split, concat, spec, shape) in enumerate(A2A):
        def sm(f):
            return jx.shard_map(f, mesh=mesh, in_specs=(JP(*spec),), out_specs=JP("i"))
        ref = sm(lambda x: by_gather(x, split, concat))
        own = sm(lambda x: lax.all_to_all(x, "i", split, concat))(data(*shape))
        with _case(f"all_to_all split {split} concat {concat}"):
            close(own, ref(data(*shape)))
            compare(got[k], jax_value_and_grads(jx, ref, (data(*shape),)))


# -- refusals: what JAX's shard_map or its collectives refuse, meshlab refuses typed -------
def _refusal(fn) -> tuple:
    try:
        fn()
    except Exception as e:          # noqa: BLE001 - the type is part of the answer
        return type(e).__name__, str(e)
    return None


def refused(lax, P, shard_map, meshes):
    """(name, thunk) of calls both sides must refuse; ``shard_map(f, ins, outs, mesh)``."""
    m1, m2 = meshes["1"], meshes["2"]
    inner = shard_map(lambda b: b * 2, P("i"), P("i"), m2)
    return [
        # the page's in_specs: each split dimension a multiple of its axes' size
        ("uneven", lambda: shard_map(lambda x: lax.psum(x.sum(), "i"), P("i"), P(), m1)(
            data(6))),
        ("uneven_2d", lambda: shard_map(lambda x: x, P("i", "j"), P("i", "j"), m2)(
            data(4, 3))),
        # the page's varying axes: an output laid out P() must not vary along 'i', even
        # where its blocks are equal (all_gather, ppermute and axis_index vary along it)
        ("out_unmapped_gather", lambda: shard_map(
            lambda x: lax.all_gather(x, "i", tiled=True).sum(0), P("i"), P(), m1)(data(8, 2))),
        ("out_unmapped_ppermute", lambda: shard_map(
            lambda x: lax.ppermute(x, "i", [(0, 1), (1, 0)]), P(), P(), m2)(data(4, 4))),
        ("out_unmapped_index", lambda: shard_map(
            lambda x: x * (0 * lax.axis_index("i")), P(), P(None, "j"), m2)(data(4, 4))),
        # psum_scatter adds, and addition of bools is refused (psum converts them first)
        ("psum_scatter_bool", lambda: shard_map(
            lambda x: lax.psum_scatter(x, "i", tiled=True), P(), P("i"), m1)(BOOLS)),
        # a shard_map inside another's function, over axes already manual
        ("nested", lambda: shard_map(lambda b: inner(b), P(), P(), m2)(data(4, 4))),
    ]


def case_refused(rank, world):
    import meshlab as ml
    from meshlab import P

    def sm(f, ins, outs, mesh):
        return lambda *a: ml.shard_map(f, in_specs=ins, out_specs=outs, mesh=mesh)(
            *[torch.from_numpy(x) if isinstance(x, np.ndarray) else x for x in a])

    out = {name: _refusal(thunk) for name, thunk in refused(ml, P, sm, _ml_meshes())}
    # pmax and pmin have no derivative in JAX: the gradient is refused, not zero
    x = torch.from_numpy(data(8)).requires_grad_()
    y = ml.shard_map(lambda b: ml.pmax(b, "i"), in_specs=P("i"), out_specs=P(),
                     mesh=ml.Mesh(i=4))(x)
    out["pmax_grad"] = _refusal(lambda: torch.autograd.grad(y.full_tensor().sum(), x))
    return out


MESSAGES = {"uneven": ("SpecError", "not a multiple of 4"),
            "uneven_2d": ("SpecError", "dim 1 (size 3)"),
            "out_unmapped_gather": ("SpecError", "output 0 varies along ('i',)"),
            "out_unmapped_ppermute": ("SpecError", "output 0 varies along ('i',)"),
            "out_unmapped_index": ("SpecError", "output 0 varies along ('i',)"),
            "psum_scatter_bool": ("ConfigError", "x.int()"),
            "nested": ("SpecError", "inside the function of shard_map"),
            "pmax_grad": ("ConfigError", "has no gradient")}


def test_refusals(world4, jx):
    from jax.sharding import PartitionSpec as JP

    got = same_on_every_rank(world4.run(case_refused))

    def sm(f, ins, outs, mesh):
        return jx.shard_map(f, mesh=mesh, in_specs=ins, out_specs=outs)

    for name, thunk in refused(jx.lax, JP, sm, _jax_meshes(jx)):
        with _case(name):
            with pytest.raises((ValueError, TypeError)):
                thunk()
    with pytest.raises(NotImplementedError):
        f = sm(lambda b: jx.lax.pmax(b, "i"), JP("i"), JP(), jax_mesh(jx, (4,), ("i",)))
        jx.grad(lambda b: f(b).sum())(data(8))
    failed: list = []
    for name, (kind, words) in MESSAGES.items():
        with _case(name, failed):
            assert got[name] is not None and got[name][0] == kind and words in got[name][1], \
                f"refused with {got[name]}, not {kind} naming {words!r}"
    assert not failed, "\n".join(failed)


# -- last, as a failure here used to hang the world: lax.ppermute's docstring allows a ----
# permutation with fixed points, pairs (i, i) whose rank keeps its own block
SELF_PAIRS = [[(0, 0), (1, 2), (2, 1), (3, 3)], [(0, 0), (2, 3)]]


def case_ppermute_self_pairs(rank, world):
    import meshlab as ml
    from meshlab import P

    return [ml_value_and_grads(ml.shard_map(lambda x: ml.ppermute(x, "i", perm), in_specs=P("i"),
                                            out_specs=P("i"), mesh=ml.Mesh(i=4)), (data(8),))
            for perm in SELF_PAIRS]


def test_ppermute_pairs_to_self(world4, jx):
    from jax.sharding import PartitionSpec as JP

    got = same_on_every_rank(world4.run(case_ppermute_self_pairs, timeout=120))
    mesh = jax_mesh(jx, (4,), ("i",))
    for g, perm in zip(got, SELF_PAIRS):
        sm = jx.shard_map(lambda x: jx.lax.ppermute(x, "i", perm), mesh=mesh,
                          in_specs=JP("i"), out_specs=JP("i"))
        with _case(str(perm)):
            compare(g, jax_value_and_grads(jx, sm, (data(8),)))
