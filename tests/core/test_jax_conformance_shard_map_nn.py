"""meshlab side by side with real JAX: the "Toy examples" of JAX's shard_map page
(jax-ml/jax, docs/notebooks/shard_map.md): the collective matmuls (all-gather on one side,
psum_scatter of the result, each plain, overlapped with ppermute and bidirectional) and the
neural networks (data parallelism, FSDP, tensor parallelism, FSDP x TP, SPMD pipeline),
each written again in our own code, run by ``jax.shard_map`` on 4 host devices in this
process and by ``meshlab.shard_map`` on 4 gloo ranks; values and gradients compared to
float64 rounding. Meshes of 8 devices are halved. The pipeline runs on the page's 2
devices in JAX; meshlab's mesh spans every rank, so its 2 stages get a second axis of 2
that nothing names.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from tests.core._jax import (TorchLax, close, compare, jax_mesh,  # noqa: F401
                             jax_value_and_grads, jx, ml_value_and_grads,
                             same_on_every_rank)

pytestmark = pytest.mark.timeout(600)

_RNG = np.random.default_rng(0)
LHS, RHS = _RNG.standard_normal((8, 8)), _RNG.standard_normal((8, 4))


# -- "Matrix multiplies": the page's six kernels, for either side -------------------------
class Ops:
    """The array operations the kernels use, spelled for torch; ``_JaxOps`` for JAX."""

    @staticmethod
    def slice_in_dim(x, start, size, dim):          # lax.dynamic_slice_in_dim
        return x.narrow(dim, start, size)

    @staticmethod
    def pad(x, before_after):                       # jnp.pad on a 2-d block
        (t, b), (lft, r) = before_after
        return torch.nn.functional.pad(x, (lft, r, t, b))

    @staticmethod
    def split2(x):                                  # jnp.split(x, 2, axis=0)
        return torch.chunk(x, 2, dim=0)

    concat = staticmethod(torch.cat)


def kernels(lax, ops):
    """name -> (kernel, lhs spec, rhs spec, out spec) as the page writes them."""
    def shifts(size):
        up = [(i, (i + 1) % size) for i in range(size)]
        return (lambda x: lax.ppermute(x, "i", up),
                lambda x: lax.ppermute(x, "i", [(d, s) for s, d in up]))

    def allgather(lhs_block, rhs_block):
        return lhs_block @ lax.all_gather(rhs_block, "i", tiled=True)

    def allgather_overlapped(lhs_block, rhs_block):
        size, idx = lax.axis_size("i"), lax.axis_index("i")
        shift, _ = shifts(size)
        b = lhs_block.shape[1] // size
        out_block = ops.slice_in_dim(lhs_block, idx * b, b, 1) @ rhs_block
        for i in range(1, size):
            rhs_block = shift(rhs_block)
            out_block = out_block + ops.slice_in_dim(lhs_block, (idx - i) % size * b, b, 1) \
                @ rhs_block
        return out_block

    def allgather_bidi(lhs_block, rhs_block):
        size, idx = lax.axis_size("i"), lax.axis_index("i")
        shift_up, shift_dn = shifts(size)
        b = lhs_block.shape[1] // size // 2

        def block_matmul(rhs_lo, rhs_hi, i_lo, i_hi):
            lhs_lo = ops.pad(ops.slice_in_dim(lhs_block, (2 * i_lo) * b, b, 1), ((0, 0), (0, b)))
            lhs_hi = ops.pad(ops.slice_in_dim(lhs_block, (2 * i_hi + 1) * b, b, 1),
                             ((0, 0), (b, 0)))
            rhs_lo = ops.pad(rhs_lo, ((0, b), (0, 0)))
            rhs_hi = ops.pad(rhs_hi, ((b, 0), (0, 0)))
            return (lhs_lo + lhs_hi) @ (rhs_lo + rhs_hi)

        lo, hi = ops.split2(rhs_block)
        out_block = block_matmul(lo, hi, idx, idx)
        for i in range(1, size):
            lo, hi = shift_up(lo), shift_dn(hi)
            out_block = out_block + block_matmul(lo, hi, (idx - i) % size, (idx + i) % size)
        return out_block

    def psumscatter(lhs_block, rhs_block):
        return lax.psum_scatter(lhs_block @ rhs_block, "i", tiled=True)

    def psumscatter_overlapped(lhs_block, rhs_block):
        size, idx = lax.axis_size("i"), lax.axis_index("i")
        _, shift = shifts(size)
        lhs_block = lhs_block.reshape(size, -1, lhs_block.shape[1])
        out_summand = lhs_block[(idx + 1) % size] @ rhs_block
        for i in range(1, size):
            out_summand = shift(out_summand)
            out_summand = out_summand + lhs_block[(idx + i + 1) % size] @ rhs_block
        return out_summand

    def psumscatter_bidi(lhs_block, rhs_block):
        size, idx = lax.axis_size("i"), lax.axis_index("i")
        shift_up, shift_dn = shifts(size)
        b = lhs_block.shape[0] // size // 2

        def blk(i, hi):
            return ops.slice_in_dim(lhs_block, (2 * i + hi) * b, b, 0)

        lo = blk((idx - 1) % size, 0) @ rhs_block
        hi = blk((idx + 1) % size, 1) @ rhs_block
        for i in range(1, size):
            lo, hi = shift_up(lo), shift_dn(hi)
            lo = lo + blk((idx - i - 1) % size, 0) @ rhs_block
            hi = hi + blk((idx + i + 1) % size, 1) @ rhs_block
        return ops.concat([lo, hi])

    gather = (("i", None), ("i", None), ("i", None))
    scatter = ((None, "i"), ("i", None), ("i", None))
    return {"allgather": (allgather,) + gather,
            "allgather_overlapped": (allgather_overlapped,) + gather,
            "allgather_bidi": (allgather_bidi,) + gather,
            "psumscatter": (psumscatter,) + scatter,
            "psumscatter_overlapped": (psumscatter_overlapped,) + scatter,
            "psumscatter_bidi": (psumscatter_bidi,) + scatter}


def case_matmuls(rank, world):
    import meshlab as ml
    from meshlab import P

    mesh = ml.Mesh(i=4)
    out = {}
    for name, (fn, ls, rs, os_) in kernels(TorchLax(), Ops).items():
        sm = ml.shard_map(fn, in_specs=(P(*ls), P(*rs)), out_specs=P(*os_), mesh=mesh)
        out[name] = ml_value_and_grads(sm, (LHS, RHS))
    return out


def test_collective_matmuls(world4, jx):
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as JP

    class JaxOps:
        slice_in_dim = staticmethod(jx.lax.dynamic_slice_in_dim)
        pad = staticmethod(jnp.pad)
        split2 = staticmethod(lambda x: jnp.split(x, 2, axis=0))
        concat = staticmethod(jnp.concatenate)

    got = same_on_every_rank(world4.run(case_matmuls))
    mesh = jax_mesh(jx, (4,), ("i",))
    for name, (fn, ls, rs, os_) in kernels(jx.lax, JaxOps).items():
        sm = jx.jit(jx.shard_map(fn, mesh=mesh, in_specs=(JP(*ls), JP(*rs)), out_specs=JP(*os_)))
        want = jax_value_and_grads(jx, sm, (LHS, RHS))
        close(want[0], LHS @ RHS)
        compare(got[name], want)


# -- "Neural networks" -----------------------------------------------------------------
SIZES = (8, 8, 8, 8, 8, 8, 4)       # the page's 784, 128 x 5, 8; every size divides by 4
N = 16                              # batch


def _init():
    rng = np.random.default_rng(1)
    params = [(rng.standard_normal((n, m)) / np.sqrt(n), rng.standard_normal(m))
              for n, m in zip(SIZES[:-1], SIZES[1:])]
    return params, (rng.standard_normal((N, SIZES[0])), rng.standard_normal((N, SIZES[-1])))


def networks(lax, np_, relu):
    """name -> (mesh axes, loss(params, batch), param spec, batch spec) for the page's
    shard_map networks; ``np_`` and ``relu`` are either side's ``mean``/``sum`` host and
    activation. ``loss_tp`` calls its shard_mapped ``gemm_tp``, given as ``lax.gemm_tp``."""
    def predict(params, inputs):
        for w, b in params:
            outputs = inputs @ w + b
            inputs = relu(outputs)
        return outputs

    def sq_err(pred, targets):
        return np_.sum((pred - targets) ** 2, -1)

    def loss_dp(params, batch):
        inputs, targets = batch
        return lax.pmean(np_.mean(sq_err(predict(params, inputs), targets)), "batch")

    def gather(p):
        return lax.all_gather(p, "batch", tiled=True)

    def predict_fsdp(params_frag, inputs):
        for w_frag, b_frag in params_frag:
            w = gather(w_frag)
            b = gather(b_frag)
            outputs = inputs @ w + b
            inputs = relu(outputs)
        return outputs

    def loss_fsdp(params, batch):
        inputs, targets = batch
        return lax.pmean(np_.mean(sq_err(predict_fsdp(params, inputs), targets)), "batch")

    # The page's gather_params: jax.remat with a policy that saves all but the
    # all_gather's result, so the backward gathers the weights again. torch keeps what a
    # consumer outside the recomputed function saves: its port recomputes each layer,
    # gathers included (lax.remat_layer); JAX's side rematerializes the gather
    # (lax.remat_gather), as the page writes it.
    gather_params = lax.remat_gather(gather)

    def layer(w_frag, b_frag, inputs):
        return inputs @ gather_params(w_frag) + gather_params(b_frag)

    def loss_fsdp_remat(params, batch):
        inputs, targets = batch
        for w_frag, b_frag in params:
            outputs = lax.remat_layer(layer)(w_frag, b_frag, inputs)
            inputs = relu(outputs)
        return lax.pmean(np_.mean(sq_err(outputs, targets)), "batch")

    def loss_tp(params, batch):                   # no shard_map: gemm_tp is one
        inputs, targets = batch
        for w, b in params:
            outputs = lax.gemm_tp(inputs, w, b)
            inputs = relu(outputs)
        return np_.mean(sq_err(outputs, targets))

    def loss_fsdp_tp(params, batch):
        inputs, targets = batch
        for w_frag, b_frag in params:
            w = lax.all_gather(w_frag, "batch", tiled=True)
            b = lax.all_gather(b_frag, "batch", tiled=True)
            outputs = lax.psum_scatter(inputs @ w, "feats", scatter_dimension=1,
                                       tiled=True) + b
            inputs = relu(outputs)
        sq = lax.psum(sq_err(outputs, targets), "feats")
        return lax.pmean(np_.mean(sq), "batch")

    return {"dp": ({"batch": 4}, loss_dp, (), ("batch",)),
            "fsdp": ({"batch": 4}, loss_fsdp, ("batch",), ("batch",)),
            "fsdp_remat": ({"batch": 4}, loss_fsdp_remat, ("batch",), ("batch",)),
            "tp": ({"feats": 4}, loss_tp, ("feats",), (None, "feats")),
            "fsdp_tp": ({"batch": 2, "feats": 2}, loss_fsdp_tp, (("feats", "batch"),),
                        ("batch", "feats"))}


def _reference(jax):
    """The page's ``loss``: the network on one device, which every strategy must equal."""
    import jax.numpy as jnp

    def loss(params, batch):
        inputs, targets = batch
        for w, b in params:
            outputs = jnp.dot(inputs, w) + b
            inputs = jax.nn.relu(outputs)
        return jnp.mean(jnp.sum((outputs - targets) ** 2, axis=-1))
    return loss


