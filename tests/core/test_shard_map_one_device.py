"""``shard_map`` with no mesh anywhere: one device holds every block, so a function written
with collectives by axis name runs unchanged on one process, each named axis of one rank
(what JAX computes on a mesh of size-1 axes). No process group starts."""

from __future__ import annotations

import pytest
import torch

import meshlab as ml
from meshlab import P


def _one_device(fn, *args):
    """``fn`` through ``shard_map`` in one process, no mesh given or active."""
    specs = tuple(P() for _ in args)
    return ml.shard_map(fn, in_specs=specs, out_specs=P(), check=False)(*args)


def test_collectives_act_over_an_axis_of_one_rank():
    x = torch.arange(6.0).reshape(2, 3).requires_grad_()
    same = {
        "psum": lambda b: ml.psum(b, "tp"),
        "psum over two axes": lambda b: ml.psum(b, ("dp", "tp")),
        "pmean": lambda b: ml.pmean(b, "tp"),
        "pmax": lambda b: ml.pmax(b, "tp"),
        "pmin": lambda b: ml.pmin(b, "tp"),
        "all_gather tiled": lambda b: ml.all_gather(b, "tp", axis=1, tiled=True),
        "psum_scatter tiled": lambda b: ml.psum_scatter(b, "tp", scatter_dimension=1,
                                                        tiled=True),
        "ppermute to itself": lambda b: ml.ppermute(b, "tp", [(0, 0)]),
        "all_to_all tiled": lambda b: ml.all_to_all(b, "tp", 0, 1, tiled=True),
    }
    for name, fn in same.items():
        torch.testing.assert_close(_one_device(fn, x), x, msg=name)
    stacked = _one_device(lambda b: ml.all_gather(b, "tp", axis=1), x)
    assert stacked.shape == (2, 1, 3) and torch.equal(stacked[:, 0], x)
    col = _one_device(lambda b: ml.psum_scatter(b, "tp", scatter_dimension=1), x[:, :1])
    assert col.shape == (2,) and torch.equal(col, x[:, 0])
    moved = _one_device(lambda b: ml.all_to_all(b, "tp", 0, 1), x[:1])   # (1, 3) -> (3, 1)
    assert moved.shape == (3, 1) and torch.equal(moved[:, 0], x[0])
    assert torch.equal(_one_device(lambda b: ml.ppermute(b, "tp", []), x), torch.zeros(2, 3))
    idx = _one_device(lambda b: b * ml.axis_index("tp") + ml.axis_size(("dp", "tp")), x)
    assert torch.equal(idx, torch.ones(2, 3))
    # differentiable, with the gradient of one process
    _one_device(lambda b: ml.psum(b * 2, "tp"), x).sum().backward()
    assert torch.equal(x.grad, torch.full((2, 3), 2.0))


def test_the_same_checks_as_on_a_mesh():
    x = torch.ones(2, 3)
    with pytest.raises(ml.SpecError, match="dim 1 has size 3; it must equal the 1 ranks"):
        _one_device(lambda b: ml.psum_scatter(b, "tp", scatter_dimension=1), x)
    with pytest.raises(ml.ConfigError, match="each position of 'tp' \\(0 to 0\\)"):
        _one_device(lambda b: ml.ppermute(b, "tp", [(0, 1)]), x)
    with pytest.raises(ml.ConfigError, match="one axis at a time"):
        _one_device(lambda b: ml.all_to_all(b, ("dp", "tp"), 0, 1, tiled=True), x)
    with pytest.raises(ml.ConfigError, match="each once"):
        _one_device(lambda b: ml.psum(b, ("tp", "tp")), x)
    # outside any shard_map function they still say where they belong
    with pytest.raises(ml.ConfigError, match="collectives by axis name run inside"):
        ml.psum(x, "tp")


def test_a_model_with_a_collective_runs_on_one_process():
    """The attention of notebook 04 in miniature: each head group's part of the output
    projection summed over 'tp' by psum; on one process, the plain computation."""
    torch.manual_seed(0)
    heads = P("batch", "heads", None, None)

    def attend(q, w):
        y = q.transpose(1, 2).flatten(2) @ w.T
        return ml.psum(y, "tp")

    core = ml.shard_map(attend, in_specs=(heads, P(None, "heads")), out_specs=P("batch", None,
                                                                                 None))
    q, w = torch.randn(2, 4, 5, 8), torch.randn(32, 32)
    torch.testing.assert_close(core(q, w), q.transpose(1, 2).flatten(2) @ w.T)
