"""Results that used to be silently wrong, now a typed error on every rank or the
single-process result (4 gloo processes).

* Token ids or labels outside the vocabulary: one process raises ``IndexError``, a
  vocabulary-split embedding or loss masks them. Every forward checks them: the ranks
  reading the bad batch raise ``BatchError`` naming the value, the vocabulary and the key,
  the others ``PeerError`` naming it, before any collective of that forward; the ranks are
  still in step afterwards (a good step runs).
* ``dataloader`` splits over the plan's data axes, whatever their names.
* A NaN on one rank's loss (fp32, bf16, ZeRO-1, TP): every rank skips the step and warns,
  weights unchanged, finite and equal everywhere; or every rank raises ``NonFiniteError``.
* Replicas that differ (another seed on one rank; a weight transposed on one rank, which
  a sum cannot see) fail on every rank with ``RankMismatchError`` naming what differs, or
  with ``sync_module_states=True`` all take rank 0's values, with a warning.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests import _models as M

pytestmark = pytest.mark.timeout(600)


def _outcome(fn):
    import meshlab as ml

    try:
        out = fn()
    except ml.MeshlabError as e:
        return type(e).__name__, str(e)
    return None, out


def _layout(name: str, world: int):
    import meshlab as ml
    from meshlab import P

    if name == "tp_only":
        return M.spec("tp"), ml.Mesh(dp=1, tp=world)
    if name == "hand_tp_only":          # DTensor mode: the model's own forward on DTensors
        specs = {k: P(*v) for k, v in M.HAND_SPECS.items()}
        return ml.shard(specs, ml.Rules(**M.HAND_RULES)), ml.Mesh(dp=1, tp=world)
    return M.spec(name), M.mesh_for(name, world)


def _dp_rank(model) -> int:
    import torch.distributed as dist

    rt = model._meshlab
    return dist.get_rank(rt.dp_group) if rt.dp_group is not None else 0


def _local(model, b):
    return b.chunk(model._meshlab.dp_size)[_dp_rank(model)].clone()


# -- token ids and labels against the vocabulary ------------------------------------------
def _poison(what: str, x: torch.Tensor):
    """(input ids, labels) of this rank, with the bad value ``what`` put in one of them."""
    y = x.clone()
    if what in ("id_high", "id_negative"):
        x[0, 3] = 97 if what == "id_high" else -1
    elif what in ("label_high", "label_negative", "hf_labels"):
        y[0, 5] = {"label_high": 97, "label_negative": -5, "hf_labels": 100}[what]
    return x, y


def vocab_case(rank, world, layout, what):
    import meshlab as ml
    from meshlab.estimate.comm import CommCounter

    spec, mesh = _layout(layout, world)
    hand = layout.startswith("hand")
    model = ml.parallelize(M.build_hand() if hand else M.build("llama"), spec, mesh, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    vocab = M.HAND["vocab"] if hand else 97
    good = _local(model, M.batches(2, vocab=vocab)[1])
    bad_here = _dp_rank(model) == model._meshlab.dp_size - 1    # one whole replica
    x, y = _poison(what, good.clone()) if bad_here else (good.clone(), good.clone())
    with CommCounter() as cc:
        if hand:
            out = _outcome(lambda: M.hand_loss(model(x), x).backward())
        elif what == "hf_labels":
            out = _outcome(lambda: model(input_ids=x, labels=y).loss.backward())
        else:
            batch = {"input_ids": x} if what.startswith("id") else {"input_ids": x, "labels": y}
            out = _outcome(lambda: ml.step(model, opt, batch))
    model.zero_grad()
    data_calls = [c for c in cc.calls if c[0] != "control"]
    if hand:
        after = M.hand_loss(model(good), good)
    else:
        after = ml.step(model, opt, {"input_ids": good})    # the ranks are still in step
    return out, bad_here, data_calls, float(after)


@pytest.mark.parametrize("layout,what", [
    ("dp", "id_high"), ("tp", "id_high"), ("zero3", "id_negative"), ("tp_sp", "id_high"),
    ("tp_only", "id_high"), ("hand_tp_only", "id_high"),
    ("tp", "label_high"), ("dp", "label_negative"), ("dp", "hf_labels"),
    ("tp", "hf_labels"), ("tp_zero3", "hf_labels"),
])
def test_values_outside_the_vocabulary_fail_on_every_rank(world4, layout, what):
    out = world4.run(vocab_case, layout=layout, what=what)
    value = {"id_high": "97", "id_negative": "-1", "label_high": "97", "label_negative": "-5",
             "hf_labels": "100"}[what]
    key = {"id_high": "input_ids", "id_negative": "input_ids", "hf_labels": "labels"}.get(
        what, "labels")
    if layout.startswith("hand"):
        key, vocab = "ids", M.HAND["vocab"]
    else:
        vocab = 97
    for (kind, msg), bad, data_calls, after in out:
        if bad:
            assert kind == "BatchError", (kind, msg)
            assert f" {value}," in msg and f"vocabulary of {vocab}" in msg and key in msg, msg
        else:
            assert kind == "PeerError" and "BatchError" in msg and value in msg, (kind, msg)
        if what.startswith("id") or what == "hf_labels":
            assert data_calls == [], data_calls       # before any collective of the forward
        assert torch.isfinite(torch.tensor(after))


def ignored_labels_case(rank, world):
    """-100 labels under a vocabulary-parallel head: the single-process loss."""
    import meshlab as ml

    ref = ml.init_weights(M.build("llama"), seed=0)
    model = ml.parallelize(M.build("llama"), M.spec("tp"), M.mesh_for("tp", world), seed=0)
    x = _local(model, M.batches(1)[0])
    y = x.clone()
    y[:, :3] = -100
    got, want = model(input_ids=x, labels=y).loss, ref(input_ids=x, labels=y).loss
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    batch = {"input_ids": x, "labels": y}
    step = ml.losses.causal_lm_loss(model(input_ids=x), batch)
    torch.testing.assert_close(step, ml.losses.causal_lm_loss(ref(input_ids=x), batch),
                               atol=1e-5, rtol=1e-4)


def test_ignored_labels_keep_the_single_process_loss(world4):
    world4.run(ignored_labels_case)


# -- the data loader splits over the plan's data axes -------------------------------------
def dataloader_case(rank, world):
    import meshlab as ml

    ds = torch.utils.data.TensorDataset(torch.arange(32))
    # tensor parallelism on an axis named dp, data parallelism on 'data'
    mesh = ml.Mesh(data=2, dp=2)
    rules = ml.Rules(batch="data", heads="dp", kv_heads="dp", mlp="dp", vocab="dp", embed=None)
    plan = ml.plan(M.build("llama"), ml.shard(ml.policies.auto, rules), mesh)
    by_plan = [b[0].tolist() for b in ml.dataloader(ds, mesh, 8, plan=plan, seed=3)]
    # no conventionally named data axis at all
    mesh2 = ml.Mesh(replica=2, tp=2)
    rules2 = ml.Rules(batch="replica", heads="tp", kv_heads="tp", mlp="tp", vocab="tp",
                      embed=None)
    model = ml.parallelize(M.build("llama"), ml.shard(ml.policies.auto, rules2), mesh2, seed=0)
    by_model = [b[0].tolist() for b in ml.dataloader(ds, None, 8, model=model, seed=3)]
    refused = _outcome(lambda: ml.dataloader(ds, mesh2, 8))
    return by_plan, by_model, refused, mesh.coordinate(rank), mesh2.coordinate(rank)


def _split_by(seen, coords, data_axis):
    by: dict = {}
    for s, c in zip(seen, coords):
        by.setdefault(c[data_axis], []).append(s)
    for views in by.values():
        assert all(v == views[0] for v in views), views    # peers off the data axis: equal
    sets = [{x for batch in views[0] for x in batch} for views in by.values()]
    assert not sets[0] & sets[1] and len(sets[0] | sets[1]) == 32, sets    # disjoint, all
    assert all(len(b) == 4 for b in seen[0])


def test_dataloader_splits_over_the_plans_data_axes(world4):
    out = world4.run(dataloader_case)
    _split_by([o[0] for o in out], [o[3] for o in out], "data")
    _split_by([o[1] for o in out], [o[4] for o in out], "replica")
    for o in out:
        kind, msg = o[2]
        assert kind == "ConfigError" and "model=" in msg and "replica" in msg, o[2]


# -- a NaN on one rank ----------------------------------------------------------------------
def _digest(model) -> torch.Tensor:
    """Every full parameter's bytes, as two integer sums (equal on every rank or not)."""
    from meshlab.apply.materialize import _checksum

    return torch.tensor([_checksum(M.full(p).detach()) for p in model.parameters()])


