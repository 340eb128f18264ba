"""shard_map with JAX's semantics on 4 gloo ranks: plain arguments are global values split
by their specs, gradients of replicated inputs are summed over the axes the function's
values vary along, and collectives by axis name differentiate with JAX's transposes.

Each case is checked against the same computation on one process (float64); the side by
side with JAX itself is ``tests/core/test_jax_conformance.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.timeout(600)


def _full(x):
    from torch.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


def _mlp_params(gen):
    return [(torch.randn(4, 8, generator=gen, dtype=torch.float64),
             torch.randn(8, generator=gen, dtype=torch.float64)),
            (torch.randn(8, 3, generator=gen, dtype=torch.float64),
             torch.randn(3, generator=gen, dtype=torch.float64))]


def _predict(params, x):
    for i, (w, b) in enumerate(params):
        x = x @ w + b
        if i < len(params) - 1:
            x = torch.relu(x)
    return x


def case_loss_dp(rank, world):
    """JAX's shard_map page, "data parallelism": P() parameters closed over, the batch
    split over 'batch', pmean of the local losses; the gradients equal one process's."""
    import meshlab as ml
    from meshlab import P

    gen = torch.Generator().manual_seed(0)
    params = _mlp_params(gen)
    inputs = torch.randn(16, 4, generator=gen, dtype=torch.float64)
    targets = torch.randn(16, 3, generator=gen, dtype=torch.float64)
    flat = [t.requires_grad_() for wb in params for t in wb]

    def loss(inp, tgt):
        return ((_predict(params, inp) - tgt) ** 2).sum(-1).mean()

    ref = torch.autograd.grad(loss(inputs, targets), flat)
    mesh = ml.Mesh(batch=world)

    def loss_spmd(inp, tgt):
        local = ((_predict(params, inp) - tgt) ** 2).sum(-1).mean()
        return ml.pmean(local, "batch")

    out = ml.shard_map(loss_spmd, in_specs=(P("batch", None), P("batch", None)),
                       out_specs=P(), mesh=mesh)(inputs, targets)
    got = torch.autograd.grad(out.to_local(), flat)
    torch.testing.assert_close(out.to_local(), loss(inputs, targets).detach())
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    return [float(g.abs().sum()) for g in got]


def test_loss_dp_gradients_are_summed_over_the_batch(world4):
    out = world4.run(case_loss_dp)
    assert all(o == out[0] for o in out)


def case_matmul_basic(rank, world):
    """JAX's ``matmul_basic``: plain global operands split by their specs, a psum over 'y'."""
    import meshlab as ml
    from meshlab import P

    mesh = ml.Mesh(x=2, y=2)
    a = torch.arange(8 * 16, dtype=torch.float64).reshape(8, 16)
    b = torch.arange(16 * 4, dtype=torch.float64).reshape(16, 4)

    def matmul_basic(a_block, b_block):
        assert a_block.shape == (4, 8) and b_block.shape == (8, 4)
        return ml.psum(a_block @ b_block, "y")

    c = ml.shard_map(matmul_basic, in_specs=(P("x", "y"), P("y", None)),
                     out_specs=P("x", None), mesh=mesh)(a, b)
    assert tuple(c.shape) == (8, 4)
    torch.testing.assert_close(c.full_tensor(), a @ b)
    same = ml.shard_map(lambda blk: blk, in_specs=P("x"), out_specs=P("x"), mesh=mesh)
    assert tuple(same(torch.zeros(16, 4)).shape) == (16, 4)        # the global shape
    return True


def test_plain_arguments_are_global_values(world4):
    assert world4.run(case_matmul_basic) == [True] * 4


def case_different_globals(rank, world):
    import meshlab as ml
    from meshlab import P

    mesh = ml.Mesh(x=world)
    x = torch.full((8, 2), float(rank))
    try:
        ml.shard_map(lambda b: b, in_specs=P("x"), out_specs=P("x"), mesh=mesh)(x)
    except ml.SpecError as e:
        return str(e)
    raise AssertionError("accepted")


def test_ranks_passing_different_globals_are_refused(world4):
    out = world4.run(case_different_globals)
    assert all(o == out[0] for o in out)
    assert "global value" in out[0] and "pass different ones" in out[0]