def gemm_tp(lax):
    def gemm(inputs, w, b):
        return lax.psum_scatter(inputs @ w, "feats", scatter_dimension=1, tiled=True) + b
    return gemm, ((None, "feats"), ("feats", None), ("feats",)), (None, "feats")


# meshlab splits a dimension over several axes in the mesh's order only (docs/jax.md): the
# page's P(('feats', 'batch')) on a ('batch', 'feats') mesh runs here on ('feats', 'batch')
ML_MESH = {"fsdp_tp": {"feats": 2, "batch": 2}}


def case_networks(rank, world, params, batch):
    import meshlab as ml
    from meshlab import P

    lax = TorchLax()
    out = {}
    for name, (axes, loss, pspec, bspec) in networks(lax, torch, torch.relu).items():
        mesh = ml.Mesh(ML_MESH.get(name, axes))
        flat = [torch.from_numpy(t).requires_grad_() for wb in params for t in wb]
        data = [torch.from_numpy(t) for t in batch]

        def pack(*args):
            return [tuple(args[i:i + 2]) for i in range(0, len(flat), 2)], args[len(flat):]

        if name == "tp":     # the page's jit-level loss around a shard_mapped gemm_tp
            gemm, ins, o = gemm_tp(lax)
            lax.gemm_tp = ml.shard_map(gemm, in_specs=tuple(P(*s) for s in ins),
                                       out_specs=P(*o), mesh=mesh)
            data = [ml.distribute(t, mesh, P(*bspec)) for t in data]
            value = loss(*pack(*flat, *data))
        else:                # shard_map at the top level; meshlab takes flat arguments
            sm = ml.shard_map(lambda *a: loss(*pack(*a)),
                              in_specs=(P(*pspec),) * len(flat) + (P(*bspec),) * 2,
                              out_specs=P(), mesh=mesh)
            value = sm(*flat, *data)
        value = value.full_tensor()
        grads = torch.autograd.grad(value, flat)
        out[name] = (float(value.detach()), [g.numpy() for g in grads])
    return out