def nonfinite_case(rank, world, spec_name, precision, mode):
    import torch.distributed as dist

    import meshlab as ml

    spec = M.spec(spec_name) | (ml.precision("bf16") if precision == "bf16" else
                                ml.precision("fp32"))
    model = ml.parallelize(M.build("llama"), spec, M.mesh_for(spec_name, world), seed=0)
    kw = dict(clip_grad_norm=1.0) if mode == "skip" else dict(nonfinite="raise")
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-3, **kw)
    data = [_local(model, b) for b in M.batches(3)]
    ml.step(model, opt, {"input_ids": data[0]})

    def poisoned(out, batch):      # a NaN in rank 1's loss only
        loss = ml.losses.causal_lm_loss(out, batch)
        return loss * float("nan") if rank == 1 else loss

    before = {n: M.full(p).detach().clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _outcome(lambda: ml.step(model, opt, {"input_ids": data[1]}, poisoned))
    for n, p in model.named_parameters():
        w = M.full(p).detach()
        assert torch.equal(w, before[n]) and torch.isfinite(w).all(), n
    mine = _digest(model)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    assert all(torch.equal(d, mine) for d in every), "weights differ across ranks"
    loss = ml.step(model, opt, {"input_ids": data[2]})        # the next step trains
    assert torch.isfinite(torch.tensor(loss))
    assert any(not torch.equal(M.full(p).detach(), before[n])
               for n, p in model.named_parameters())
    msgs = [str(w.message) for w in caught if "gradient norm" in str(w.message)]
    return out[0], out[1] if out[0] else None, msgs, opt.skipped_steps


@pytest.mark.parametrize("spec_name,precision,mode", [
    ("dp", "fp32", "skip"), ("dp", "bf16", "skip"), ("tp", "bf16", "skip"),
    ("zero1", "fp32", "raise"),
])
def test_a_nan_on_one_rank_skips_the_step_everywhere(world4, spec_name, precision, mode):
    out = world4.run(nonfinite_case, spec_name=spec_name, precision=precision, mode=mode)
    for kind, msg, warned, skipped in out:
        assert skipped == 1
        if mode == "skip":
            assert kind is None and len(warned) == 1, (kind, warned)
            assert "step 2" in warned[0] and "nan" in warned[0] and "skipped" in warned[0]
        else:
            assert kind == "NonFiniteError" and "step 2" in msg and "nan" in msg, (kind, msg)
            assert warned == []


# -- replicas that differ -------------------------------------------------------------------
def replica_case(rank, world, what):
    import meshlab as ml

    if what == "seed":
        seed = 1 if rank == 3 else 0
        return _outcome(lambda: ml.parallelize(M.build("llama"), ml.data_parallel("dp"),
                                               ml.Mesh(dp=world), seed=seed))
    model = ml.init_weights(M.build("llama"), seed=0)
    w = model.model.layers[0].self_attn.q_proj.weight
    total = float(w.detach().double().sum())
    if rank == 3:                 # the same values, another layout: a sum cannot tell
        with torch.no_grad():
            w.copy_(w.t().clone())
    assert float(w.detach().double().sum()) == pytest.approx(total, rel=1e-12)
    return _outcome(lambda: ml.parallelize(model, ml.data_parallel("dp"), ml.Mesh(dp=world)))


@pytest.mark.parametrize("what,words", [
    ("seed", ["seed", "ranks [3]"]),
    ("transposed", ["model.layers.0.self_attn.q_proj.weight", "ranks [3]", "seed"]),
])
def test_replicas_that_differ_fail_on_every_rank(world4, what, words):
    out = world4.run(replica_case, what=what)
    for kind, msg in out:
        assert kind == "RankMismatchError", (kind, msg)
        for w in words:
            assert w in msg, (w, msg)



def synced_case(rank, world):
    """``sync_module_states=True``: replicas built from another seed on rank 3 all hold
    rank 0's values after parallelize (parameters and buffers, as DDP broadcasts them),
    and rank 0 warns how many differed; replicas that agree move nothing and warn nothing."""
    import meshlab as ml
    from tests._logs import logged

    got = []
    for seeds in ((1 if rank == 3 else 0), 0):
        model = ml.init_weights(M.build("llama"), seed=seeds)
        with logged() as warned:
            model = ml.parallelize(model, ml.data_parallel("dp"), ml.Mesh(dp=world),
                                   sync_module_states=True)
        ref = ml.init_weights(M.build("llama"), seed=0)
        mine = dict(model.named_parameters())
        same = all(torch.equal(M.full(mine[n]).detach().cpu(), p.detach())
                   for n, p in ref.named_parameters())
        got.append((same, warned))
    return got


def test_replicas_that_differ_take_rank_0s_values_when_asked(world4):
    import meshlab as ml

    out = world4.run(synced_case)
    for rank, ((same, warned), (same_again, warned_again)) in enumerate(out):
        assert same and same_again, rank
        assert warned_again == [], warned_again
        if rank == 0:
            assert len(warned) == 1 and "differed across ranks" in warned[0] and \
                "rank 0's values" in warned[0], warned
    with pytest.raises(ml.ConfigError, match="sync_module_states must be True or False"):
        ml.parallelize(M.build("llama"), ml.data_parallel("dp"), ml.Mesh(dp=1, fake=True),
                       sync_module_states=1)


# -- the label check takes the same path on every rank ----------------------------------------
def labels_identity_case(rank, world, how, bad):
    """Rank 0 passes the input ids themselves as labels, the others a copy of them: the
    check of the copy must not make those ranks exchange what rank 0 skips."""
    import meshlab as ml

    model = ml.parallelize(M.build("llama"), ml.data_parallel("dp"), ml.Mesh(dp=world), seed=0)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-3)
    x = _local(model, M.batches(1)[0])
    y = x if rank == 0 else x.clone()
    if bad and rank == 2:
        y[0, 4] = 97
    if how == "step":
        out = _outcome(lambda: ml.step(model, opt, {"input_ids": x, "labels": y}))
    elif how == "hf":
        out = _outcome(lambda: model(input_ids=x, labels=y).loss.backward())
    else:                   # a loss computed outside the model's forward
        out = _outcome(lambda: ml.losses.causal_lm_loss(
            model(input_ids=x), {"input_ids": x, "labels": y}).backward())
    model.zero_grad()
    return out, ml.step(model, opt, {"input_ids": x})