def case_collectives(rank, world):
    """Each collective's value and gradient against one process's computation."""
    import meshlab as ml
    from meshlab import P

    mesh = ml.Mesh(x=2, y=2)
    x = torch.arange(4 * 6, dtype=torch.float64).reshape(4, 6).requires_grad_()
    out = {}

    def run(fn, in_spec, out_spec):
        y = ml.shard_map(fn, in_specs=(in_spec,), out_specs=out_spec, mesh=mesh)(x)
        full = y.full_tensor()
        g, = torch.autograd.grad((full * _weights_like(full)).sum(), x)
        return full.detach(), g

    # psum over 'y' of (2, 3) blocks -> P('x', None) of (2, 3): the sum of the two column halves
    v, g = run(lambda b: ml.psum(b, "y"), P("x", "y"), P("x", None))
    ref = x[:, :3] + x[:, 3:]
    torch.testing.assert_close(v, ref)
    wr = _weights_like(ref)
    torch.testing.assert_close(g, torch.cat([wr, wr], 1))
    out["psum"] = True
    # psum over both axes, replicated output
    v, g = run(lambda b: ml.psum(b, ("x", "y")), P("x", "y"), P())
    torch.testing.assert_close(v, x[:2, :3] + x[:2, 3:] + x[2:, :3] + x[2:, 3:])
    # pmean over 'x'
    v, g = run(lambda b: ml.pmean(b, "x"), P("x", "y"), P(None, "y"))
    torch.testing.assert_close(v, (x[:2] + x[2:]) / 2)
    wr = _weights_like(v)
    torch.testing.assert_close(g, torch.cat([wr / 2, wr / 2], 0))
    # all_gather, tiled and stacked: the gradient is the psum_scatter of the cotangent
    v, g = run(lambda b: ml.all_gather(b, "x", tiled=True), P("x", None), P("x", None))
    torch.testing.assert_close(v, torch.cat([x, x], 0))
    wr = _weights_like(v)         # rank i's block of x reaches rows 2i:2i+2 of both copies
    torch.testing.assert_close(g, torch.cat([wr[0:2] + wr[4:6], wr[2:4] + wr[6:8]], 0))
    v, _ = run(lambda b: ml.all_gather(b, "x"), P("x", None), P("x", None))
    assert v.shape == (4, 2, 6)                       # (2 stacked, 2 rows, 6) per rank
    torch.testing.assert_close(v[2:], torch.stack([x[:2], x[2:]]).detach())
    # psum_scatter over 'y' (tiled) of a replicated input: broadcast first (JAX), so the
    # sum is 2x, split over 'y' again; the gradient is the all_gather, summed back: 2w
    v, g = run(lambda b: ml.psum_scatter(b, "y", scatter_dimension=1, tiled=True), P(),
               P(None, "y"))
    torch.testing.assert_close(v, 2 * x)
    torch.testing.assert_close(g, 2 * _weights_like(v))
    # ppermute: a cyclic shift along 'x'
    v, g = run(lambda b: ml.ppermute(b, "x", [(0, 1), (1, 0)]), P("x", None), P("x", None))
    torch.testing.assert_close(v, torch.cat([x[2:], x[:2]], 0))
    wr = _weights_like(v)
    torch.testing.assert_close(g, torch.cat([wr[2:], wr[:2]], 0))
    # all_to_all over 'y' (tiled): rows split, columns joined
    v, g = run(lambda b: ml.all_to_all(b, "y", 0, 1, tiled=True), P(None, "y"), P("y", None))
    torch.testing.assert_close(v, x)
    torch.testing.assert_close(g, _weights_like(v))
    # axis_index and axis_size
    idx = ml.shard_map(lambda b: b * 0 + ml.axis_index(("x", "y")) + 10 * ml.axis_size("y"),
                       in_specs=(P("x", "y"),), out_specs=P("x", "y"), mesh=mesh)(x)
    assert idx.full_tensor().detach()[:, ::3].tolist() == [[20, 21]] * 2 + [[22, 23]] * 2
    return out


def _weights_like(y):
    return torch.linspace(0.5, 2.0, y.numel(), dtype=torch.float64).reshape(y.shape)


def test_collectives_by_axis_name(world4):
    out = world4.run(case_collectives)
    assert all(o == {"psum": True} for o in out)


def case_invariant_times_varying(rank, world):
    """A closed-over tensor that meets a varying value is broadcast (pvary): its gradient
    is the sum over the ranks; one that meets only invariant values is not summed."""
    import meshlab as ml
    from meshlab import P

    mesh = ml.Mesh(x=world)
    w = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    data = torch.arange(8, dtype=torch.float64)
    y = ml.shard_map(lambda d: ml.psum((d * w).sum(), "x"), in_specs=P("x"), out_specs=P(),
                     mesh=mesh)(data)
    g, = torch.autograd.grad(y.to_local(), w)
    z = ml.shard_map(lambda d: d * 0 + w * 2, in_specs=P(), out_specs=P(), mesh=mesh)(data)
    h, = torch.autograd.grad(z.to_local().sum(), w)
    return float(g), float(h)


def test_replicated_values_get_summed_gradients(world4):
    out = world4.run(case_invariant_times_varying)
    assert out == [(28.0, 16.0)] * 4          # sum(0..7); d(2w)/dw summed over 8 elements


