"""A model of your own (plain PyTorch, no Hugging Face config, no policy) gets the estimates
a Hugging Face model gets: ``plan.memory`` / ``time`` / ``comm`` and ``meshlab.advise``
from an example input (``inputs=``, ``loss=``), the activations counted within 10% of a
real forward's (``SavedCounter``), and a typed error naming ``inputs=`` or ``specs=``
where the estimate cannot know how to call or shard the model. Fake meshes and one
process: no process group starts."""

from __future__ import annotations

import pytest
import torch

import meshlab as ml
from meshlab import P

from tests import _models as M

B, S = 2, 16
RULES = ml.Rules(**{**M.HAND_RULES, "batch": ("dp", None)})
SPECS = {k: P(*v) for k, v in M.HAND_SPECS.items()}


def ids_of(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, M.HAND["vocab"], (batch, seq))


class TwoInputs(torch.nn.Module):
    """The hand-written decoder called with token ids and positions (a tuple or a dict of
    arguments), returning its logits in a dict."""

    def __init__(self):
        super().__init__()
        self.lm = M.HandLM(**M.HAND)

    def forward(self, tokens, positions):
        h = self.lm.embed(tokens) + self.lm.pos(positions)
        for block in self.lm.blocks:
            h = block(h)
        return {"logits": self.lm.head(self.lm.norm(h))}