def test_neural_networks(world4, jx):
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as JP

    params, batch = _init()
    got = same_on_every_rank(world4.run(case_networks, params=params, batch=batch))
    ref_value, ref_grads = jx.jit(jx.value_and_grad(_reference(jx)))(params, batch)
    lax = type("lax", (), dict(vars(jx.lax)))
    lax.remat_gather = staticmethod(functools.partial(
        jx.remat, policy=lambda prim, *_, **__: str(prim) != "all_gather"))
    lax.remat_layer = staticmethod(lambda f: f)
    for name, (axes, loss, pspec, bspec) in networks(lax, jnp, jx.nn.relu).items():
        mesh = jax_mesh(jx, tuple(axes.values()), tuple(axes))
        if name == "tp":
            gemm, ins, o = gemm_tp(jx.lax)
            lax.gemm_tp = jx.shard_map(gemm, mesh=mesh, in_specs=tuple(JP(*s) for s in ins),
                                       out_specs=JP(*o))
            fn = loss
        else:
            fn = jx.shard_map(loss, mesh=mesh, in_specs=(JP(*pspec), JP(*bspec)),
                              out_specs=JP())
        value, grads = jx.jit(jx.value_and_grad(fn))(params, batch)
        close(value, ref_value)                   # the page's check, to float64 rounding
        close(got[name][0], value)
        flat = [g for wb in grads for g in wb]
        for g, jg, rg in zip(got[name][1], flat, [g for wb in ref_grads for g in wb]):
            close(jg, rg)
            close(g, jg)