@pytest.mark.parametrize("how", ["step", "hf", "outside"])
@pytest.mark.parametrize("bad", [False, True])
def test_labels_that_are_the_ids_or_a_copy_take_one_path(world4, how, bad):
    out = world4.run(labels_identity_case, how=how, bad=bad, timeout=120)
    for rank, ((kind, msg), after) in enumerate(out):
        if not bad:
            assert kind is None, (kind, msg)
        elif rank == 2:
            assert kind == "BatchError" and " 97," in msg, (kind, msg)
        else:
            assert kind == "PeerError" and "BatchError" in msg and "rank 2" in msg, (kind, msg)
        assert after > 0


# -- batches a language model cannot read by their form ----------------------------------
FORMS = {
    "float_ids": (lambda x: {"input_ids": x.float()}, "input_ids is a torch.float32"),
    "bool_ids": (lambda x: {"input_ids": x > 50}, "input_ids is a torch.bool"),
    "ids_1d": (lambda x: {"input_ids": x[0]}, "unsqueeze(0)"),
    "ids_3d": (lambda x: {"input_ids": x[None]}, "reshape(-1, input_ids.shape[-1])"),
    "empty": (lambda x: {"input_ids": x[:, :0]}, "empty sequences"),
    "labels_shape": (lambda x: {"input_ids": x, "labels": x[:, :5]}, "one label per input position"),
    "labels_float": (lambda x: {"input_ids": x, "labels": x.float()}, "labels is a torch.float32"),
}