class Features(torch.nn.Module):
    """A stack of residual MLP blocks on float features: no token ids, no logits."""

    def __init__(self, dim: int = 24, n: int = 3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(M.HandMLP(dim, 2 * dim) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def _meta(cls, **kw):
    with torch.device("meta"):
        return cls(**kw)


def _tp_plan(mesh=None):
    return ml.plan(M.build_hand(), ml.shard(SPECS, RULES), mesh or ml.Mesh(dp=2, tp=2, fake=True))


def test_a_model_not_called_with_input_ids_asks_for_inputs():
    p = _tp_plan()
    for call in (lambda: p.memory(batch=B, seq=S), lambda: p.time(batch=B, seq=S),
                 lambda: p.comm(batch=B, seq=S)):
        with pytest.raises(ml.ConfigError, match=r"HandLM.forward takes no input_ids.*inputs="):
            call()
    # what needs no forward still works without a builder
    assert p.memory().total > 0 and p.comm().count("all_reduce", "dp") > 0
    with pytest.raises(ml.ConfigError, match="give batch= and seq= with them"):
        p.memory(inputs=ids_of)
    with pytest.raises(ml.ConfigError, match=r"inputs=3\): a function"):
        p.memory(batch=B, seq=S, inputs=3)
    with pytest.raises(ml.ConfigError, match="inputs= returned a list"):
        p.memory(batch=B, seq=S, inputs=lambda b, s: [ids_of(b, s)])
    with pytest.raises(ml.ConfigError, match=r"loss= returned a tensor of shape \(2, 16, 96\)"):
        p.memory(batch=B, seq=S, inputs=ids_of, loss=lambda out, ids: out)


@pytest.mark.parametrize("loss", [None, M.hand_loss], ids=["default_loss", "own_loss"])
def test_saved_activations_match_a_real_forward(loss):
    """One process: the plan's saved activations of the hand-written decoder, profiled on
    the example step, within 10% of what a real forward leaves for the backward."""
    from meshlab.estimate.profile import SavedCounter

    plan = ml.plan(M.build_hand(), None, ml.Mesh(dp=1, fake=True))
    want = plan.memory(batch=B, seq=S, inputs=ids_of, loss=loss).activations.saved
    model = ml.init_weights(M.build_hand(), seed=0)
    ids = ids_of(B, S)
    with SavedCounter(model) as sc:
        out = model(ids)
        got_loss = loss(out, ids) if loss else ml.losses.cross_entropy(out[:, :-1], ids[:, 1:])
    got = sc.saved(exclude=[got_loss])
    assert got > 0 and abs(want / got - 1) < 0.10, (want, got)


@pytest.mark.parametrize("spelling", ["tuple", "dict"])
def test_inputs_as_positional_or_keyword_arguments(spelling):
    """A builder returning a tuple calls model(*args), a dict model(**kwargs); the default
    loss finds the logits (in a dict output) and the token ids among the arguments."""
    from meshlab.estimate.profile import SavedCounter

    def build(b, s):
        tokens, pos = ids_of(b, s), torch.arange(s).expand(b, s)
        return (tokens, pos) if spelling == "tuple" else {"tokens": tokens, "positions": pos}

    plan = ml.plan(_meta(TwoInputs), None, ml.Mesh(dp=1, fake=True))
    want = plan.memory(batch=B, seq=S, inputs=build).activations.saved
    model = ml.init_weights(_meta(TwoInputs), seed=0)
    args = build(B, S)
    with SavedCounter(model) as sc:
        out = model(*args) if spelling == "tuple" else model(**args)
        ids = args[0] if spelling == "tuple" else args["tokens"]
        loss = ml.losses.cross_entropy(out["logits"][:, :-1], ids[:, 1:])
    got = sc.saved(exclude=[loss])
    assert abs(want / got - 1) < 0.10, (want, got)
    # the same step, its loss spelled out, is counted the same
    same = plan.memory(batch=B, seq=S, inputs=build, loss=lambda out, a: ml.losses.cross_entropy(
        out["logits"][:, :-1], (a[0] if spelling == "tuple" else a["tokens"])[:, 1:]))
    assert same.activations.saved == want


def test_without_token_ids_the_default_loss_is_the_sum_of_the_output():
    plan = ml.plan(_meta(Features), None, ml.Mesh(dp=1, fake=True))
    feats = lambda b, s: torch.randn(b, s, 24)                     # noqa: E731
    summed = plan.memory(batch=B, seq=S, inputs=feats).activations
    explicit = plan.memory(batch=B, seq=S, inputs=feats,
                           loss=lambda out, x: out.float().sum()).activations
    assert summed.saved == explicit.saved > 0
    assert plan.time(batch=B, seq=S, inputs=feats).compute > 0


def test_memory_and_time_scale_with_the_example_step():
    p = _tp_plan()
    small, big = (p.memory(batch=b, seq=S, inputs=ids_of).activations.saved for b in (1, 2))
    assert 1.9 < big / small <= 2.0
    one = ml.plan(M.build_hand(), None, ml.Mesh(dp=1, fake=True))
    whole = one.memory(batch=B, seq=S, inputs=ids_of).activations
    split = p.memory(batch=B, seq=S, inputs=ids_of).activations
    assert split.saved < whole.saved                 # the attention and MLP regions split
    assert any("/2 tp" in r.note for r in split.saved_rows if r.in_block)
    t1, t2 = (p.time(batch=b, seq=S, inputs=ids_of) for b in (2, 8))
    assert t2.tokens_per_s > t1.tokens_per_s and t2.comm > t1.comm > 0


def test_comm_measures_the_hidden_size_from_the_example_step():
    """No config gives the hidden size: the width of the hidden states entering the first
    block is measured (32), and tensor parallelism's traffic is counted with it."""
    from meshlab.estimate.profile import profile

    p = _tp_plan(ml.Mesh(dp=1, tp=2, fake=True))
    assert profile(p.source, p, B, S, ids_of).width == M.HAND["dim"]
    est = p.comm(batch=B, seq=S, inputs=ids_of)
    L, act = M.HAND["n_layers"], B * S * M.HAND["dim"] * 4
    # 2L + 1 all-reduces of the activations each way, 3 of the loss's scalars
    assert est.count("all_reduce", "tp") == 4 * L + 2 + 3
    assert est.bytes("all_reduce", "tp") == (4 * L + 2) * act + 3 * B * (S - 1) * 4
    assert p.comm(batch=B, seq=S, inputs=ids_of, loss=M.hand_loss).ops == est.ops
    # the plan the caller holds keeps its model's (empty) config
    assert p.model.config_get("hidden_size") is None
    back = ml.Plan.from_json(p.to_json())
    with pytest.raises(ml.PlanError, match="no model to measure the hidden size"):
        back.comm(batch=B, seq=S)


def test_advise_takes_the_specs_shard_would():
    m = M.build_hand()
    with pytest.raises(ml.PolicyError, match=r"advise\(model, gpus=4, specs=\{"):
        ml.advise(m, gpus=4, seq=S, inputs=ids_of)
    a = ml.advise(m, gpus=4, seq=S, specs=SPECS, rules=RULES, inputs=ids_of)
    meshes = {t.mesh for t in a.tried}
    assert (("tp", 4),) in meshes and (("dp", 2), ("tp", 2)) in meshes, meshes
    assert a.best and all(b.fits for b in a.best)
    assert a.model == "HandLM" and "tokens/s" in str(a)
    # each layout's numbers are its plan's, from the same example step
    lay = next(t for t in a.tried if t.mesh == (("dp", 2), ("tp", 2)) and t.remat == "none"
               and t.zero == 1)
    p = ml.plan(m, ml.shard(SPECS, RULES) | ml.zero_shard(1, "dp"),
                ml.Mesh(dp=2, tp=2, fake=True))
    assert lay.peak == p.memory(batch=2, seq=S, inputs=ids_of).peak
    # four heads: no layout splits them over 8
    assert all(dict(t.mesh).get("tp", 1) <= 4 for t in ml.advise(
        m, gpus=8, seq=S, specs=SPECS, rules=RULES, inputs=ids_of).tried)


def test_advise_says_why_when_every_layout_is_refused():
    strict = ml.Rules(**M.HAND_RULES)          # heads, mlp, vocab -> 'tp', on meshes without it
    with pytest.raises(ml.ConfigError, match="every layout of HandLM over 2 cards was refused"):
        ml.advise(M.build_hand(), gpus=2, seq=S, specs=SPECS, rules=strict, inputs=ids_of,
                  tp_max=1)