# -- "SPMD pipeline parallelism (PP)" ----------------------------------------------------
S, MB = 2, 4                        # stages, microbatch size
L = len(SIZES) - 3                  # inner layers (all but the first and the last)
M = N // MB                         # microbatches
K = M // S                          # microbatches per stage
F = SIZES[1]                        # features


def pipeline_loss(lax, ops):
    """The page's ``loss_pp`` and ``spmd_pipeline``; ``ops`` spells ``x.at[j].set(v)``,
    ``jnp.where``, ``jnp.roll``, ``jax.vmap`` and ``jnp.zeros`` for its side."""
    def shift(i, state, inputs, outputs):
        def sh(x, d):
            return lax.ppermute(x, "stages", [(j, (j + d) % S) for j in range(S)])
        state = ops.set_at(ops.roll(state), 0, sh(state[-1], +1))
        if (i % K) == (-1 % K):
            inputs = sh(inputs, +1)
        if ((i - L + 1) % K) == (-1 % K):
            outputs = sh(outputs, +1)
        return state, inputs, outputs

    def spmd_pipeline(fn, stage_params, inputs):
        stage = lax.axis_index("stages")
        outputs = ops.zeros_like(inputs) * np.nan
        state = ops.zeros((L // S, MB, F)) * np.nan
        for i in range(M + L - 1):
            state = ops.set_at(state, 0, ops.where(stage == 0, inputs[i % K], state[0]))
            state = ops.vmap(fn)(stage_params, state)
            j = (i - L + 1) % K
            outputs = ops.set_at(outputs, j, ops.where(stage == S - 1, state[-1], outputs[j]))
            state, inputs, outputs = shift(i, state, inputs, outputs)
        return lax.ppermute(outputs, "stages", [(j, (j + 1) % S) for j in range(S)])

    def loss_pp(params, batch):
        (w_first, b_first), inner, (w_last, b_last) = params
        inputs, targets = batch
        inputs = ops.relu(inputs.reshape(K, MB, -1) @ w_first + b_first)
        inputs = spmd_pipeline(lambda wb, x: ops.relu(x @ wb[0] + wb[1]), inner, inputs)
        predictions = (inputs @ w_last + b_last).reshape(K * MB, -1)
        local_loss = ops.mean(ops.sum((predictions - targets) ** 2, -1))
        return lax.pmean(local_loss, "stages")

    return loss_pp


class TorchOps:
    relu, where, zeros_like, mean, sum = torch.relu, torch.where, torch.zeros_like, torch.mean, \
        torch.sum

    @staticmethod
    def zeros(shape):
        return torch.zeros(shape, dtype=torch.float64)

    @staticmethod
    def set_at(x, j, v):
        return torch.cat([x[:j], v.unsqueeze(0), x[j + 1:]])

    @staticmethod
    def roll(x):
        return torch.roll(x, 1, 0)

    @staticmethod
    def vmap(fn):                   # over the stage's layers, one at a time
        return lambda wb, x: torch.stack([fn((wb[0][k], wb[1][k]), x[k])
                                          for k in range(x.shape[0])])


def _pp_params(params):
    first, *inner, last = params
    return first, (np.stack([w for w, _ in inner]), np.stack([b for _, b in inner])), last


def case_pipeline(rank, world, params, batch):
    import meshlab as ml
    from meshlab import P

    lax = TorchLax()
    loss = pipeline_loss(lax, TorchOps)
    (wf, bf), (ws, bs), (wl, bl) = _pp_params(params)
    flat = [torch.from_numpy(t).requires_grad_() for t in (wf, bf, ws, bs, wl, bl)]
    data = [torch.from_numpy(t) for t in batch]
    sm = ml.shard_map(lambda a, b, c, d, e, f, x, y: loss(((a, b), (c, d), (e, f)), (x, y)),
                      in_specs=(P(), P(), P("stages"), P("stages"), P(), P(),
                                P("stages"), P("stages")),
                      out_specs=P(), mesh=ml.Mesh(stages=S, rep=2))
    value = sm(*flat, *data).full_tensor()
    grads = torch.autograd.grad(value, flat)
    return float(value.detach()), [g.numpy() for g in grads]


def test_spmd_pipeline(world4, jx):
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as JP

    class JaxOps:
        relu, where, zeros_like, zeros, mean, sum = (jx.nn.relu, jnp.where, jnp.zeros_like,
                                                     jnp.zeros, jnp.mean, jnp.sum)
        vmap = staticmethod(jx.vmap)
        set_at = staticmethod(lambda x, j, v: x.at[j].set(v))
        roll = staticmethod(lambda x: jnp.roll(x, +1, axis=0))

    params, batch = _init()
    value, grads = same_on_every_rank(world4.run(case_pipeline, params=params, batch=batch))
    loss = jx.shard_map(pipeline_loss(jx.lax, JaxOps), mesh=jax_mesh(jx, (S,), ("stages",)),
                        in_specs=((JP(), JP("stages"), JP()), JP("stages")), out_specs=JP())
    want, jgrads = jx.jit(jx.value_and_grad(loss))(_pp_params(params), batch)
    close(want, _reference(jx)(params, batch))
    close(value, want)
    # the page takes this gradient only to show it runs: the NaN-filled pipeline state
    # reaches the stacked weights' gradient on both sides; NaNs compare equal by position
    jgrads = [g for wb in jgrads for g in wb]
    assert not np.isfinite(jgrads[2]).all() and np.isfinite(jgrads[3]).all()
    for g, jg in zip(grads, jgrads):
        close(g, jg)