def batch_form_case(rank, world, layout):
    """Each malformed batch on every rank (step, and the model's own loss; one rank's batch
    of another dtype or shape is step's RankMismatchError); a good step after each, the
    ranks still in step. Then {inputs_embeds, labels}."""
    import meshlab as ml

    spec, mesh = _layout(layout, world)
    model = ml.parallelize(M.build("llama"), spec, mesh, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    good = _local(model, M.batches(1, batch=4)[0])
    out = {}
    for what, (make, _) in FORMS.items():
        b = make(good.clone())
        out[what, "step"] = _outcome(lambda: ml.step(model, opt, b))
        out[what, "hf"] = _outcome(lambda: model(**{**b, "labels": b.get(
            "labels", b["input_ids"])}).loss.backward())
        model.zero_grad()
        assert ml.step(model, opt, {"input_ids": good}) > 0
    emb = model.get_input_embeddings()(good).detach()
    out["embeds", "step"] = _outcome(lambda: ml.step(
        model, opt, {"inputs_embeds": emb, "labels": good}))
    return out


@pytest.mark.parametrize("layout", ["dp", "tp"])
def test_batches_of_another_form_are_batch_errors(world4, layout):
    """Float, bool, 1-D and 3-D ids, empty sequences, labels of another shape or dtype:
    raw torch errors deep in the model once (a reshape of 0 elements, an embedding's dtype
    check, a size mismatch); a {inputs_embeds, labels} batch: KeyError 'input_ids'."""
    for out in world4.run(batch_form_case, layout=layout, timeout=180):
        assert out.pop(("embeds", "step"))[0] is None
        for (what, api), (kind, msg) in out.items():
            assert kind == "BatchError" and FORMS[what][1] in msg, (what, api, kind, msg)