def case_output_tiled_over_an_invariant_axis(rank, world):
    """An output laid out over an axis it does not vary along (``P('i', 'j')`` for a value
    the same on every rank of 'j') is broadcast there, JAX's implicit pvary on outputs:
    the blocks tile it, and its gradient is the sum over 'j' of the blocks' cotangents."""
    import meshlab as ml
    from meshlab import P

    mesh = ml.Mesh(i=2, j=2)
    x = torch.arange(4 * 3, dtype=torch.float64).reshape(4, 3).requires_grad_()
    y = ml.shard_map(lambda b: b * 2, in_specs=P("i", None), out_specs=P("i", "j"),
                     mesh=mesh)(x)
    full = y.full_tensor()
    torch.testing.assert_close(full, torch.cat([2 * x, 2 * x], 1).detach())
    w = _weights_like(full)
    g, = torch.autograd.grad((full * w).sum(), x)
    torch.testing.assert_close(g, 2 * (w[:, :3] + w[:, 3:]))
    return g.tolist()


def test_outputs_tiled_over_an_invariant_axis_sum_their_gradients(world4):
    out = world4.run(case_output_tiled_over_an_invariant_axis)
    assert all(o == out[0] for o in out)


def case_collective_outside(rank, world):
    import meshlab as ml

    try:
        ml.psum(torch.ones(2), "x")
    except ml.ConfigError as e:
        return str(e)
    raise AssertionError("accepted")


def test_collectives_outside_shard_map_name_the_fix(world2):
    out = world2.run(case_collective_outside)
    assert "inside the function shard_map calls" in out[0]


def case_remat_inside(rank, world):
    """``ml.remat`` inside the function (JAX's FSDP example, whose ``gather_params`` is
    rematerialized): each layer, its weights' all-gathers included, keeps nothing for the
    backward, which runs it again under the function's region, so the gathers and the
    pvary of a replicated scale recompute as in the first run; the values and gradients
    equal one process's and the plain run's. (torch keeps what a consumer outside the
    recomputed function saves, so the layer is what is recomputed, not the gather alone.)
    ``torch.utils.checkpoint`` there instead recomputes outside the region, and the
    collective refuses it with the fix."""
    from torch.distributed.tensor.debug import CommDebugMode

    import meshlab as ml
    from meshlab import P

    mesh = ml.Mesh(batch=world)
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(*s, generator=gen, dtype=torch.float64).requires_grad_()
              for s in ((4, 8), (8,), (8, 4), (4,))]        # each splits over 4 ranks
    scale = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    x = torch.randn(8, 4, generator=gen, dtype=torch.float64)

    def layer(w, b, xb):
        return xb @ ml.all_gather(w, "batch", tiled=True) + \
            ml.all_gather(b, "batch", tiled=True) * scale

    def body(wrap):
        def f(w1, b1, w2, b2, xb):
            y = wrap(layer)(w2, b2, torch.relu(wrap(layer)(w1, b1, xb)))
            return ml.pmean(y.pow(2).mean(), "batch")
        return ml.shard_map(f, in_specs=(P("batch"),) * 5, out_specs=P(), mesh=mesh)

    def torch_checkpoint(fn):
        return lambda *a: torch.utils.checkpoint.checkpoint(fn, *a, use_reentrant=False)

    runs = {}
    for name, wrap in (("plain", lambda fn: fn), ("remat", ml.remat)):
        loss = body(wrap)(*params, x).to_local()
        with CommDebugMode() as cd:
            grads = torch.autograd.grad(loss, params + [scale])
        runs[name] = (float(loss.detach()), grads, cd.get_total_counts())
    w1, b1, w2, b2 = params
    ref_loss = ((torch.relu(x @ w1 + b1 * scale) @ w2 + b2 * scale) ** 2).mean()
    ref = torch.autograd.grad(ref_loss, params + [scale])
    for name, (loss, grads, _) in runs.items():
        assert abs(loss - float(ref_loss)) < 1e-12, name
        for g, r in zip(grads, ref):
            torch.testing.assert_close(g, r, atol=1e-12, rtol=1e-12)
    try:
        body(torch_checkpoint)(*params, x).to_local().backward()
    except ml.ConfigError as e:
        refusal = str(e)
    else:
        raise AssertionError("torch.utils.checkpoint inside shard_map was accepted")
    return {"comms": {k: v[2] for k, v in runs.items()}, "refusal": refusal}


def test_remat_inside_shard_map_recomputes_under_the_region(world4):
    out = world4.run(case_remat_inside)
    # the backward runs both layers' two all-gathers again
    assert all(o["comms"]["remat"] == o["comms"]["plain"] + 4 for o in out), out
    assert all("ml.remat(f)" in o["refusal"] for o in out)
