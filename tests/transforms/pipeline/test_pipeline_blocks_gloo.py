"""Pipelines on declared blocks (``pipeline('pp', blocks='layers')``): a model of one's own
(``tests._models.StagedLM``, written to the contract) runs its own forward on every stage,
and trains like one process (float64, SGD: every step's loss and the final weights) with
every key of a padded batch delivered (``attention_mask`` and ``position_ids`` to the
stages, ``labels`` and the mask to the caller's loss on the last stage); the forward-only
pass (``step(..., train=False)``) returns the loss and the last stage's outputs."""

from __future__ import annotations

import pytest
import torch

from tests import _models as M

pytestmark = pytest.mark.timeout(900)
MICRO = 4


def _inputs(mb: dict) -> dict:
    return {k: v for k, v in mb.items() if k != "labels"}


def _cut(batch: dict, parts: int) -> list[dict]:
    return [{k: v.chunk(parts)[i] for k, v in batch.items()} for i in range(parts)]


def _mean_loss(model, batch: dict, groups: int) -> torch.Tensor:
    """The step's loss by ``reduction='mean'``: the mean over the data ranks' shards and
    their microbatches of ``staged_loss`` of each."""
    mbs = [mb for shard in _cut(batch, groups) for mb in _cut(shard, MICRO)]
    return sum(M.staged_loss(model(**_inputs(mb)), mb) for mb in mbs) / len(mbs)


def _reference(data, dp: int, lr: float):
    import meshlab as ml

    ref = ml.init_weights(M.build_staged(), seed=0)
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    losses = []
    for batch in data:
        loss = _mean_loss(ref, batch, dp)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return ref, losses


def _parallel(mesh_text: str, schedule: str, zero: int = 0):
    import meshlab as ml

    mesh = ml.Mesh(ml.Mesh.parse(mesh_text).shape)
    spec = ml.pipeline("pp", schedule=schedule, microbatches=MICRO, blocks="layers")
    if "dp" in mesh.shape:
        spec = spec | ml.zero_shard(zero, "dp")
    return ml.parallelize(M.build_staged(), spec, mesh, seed=0)


def _shard(model, batch: dict) -> dict:
    import torch.distributed as dist

    rt = model._meshlab
    i = dist.get_rank(rt.dp_group) if rt.dp_group is not None else 0
    return _cut(batch, rt.dp_size)[i]


def train_case(rank, world, schedule, mesh_text, steps=3, lr=0.5, left=False, zero=0):
    import meshlab as ml

    torch.set_default_dtype(torch.float64)
    try:
        model = _parallel(mesh_text, schedule, zero)
        if zero == 3:                         # every parameter sharded over dp by FSDP2
            from torch.distributed.tensor import DTensor

            assert all(isinstance(p, DTensor) for p in model.parameters())
        dp = model._meshlab.dp_size
        data = [M.padded_batch(batch=8 * dp, seed=s, left=left) for s in range(steps)]
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        losses = [ml.step(model, opt, _shard(model, b), M.staged_loss) for b in data]
        ref, want = _reference(data, dp, lr)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-10,
                                   atol=1e-12)
        owned = M.assert_weights_match(model, ref, atol=1e-10, rtol=1e-9)
        # the contract: this rank holds its blocks only, the ends on their stages
        held = {n.split(".")[0] for n in owned}
        return sorted(owned), len(dict(ref.named_parameters())), sorted(held)
    finally:
        torch.set_default_dtype(torch.float32)


def _check_split(out):
    """Every parameter of the model is held by some rank."""
    assert len(set().union(*(o[0] for o in out))) == out[0][1]


@pytest.mark.parametrize("schedule,left", [("1f1b", False), ("interleaved", False),
                                           ("zero_bubble", False), ("1f1b", True)])
def test_own_model_pp2_trains_like_one_process(world2, schedule, left):
    """Right padding as a tokenizer pads for training; left padding, where the real
    tokens' outputs depend on the mask reaching every stage."""
    out = world2.run(train_case, schedule=schedule, mesh_text="pp=2", left=left)
    _check_split(out)
    assert not set(out[0][0]) & set(out[1][0])              # stages hold disjoint parameters
    assert {"embed", "pos"} <= set(out[0][2]) and not {"norm", "head"} & set(out[0][2])
    assert {"norm", "head"} <= set(out[1][2]) and not {"embed", "pos"} & set(out[1][2])


def eval_case(rank, world, schedule, lr=0.5):
    """The forward only: the loss and the last stage's logits of one process (at every
    position, the padded ones included, which differ without the mask); no gradient;
    then a training step still trains like one process."""
    import meshlab as ml
    from meshlab.transforms.pipeline._runtime import PipelinePart

    torch.set_default_dtype(torch.float64)
    try:
        model = _parallel("pp=2", schedule)
        batch = M.padded_batch(seed=7)
        ref = ml.init_weights(M.build_staged(), seed=0)
        with torch.no_grad():
            want_loss = _mean_loss(ref, batch, 1).item()
            want = ref(**_inputs(batch))
            unmasked = ref(batch["ids"], position_ids=batch["position_ids"])
        pads = batch["attention_mask"] == 0
        assert pads.any() and not torch.allclose(want[pads], unmasked[pads])   # it can fail
        got = ml.step(model, None, batch, M.staged_loss, train=False)
        assert got == pytest.approx(want_loss, rel=1e-10)
        assert all(p.grad is None for p in model.parameters())
        rt = model._meshlab
        part = rt.part(PipelinePart)
        loss, out = part.forward_only(rt, batch, M.staged_loss, return_outputs=True)
        assert loss == pytest.approx(want_loss, rel=1e-10)
        if part.last:
            torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
        else:
            assert out is None
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        trained = ml.step(model, opt, batch, M.staged_loss)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
        loss = _mean_loss(ref, batch, 1)
        loss.backward()
        ref_opt.step()
        assert trained == pytest.approx(loss.item(), rel=1e-10)
        M.assert_weights_match(model, ref, atol=1e-10, rtol=1e-9)
        return part.last
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_own_model_forward_only(world2, schedule):
    assert sorted(world2.run(eval_case, schedule=schedule)) == [False, True]


def keys_case(rank, world):
    """A key the forward does not take is refused on every rank before any send, naming
    it; a key the first stage needs missing names the forward's parameter."""
    import meshlab as ml

    model = _parallel("pp=2", "1f1b")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = M.padded_batch()
    out = []
    for bad in ({**batch, "extra": batch["ids"]},
                {"input_ids" if k == "ids" else k: v for k, v in batch.items()}):
        try:
            ml.step(model, opt, bad, M.staged_loss)
        except ml.ConfigError as e:
            out.append(str(e))
    return out


def test_own_model_batch_keys_are_matched_to_its_forward(world2):
    for msgs in world2.run(keys_case):
        assert len(msgs) == 2
        assert "['extra']" in msgs[0] and "StagedLM.forward takes" in msgs[0]
        assert "first parameter, 'ids'" in msgs[1]


@pytest.mark.parametrize("schedule,zero", [("1f1b", 0), ("interleaved", 0),
                                           ("interleaved", 3)])
def test_own_model_pp2_dp2_trains_like_one_process(world4, schedule, zero):
    """Over data ranks too: plain data parallelism, and ZeRO-3 (each stage's view of the
    model an FSDP2 root over its blocks' units)."""
    out = world4.run(train_case, schedule=schedule, mesh_text="pp=2,dp=2", zero=zero)
    _check_split(out)
