"""Optimizers that are not elementwise under ZeRO-1 and beside tensor parallelism, on 4
gloo ranks, against one process.

* ``zero_shard(1)`` at dp=4 with three weight matrices: ranks 0-2 own one each, rank 3
  none (it holds no optimizer state, and still takes every collective). Adafactor and LAMB
  in float64 to 1e-12, Muon in float32 (its Newton-Schulz iteration patched to float32 on
  both sides, see test_optimizers_gloo.py) to 1e-5.
* ``shard(specs) | zero_shard(1)`` on dp=2 x tp=2: each owner's masters are DTensors over
  the tensor axis (LAMB's norms are the whole tensor's), and Adafactor steps each of them
  as a whole plain tensor on one rank of the tensor axis. ``shard(specs) | zero_shard(3)``
  with Adafactor: the 2-D DTensors stepped whole, each on one of the four ranks.
* ``precision('fp16')`` (loss scaling) with Adafactor under ZeRO-1: the same weights as
  under plain data parallelism with the same precision.
* ``meshlab.checkpoint`` of an optimizer stepped by owners is refused by name
  (``ConfigError``); ``opt.state_dict()`` serves.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.train.test_optimizers_gloo import (BATCH, MUON_TOL, STEPS, TOL, _base, _data,
                                              _full, _loss, _optimizers, _patch_muon,
                                              _reference, _same, _train)

pytestmark = pytest.mark.timeout(600)


def _tp_specs():
    from meshlab import P

    return {"inp.weight": P("tp", None), "mid.weight": P(None, "tp"),
            "out.weight": P(None, "tp")}


def case_dp4(rank, world):
    import meshlab as ml

    _patch_muon()
    for oname, (cls, kw, f64) in _optimizers().items():
        dtype, tol = (torch.float64, TOL) if f64 else (torch.float32, MUON_TOL)
        want_losses, ref, _ = _reference(cls, kw, dtype)
        losses, model, opt = _train(ml.zero_shard(1, "dp"), ml.Mesh(dp=4), cls, kw, dtype)
        _same(losses, model, want_losses, ref, tol, f"{oname} under zero_shard(1), dp=4")
        assert opt.zero1.owners == {"mid.weight": 0, "inp.weight": 1, "out.weight": 2}
        assert len(opt.state) == (0 if rank == 3 else 1), (oname, rank)
    return True


def case_tp_zero(rank, world):
    import meshlab as ml
    from torch.distributed.tensor import DTensor

    from meshlab.booster.nn.optimizer import Lamb

    mesh = ml.Mesh(dp=2, tp=2)
    cases = [("lamb under tp x zero1", Lamb, dict(lr=2e-2, weight_decay=0.01), 1),
             ("adafactor under tp x zero1", torch.optim.Adafactor, dict(lr=1e-2), 1),
             ("adafactor under tp x zero3", torch.optim.Adafactor, dict(lr=1e-2), 3)]
    for what, cls, kw, stage in cases:
        want_losses, ref, _ = _reference(cls, kw, torch.float64)
        spec = ml.shard(_tp_specs()) | ml.zero_shard(stage, "dp")
        losses, model, opt = _train(spec, mesh, cls, kw, torch.float64)
        assert all(isinstance(p, DTensor) for p in model.parameters()), what
        _same(losses, model, want_losses, ref, TOL, what)
    return True


def case_fp16(rank, world):
    """Loss scaling: Adafactor under ZeRO-1 (whole tensors on owners) and under plain data
    parallelism take the same steps."""
    import meshlab as ml

    cls, kw = torch.optim.Adafactor, dict(lr=1e-2)
    runs = {}
    for name, room in (("zero1", ml.zero_shard(1, "dp")), ("dp", ml.data_parallel("dp"))):
        spec = room | ml.precision("fp16", init_scale=2.0 ** 16)
        losses, model, opt = _train(spec, ml.Mesh(dp=4), cls, kw, torch.float32)
        runs[name] = (losses, {n: _full(p).detach().clone() for n, p in
                               model.named_parameters()}, opt.skipped_steps + opt.steps)
    (l1, w1, _), (l2, w2, _) = runs["zero1"], runs["dp"]
    torch.testing.assert_close(torch.tensor(l1), torch.tensor(l2), atol=1e-6, rtol=1e-5)
    for n in w1:
        torch.testing.assert_close(w1[n], w2[n], atol=1e-6, rtol=1e-5, msg=n)
    assert not torch.equal(w1["inp.weight"], _base(torch.float32).inp.weight.detach())
    return True


def case_checkpoint_refused(rank, world, path):
    import meshlab as ml
    from meshlab.core.errors import ConfigError

    for what, spec in (("zero_shard\\(1\\) steps each parameter whole",
                        ml.zero_shard(1, "dp")),
                       ("Adafactor steps each DTensor whole",
                        ml.shard(_tp_specs()) | ml.zero_shard(0, "dp"))):
        model = ml.parallelize(_base(torch.float64), spec, ml.Mesh(dp=2, tp=2) if "DTensor"
                               in what else ml.Mesh(dp=4))
        opt = ml.optimizer(model, torch.optim.Adafactor, lr=1e-2)
        with pytest.raises(ConfigError, match=f"meshlab.checkpoint.save.*{what}"):
            ml.checkpoint.save(f"{path}/ck", model, optimizer=opt, overwrite=True)
        ml.checkpoint.save(f"{path}/ck", model, overwrite=True)      # the weights alone
        with pytest.raises(ConfigError, match=f"meshlab.checkpoint.load.*{what}"):
            ml.checkpoint.load(f"{path}/ck", model, optimizer=opt)
    return True


def test_non_elementwise_optimizers_under_zero1_at_dp4_train_as_one_process(world4):
    assert world4.run(case_dp4) == [True] * 4


def test_lamb_and_adafactor_beside_tensor_parallelism_train_as_one_process(world4):
    assert world4.run(case_tp_zero) == [True] * 4


def test_adafactor_under_zero1_with_loss_scaling_steps_as_data_parallel(world4):
    assert world4.run(case_fp16) == [True] * 4


def test_checkpoints_of_owned_optimizer_state_are_refused_by_name(world4, tmp_path):
    assert world4.run(case_checkpoint_refused, path=str(tmp_path)) == [True] * 4
