"""Dropout under tensor parallelism draws as one process does (2 gloo processes).

In a sharded region each rank holds other heads; drawn from one stream, the
attention-dropout mask of local head ``i`` was the same on both tp ranks, so heads ``i``
and ``i + H/2`` shared a mask where one process draws them independently. Now a sharded
region draws from a stream of its rank (``meshlab.transforms.shard._rng``): the heads'
masks differ across the tp ranks, and each keeps ``1 - p`` of its entries. The replicated
activations (after the row-parallel projection's sum) keep one stream on every rank: their
masks agree, step after step, and so do the replicas of the weights they train.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tests import _models as M

pytestmark = pytest.mark.timeout(300)

P_DROP = 0.5


class _Masks(TorchFunctionMode):
    """Records the kept-entry mask of every ``F.dropout`` call: on attention weights
    (B, heads, S, S), inside a sharded region; on hidden states (B, S, H), replicated."""

    def __init__(self):
        super().__init__()
        self.sharded, self.replicated = [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is F.dropout and isinstance(out, torch.Tensor):
            kept = (out != 0).detach().clone()
            (self.sharded if kept.dim() == 4 else self.replicated).append(kept)
        return out


def _train(family: str, remat: bool, world: int):
    import meshlab as ml

    torch.manual_seed(1234)                 # the shared stream: the same on every rank
    over = dict(attention_dropout=P_DROP) if family == "llama" else \
        dict(attn_pdrop=P_DROP, resid_pdrop=P_DROP, embd_pdrop=P_DROP)
    spec = M.spec("tp") | (ml.remat("full") if remat else ml.parallel.Identity())
    model = ml.parallelize(M.build(family, **over), spec, ml.Mesh(dp=1, tp=world), seed=0)
    model.train()
    if family == "llama":                   # Llama has no hidden dropout: add one after
        for layer in model.model.layers:    # the attention's summed (replicated) output
            layer.self_attn.register_forward_hook(
                lambda _m, _a, out: F.dropout(out[0], P_DROP, training=True))
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-3)
    rec = _Masks()
    x = M.batches(1, batch=2, seed=3)[0]
    with rec:
        for _ in range(3):
            ml.step(model, opt, {"input_ids": x})
    return rec, {n: M.full(p).detach() for n, p in model.named_parameters()}


def masks_case(rank, world, family, remat):
    rec, weights = _train(family, remat, world)
    out = {"sharded": rec.sharded, "replicated": rec.replicated, "weights": weights}
    if remat:      # recomputation draws the masks the forward drew: the same training
        out["without remat"] = _train(family, False, world)[1]
    return out


@pytest.mark.parametrize("family,remat", [("llama", False), ("llama", True),
                                          ("gpt2", False)])
def test_dropout_masks_are_per_shard_in_sharded_regions_and_shared_elsewhere(
        world2, family, remat):
    a, b = world2.run(masks_case, family=family, remat=remat)
    assert len(a["sharded"]) == len(b["sharded"]) > 0
    for ma, mb in zip(a["sharded"], b["sharded"]):
        assert ma.shape == mb.shape and ma.shape[1] == 2           # 2 of the 4 heads each
        assert not torch.equal(ma, mb)         # heads i and i + 2 are drawn independently
        causal = torch.ones(ma.shape[-2:], dtype=torch.bool).tril()  # weights > 0 there
        for m in (ma, mb):                     # each keeps 1 - p of them
            kept = m[..., causal].float().mean().item()
            assert abs(kept - (1 - P_DROP)) < 0.15, kept
    # the replicated activations: one stream, the same masks on both ranks
    assert len(a["replicated"]) == len(b["replicated"]) > 0
    for ma, mb in zip(a["replicated"], b["replicated"]):
        assert torch.equal(ma, mb)
    for n, w in a["weights"].items():          # so the replicas of the weights agree
        assert torch.equal(w, b["weights"][n]), n
    # successive layers and steps draw other masks
    assert not torch.equal(a["sharded"][0], a["sharded"][1])
    if remat:
        for o in (a, b):
            for n, w in o["weights"].items():
                torch.testing.assert_close(w, o["without remat"][n], atol=1e-6, rtol=1e-5)
