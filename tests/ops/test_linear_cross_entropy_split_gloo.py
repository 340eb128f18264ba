"""The fused loss of a head split over the vocabulary (2 gloo processes).

``meshlab.ops.linear_cross_entropy_split`` against the loss of the whole logits in float64
(the loss, the summed gradient of the hidden states, each rank's rows of the weight's
gradient), on a vocabulary that splits unevenly, with ignored tokens and chunks smaller
than the batch; then ``fuse('loss')`` beside ``shard`` with the head split over the
vocabulary (in policy regions, with Megatron SP, and as a DTensor), trained against one
process, and the labels it reads checked against the vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from tests import _models as M

pytestmark = pytest.mark.timeout(300)


def op_case(rank, world, vocab, chunk):
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshlab.core.placement import dim_block
    from meshlab.ops.linear_cross_entropy import (linear_cross_entropy_reference,
                                                  linear_cross_entropy_split)

    g = torch.Generator().manual_seed(0)
    n_tok, hid = 13, 8
    h = torch.randn(n_tok, hid, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hid, generator=g, dtype=torch.float64)
    t = torch.randint(0, vocab, (n_tok,), generator=g)
    t[[2, 7]] = -100
    start, rows = dim_block(vocab, [world], [rank])

    ref_h, ref_w = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = linear_cross_entropy_reference(ref_h, ref_w, t)
    ref.backward()

    class Widest(TorchDispatchMode):
        """The largest product the loss builds, in elements."""
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mm.default:
                Widest.most = max(Widest.most, out.numel())
            return out

    mine_h = h.clone().requires_grad_()
    mine_w = w[start:start + rows].clone().requires_grad_()
    with Widest():
        loss = linear_cross_entropy_split(mine_h, mine_w, t, start=start, vocab=vocab,
                                          group=dist.group.WORLD, chunk=chunk)
    loss.backward()
    dh = mine_h.grad.clone()
    dist.all_reduce(dh)            # the head region's input sum, as the backward runs it
    torch.testing.assert_close(loss, ref.to(loss.dtype), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dh, ref_h.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(mine_w.grad, ref_w.grad[start:start + rows], rtol=1e-10,
                               atol=1e-12)
    # no product wider than one chunk of this rank's rows (nor the weight's gradient)
    assert Widest.most <= max(chunk * rows, rows * hid, chunk * hid), Widest.most

    bad = t.clone()
    bad[0] = vocab
    try:
        linear_cross_entropy_split(h, w[start:start + rows], bad, start=start, vocab=vocab,
                                   group=dist.group.WORLD)
    except IndexError as e:
        return str(e)
    return None


@pytest.mark.parametrize("vocab,chunk", [(37, 4), (37, 64), (1, 5)],
                         ids=["uneven-chunked", "one-chunk", "fewer-rows-than-ranks"])
def test_split_loss_is_the_whole_logits_loss(world2, vocab, chunk):
    for err in world2.run(op_case, vocab=vocab, chunk=chunk):
        assert err is not None and f"outside the vocabulary of {vocab}" in err


def _specs(mode: str):
    import meshlab as ml
    from meshlab import P

    rules = ml.Rules(**M.TP_RULES)
    if mode == "regions":
        return ml.shard(ml.policies.auto, rules)
    if mode == "sp":
        return ml.shard(ml.policies.auto, rules) | ml.sequence("tp", "split_gather")
    # DTensor mode: specs alone, the head's rows split and every other weight replicated
    return ml.shard({"lm_head.weight": P("vocab", None)}, rules)


def train_case(rank, world, mode):
    torch.set_default_dtype(torch.float64)
    try:
        return _train(world, mode)
    finally:
        torch.set_default_dtype(torch.float32)


def _train(world, mode):
    import meshlab as ml
    from meshlab.transforms.fuse import FuseLeft

    mesh = ml.Mesh(dp=1, tp=world)
    # fuse() as written routes the loss beside the split head, and leaves nothing
    plan = ml.plan(M.build("llama"), _specs(mode) | ml.fuse(), mesh)
    assert plan.decision(FuseLeft) is None, plan.decision(FuseLeft)

    data = M.batches(3, batch=4, seq=8)
    # float64, against the single process with the unfused loss of the whole logits (the
    # loss alone is fused here: every other op runs as transformers' in both)
    ref = ml.init_weights(M.build("llama"), seed=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref_losses = []
    for b in data:
        loss = ml.losses.causal_lm_loss(ref(input_ids=b), {"input_ids": b})
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())

    runs = {}
    for fused in (True, False):
        spec = _specs(mode) | ml.fuse("loss") if fused else _specs(mode)
        model = ml.parallelize(M.build("llama"), spec, mesh, seed=0)
        opt = ml.optimizer(model, torch.optim.SGD, lr=0.5)
        runs[fused] = (model, opt, [ml.step(model, opt, {"input_ids": b}) for b in data])
    (model, opt, losses), (unfused, _, unfused_losses) = runs[True], runs[False]
    # the same layout with meshlab's unfused vocabulary-parallel loss: equal to rounding
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(unfused_losses), rtol=1e-12,
                               atol=1e-12)
    M.assert_weights_match(model, unfused, atol=1e-12, rtol=1e-10)
    # and one process. DTensor mode sums the head's input gradient over the ranks as its
    # own op, and transformers' RMSNorm rounds the gradient it passes on to float32 (it
    # computes in float32 whatever the dtype), which shows that order at float32's
    # precision: the unfused loss in DTensor mode is off from one process by as much.
    tol = dict(rtol=1e-6, atol=1e-7) if mode == "dtensor" else dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol)
    M.assert_weights_match(model, ref, **tol)

    # labels that are not the checked ids: one outside the vocabulary is refused by name
    b = data[0]
    labels = b.clone()
    labels[0, 3] = 97
    try:
        ml.step(model, opt, {"input_ids": b, "labels": labels})
    except ml.MeshlabError as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("mode", ["regions", "sp", "dtensor"])
def test_fused_loss_on_a_vocabulary_split_head_trains_like_one_process(world2, mode):
    """Before the split loss, fuse() left the loss out beside a vocabulary-split head (and
    fuse('loss') was refused); routing it through the whole-vocabulary op there would
    compute each rank's loss over its own rows only."""
    for out in world2.run(train_case, mode=mode):
        assert out is not None, "a label outside the vocabulary trained silently"
        kind, msg = out
        assert kind == "BatchError" and "97" in msg and "outside the vocabulary" in msg, out


def pipeline_case(rank, world):
    """pp=2 x tp=2: the last stage hands its hidden states to the split fused loss."""
    import meshlab as ml

    spec = (ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES))
            | ml.pipeline("pp", microbatches=2) | ml.fuse("loss"))
    data = M.batches(2, batch=8, seq=8)
    report = ml.verify(M.build("llama"), spec, ml.Mesh(pp=2, tp=2),
                       [{"input_ids": b} for b in data], dtype=torch.float64)
    return report.ok, str(report)


def test_the_split_loss_on_a_pipelines_last_stage(world4):
    for ok, text in world4.run(pipeline_case):
        assert ok, text
        assert "fuse('loss')" in text
