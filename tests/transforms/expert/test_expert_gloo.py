"""``expert_route`` on real gloo ranks against the single-process model.

* Mixtral, Qwen2-MoE and DeepSeek-V3 (shared experts, MLA attention) at ep=2, ep=4 and
  ep=2 x dp=2 (plain data parallel and ZeRO-3): the loss of every step and the weights
  after three AdamW steps; with the router's load-balancing loss in the objective
  (``output_router_logits=True``), the aux loss itself equals the single process's on
  the whole batch.
* The exchanges: all-to-alls per step as ``plan.comm()`` counts them; the rows that
  leave each rank are exactly the (token, expert) pairs routed to another rank, there
  and back, forward and backward; dropless mode drops nothing, capacity mode counts its
  drops.
* Checkpoints saved on ep=2 x dp=2 load on ep=4 and on dp=4 without expert parallelism.
* Refusals agree between ``plan`` (fake mesh) and ``parallelize``.
"""

from __future__ import annotations

import os

import pytest
import torch

from meshlab.transforms.expert._install import ExpertPart

from tests import _models as M

pytestmark = pytest.mark.timeout(900)
LR = 1e-3
FAMILIES = ("mixtral", "qwen2_moe", "deepseek_v3")
# more families of the common experts layout, each shown at ep=2
MORE = ("qwen3_moe", "olmoe", "granitemoe", "glm4_moe", "gpt_oss")


def test_the_shown_families_are_the_tested_ones():
    from meshlab.transforms.expert import SHOWN

    assert SHOWN == frozenset(FAMILIES + MORE)


def _spec(layout: str):
    import meshlab as ml

    ep = ml.expert_route("ep")
    spec, mesh = {"ep2": (ep, dict(ep=2)), "ep4": (ep, dict(ep=4)),
                  "ep2_dp2": (ml.data_parallel("dp") | ep, dict(dp=2, ep=2)),
                  "ep2_zero3": (ml.zero_shard(3, "dp") | ep, dict(dp=2, ep=2)),
                  # the expert axis listed first: the data group spans (dp, ep) against the
                  # mesh's order (DeviceMesh's KeyError once)
                  "ep2_zero3_ep_first": (ep | ml.zero_shard(3), dict(ep=2, dp=2)),
                  "ep2_remat": (ep | ml.remat("full"), dict(ep=2)),
                  "ep2_bf16": (ml.precision("bf16") | ep, dict(ep=2)),
                  "ep2_tp2": (ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES)) | ep,
                              dict(ep=2, tp=2)),
                  # Megatron SP: each tp rank routes its own part of the sequence
                  "ep2_tp2_sp": (ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES)
                                          | ml.Rules(seq="tp")) | ep, dict(ep=2, tp=2)),
                  # no expert parallelism: the batch cut by data parallelism alone
                  "dp2": (ml.data_parallel("dp"), dict(dp=2)),
                  "zero3_dp2": (ml.zero_shard(3), dict(dp=2)),
                  # no expert parallelism: the experts replicated over tp, as the plan says
                  "tp2_dp2": (ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES)),
                              dict(dp=2, tp=2))}[layout]
    return spec, ml.Mesh(**mesh)


def _data_rank(model) -> tuple[int, int]:
    import torch.distributed as dist

    rt = model._meshlab
    return dist.get_rank(rt.dp_group), rt.dp_size


def _loss(model, family, x, aux: bool):
    if aux:
        out = model(input_ids=x, labels=x)
        return out.loss, out.aux_loss
    return M.loss_fn(family)(model(input_ids=x), {"input_ids": x, "labels": x}), None


def parity_case(rank, world, family, layout, aux=False, bf16=False):
    import torch.distributed as dist

    import meshlab as ml

    over = dict(output_router_logits=True) if aux else {}
    data = M.batches(3, batch=4)
    ref = ml.init_weights(M.build(family, **over), seed=0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    spec, mesh = _spec(layout)
    model = ml.parallelize(M.build(family, **over), spec, mesh, seed=0)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=LR)
    r, n = _data_rank(model)
    got, want, auxes = [], [], []
    for b in data:
        loss, a = _loss(model, family, b.chunk(n)[r], aux)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t, group=model._meshlab.dp_group)
        got.append(float(t) / n)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            want_loss, want_aux = _loss(ref, family, b, aux)
        want_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want.append(float(want_loss))
        if aux:
            auxes.append((float(a), float(want_aux)))
    M.assert_weights_match(model, ref, **(dict(atol=5e-3, rtol=5e-2) if bf16 else {}))
    part = model._meshlab.part(ExpertPart)
    return dict(got=got, want=want, aux=auxes, dropped=part.stats.dropped if part else 0,
                routed=part.stats.routed if part else None)


def _check(results):
    for res in results:
        torch.testing.assert_close(res["got"], res["want"], atol=1e-5, rtol=1e-4)
        for a, w in res["aux"]:
            assert abs(a - w) <= 1e-5 * max(1.0, abs(w)), res["aux"]
        assert res["dropped"] == 0 and (res["routed"] is None or res["routed"] > 0)


@pytest.mark.parametrize("family", FAMILIES + MORE)
def test_ep2_matches_one_process(world2, family):
    _check(world2.run(parity_case, family=family, layout="ep2"))


@pytest.mark.parametrize("family", FAMILIES)
def test_ep2_with_remat_matches_one_process(world2, family):
    _check(world2.run(parity_case, family=family, layout="ep2_remat"))


def test_ep2_under_bf16_matches_one_process_under_autocast(world2):
    # bf16 rounding differs with the order of operations: losses within 2e-2, weights
    # after three steps within 5e-3 (the updates are 1e-3 a step)
    for r in world2.run(parity_case, family="mixtral", layout="ep2_bf16", bf16=True):
        torch.testing.assert_close(r["got"], r["want"], atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("layout", ["ep2_tp2", "ep2_tp2_sp"])
def test_router_aux_loss_under_tensor_parallelism(world4, layout):
    """``model(input_ids, labels).loss`` under a vocabulary-parallel head is meshlab's loss
    plus the router's load-balancing term, as the family's forward adds it (it was left
    out: the router's gradients 8% off). Under Megatron SP the MoE block runs on each tp
    rank's part of the sequence: the router's and the experts' gradients are summed over
    tp, and the load-balancing loss is taken over every token (its group spans the tp
    ranks, its gradient scaled by their share)."""
    # Qwen2-MoE's shared expert is replicated over tp by its plan, and Megatron SP refuses
    # it by name (its gradient would be partial); Mixtral routes every MLP token
    for family in ("mixtral", "qwen2_moe") if layout == "ep2_tp2" else ("mixtral",):
        res = world4.run(parity_case, family=family, layout=layout, aux=True)
        _check(res)
        assert all(r["aux"] for r in res)


def test_router_aux_loss_is_the_whole_batch_loss(world2):
    for family in ("mixtral", "qwen2_moe"):
        res = world2.run(parity_case, family=family, layout="ep2", aux=True)
        _check(res)
        assert all(r["aux"] for r in res)


@pytest.mark.parametrize("layout", ["dp2", "zero3_dp2"])
def test_router_aux_loss_is_the_whole_batch_loss_without_expert_route(world2, layout):
    """Data parallelism or ZeRO alone cut the batch too: each rank took the router's
    load-balancing loss over its own half (weights after three steps 8e-3 off under
    data_parallel, no error); it is now taken over the whole batch there as well."""
    res = world2.run(parity_case, family="mixtral", layout=layout, aux=True)
    _check(res)
    assert all(r["aux"] for r in res)


def step_aux_case(rank, world, family, layout, microbatches=1):
    """``ml.step``'s default loss on a model that returns its router's logits: the
    causal-LM loss plus ``router_aux_loss_coef * aux_loss``, as the model's own loss of
    the whole batch (two SGD steps against one process's ``model(ids, labels=ids).loss``)."""
    import meshlab as ml

    over = dict(output_router_logits=True, router_aux_loss_coef=0.5)
    data = M.batches(2, batch=4)
    ref = ml.init_weights(M.build(family, **over), seed=0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    spec, mesh = _spec(layout)
    model = ml.parallelize(M.build(family, **over), spec, mesh, seed=0)
    opt = ml.optimizer(model, torch.optim.SGD, lr=0.1)
    r, n = _data_rank(model)
    got, want = [], []
    for b in data:
        try:
            got.append(ml.step(model, opt, {"input_ids": b.chunk(n)[r]},
                               microbatches=microbatches))
        except ml.MeshlabError as e:
            return type(e).__name__, str(e)
        out = ref(input_ids=b, labels=b)
        out.loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want.append(float(out.loss))
    M.assert_weights_match(model, ref, atol=1e-6, rtol=1e-5)
    return got, want


@pytest.mark.parametrize("layout", ["ep2", "dp2", "zero3_dp2"])
def test_step_default_loss_adds_the_router_aux_loss(world2, layout):
    """Before: ``ml.step``'s default loss was the causal-LM loss alone, where the model's
    own loss adds ``router_aux_loss_coef * aux_loss``: the router trained without its
    load-balancing term (weights 1e-2 off after one step), no error."""
    for got, want in world2.run(step_aux_case, family="mixtral", layout=layout):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_step_default_loss_with_the_router_aux_loss_refuses_microbatches(world2):
    for kind, msg in world2.run(step_aux_case, family="mixtral", layout="dp2",
                                microbatches=2):
        assert kind == "ConfigError", (kind, msg)
        assert "router's load-balancing loss" in msg and "microbatches=1" in msg, msg


@pytest.mark.parametrize("family,layout", [("mixtral", "ep4"), ("qwen2_moe", "ep4"),
                                           ("deepseek_v3", "ep4"),
                                           ("mixtral", "ep2_dp2"), ("deepseek_v3", "ep2_dp2"),
                                           ("qwen2_moe", "ep2_dp2"),
                                           ("qwen2_moe", "ep2_zero3"), ("mixtral", "ep2_zero3"),
                                           ("mixtral", "ep2_zero3_ep_first"),
                                           ("deepseek_v3", "ep2_zero3"),
                                           ("mixtral", "ep2_tp2"), ("qwen2_moe", "ep2_tp2"),
                                           ("deepseek_v3", "ep2_tp2"),
                                           ("mixtral", "tp2_dp2")])
def test_four_ranks_match_one_process(world4, family, layout):
    _check(world4.run(parity_case, family=family, layout=layout))


# -- the exchanges ------------------------------------------------------------------------
def exchange_case(rank, world, capacity=None):
    import meshlab as ml

    model = ml.parallelize(M.build("mixtral"), ml.expert_route("ep", capacity_factor=capacity),
                           ml.Mesh(ep=world), seed=0)
    part = model._meshlab.part(ExpertPart)
    x = M.batches(1, batch=4)[0].chunk(world)[rank]
    part.stats.reset()
    loss = M.loss_fn("mixtral")(model(input_ids=x), {"input_ids": x, "labels": x})
    loss.backward()
    plan_ops = model._meshlab.plan.comm(batch=x.shape[0], seq=x.shape[1])
    s = part.stats
    return dict(calls=s.all_to_all, rows=s.rows, away=s.away, bytes=s.bytes,
                routed=s.routed, dropped=s.dropped,
                planned_calls=plan_ops.ops[("all_to_all", "ep")][0])


def test_exchanges_move_exactly_the_pairs_routed_away(world4):
    res = world4.run(exchange_case)
    hidden = M.TINY["mixtral"]["hidden_size"]
    for r in res:
        assert r["calls"] == r["planned_calls"] == 5 * 2        # 2 MoE layers
        assert r["routed"] == 2 * 8 * 2                 # layers * local tokens * top-2
    # what leaves the ranks: each pair routed away goes there and back, forward and
    # backward (4 trips), and nothing else does
    assert sum(r["rows"] for r in res) == 4 * sum(r["away"]for r in res) > 0
    assert sum(r["bytes"] for r in res) == sum(r["rows"] for r in res) * hidden * 4


def test_capacity_counts_its_drops(world4):
    res = world4.run(exchange_case, capacity=0.5)
    assert sum(r["dropped"] for r in res) > 0
    assert all(0 <= r["dropped"] < r["routed"] for r in res)
    roomy = world4.run(exchange_case, capacity=8.0)             # room for every pair
    assert sum(r["dropped"] for r in roomy) == 0


# -- checkpoints across expert layouts ----------------------------------------------------
def save_case(rank, world, directory):
    import meshlab as ml

    spec, mesh = _spec("ep2_dp2")
    model = ml.parallelize(M.build("mixtral"), spec, mesh, seed=0)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=LR)
    r, n = _data_rank(model)
    x = M.batches(1, batch=4)[0].chunk(n)[r]
    M.loss_fn("mixtral")(model(input_ids=x), {"input_ids": x, "labels": x}).backward()
    opt.step()
    ml.checkpoint.save(os.path.join(directory, "ep2"), model, opt)
    return {k: M.full(p).detach().clone() for k, p in model.named_parameters()}


def load_case(rank, world, directory, layout):
    import meshlab as ml

    spec, mesh = (_spec("ep4") if layout == "ep4" else (ml.data_parallel("dp"), ml.Mesh(dp=4)))
    model = ml.parallelize(M.build("mixtral"), spec, mesh, seed=7)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=LR)
    ml.checkpoint.load(os.path.join(directory, "ep2"), model, opt)
    return {k: M.full(p).detach().clone() for k, p in model.named_parameters()}


def test_checkpoint_moves_between_expert_layouts(world4, tmp_path):
    saved = world4.run(save_case, directory=str(tmp_path))[0]
    for layout in ("ep4", "dp4"):
        for got in world4.run(load_case, directory=str(tmp_path), layout=layout):
            for k, v in saved.items():
                assert torch.equal(got[k], v), (layout, k)


# -- refusals -----------------------------------------------------------------------------
def refusal_case(rank, world):
    import meshlab as ml

    out = []
    for build, spec, mesh in _refused():
        try:
            ml.parallelize(build(), spec, mesh(False), seed=0)
            out.append(None)
        except ml.MeshlabError as e:
            out.append((type(e).__name__, str(e)))
    return out


def _refused():
    import meshlab as ml

    return [(lambda: M.build("llama"), ml.expert_route("ep"),
             lambda fake: ml.Mesh(ep=2, fake=fake)),
            (lambda: M.build("mixtral", num_local_experts=3), ml.expert_route("ep"),
             lambda fake: ml.Mesh(ep=2, fake=fake)),
            (lambda: M.build("mixtral"),     # a pair the composition table still refuses
             ml.expert_route("ep") | ml.precision("fp8") | ml.step_in_backward(),
             lambda fake: ml.Mesh(ep=2, fake=fake)),
            (lambda: M.build("phimoe"), ml.expert_route("ep"),
             lambda fake: ml.Mesh(ep=2, fake=fake)),
]


def test_refusals_agree_with_plan(world2):
    import meshlab as ml

    got = world2.run(refusal_case)[0]
    for (build, spec, mesh), g in zip(_refused(), got):
        with pytest.raises(ml.MeshlabError) as e:
            p = ml.plan(build(), spec, mesh(True))
            if p.not_runnable:
                raise ml.ConfigError(p.not_runnable[0])
        assert g is not None and g[1] == str(e.value), (g, str(e.value))


def test_every_layer_keeps_the_familys_implementation():
    """Each experts module runs its local experts through what the model used before
    (its modules share one config object, which now names the dispatching one)."""
    import torch.distributed as dist

    import meshlab as ml

    from tests._world import _free_port

    assert not dist.is_initialized()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = M.build("mixtral")
        model.config._experts_implementation = "grouped_mm"
        model = ml.parallelize(model, ml.expert_route("ep"), ml.Mesh(ep=1), seed=0)
        impls = [m._meshlab_ep.impl for m in model.modules() if hasattr(m, "_meshlab_ep")]
        # one rank holds every expert: the family's own path runs, bit for bit, with no
        # exchange
        ref = ml.init_weights(M.build("mixtral"), seed=0)
        ref.config._experts_implementation = "grouped_mm"
        ids = M.batches(1, batch=2)[0]
        states = [m._meshlab_ep for m in model.modules() if hasattr(m, "_meshlab_ep")]
        for s in states:
            s.stats.reset()
        out, want = model(input_ids=ids).logits, ref(input_ids=ids).logits
        out.sum().backward()
        want.sum().backward()
    finally:
        dist.destroy_process_group()
    assert impls == ["grouped_mm"] * 2
    assert torch.equal(out, want)
    grads = dict(ref.named_parameters())
    bad = [n for n, p in model.named_parameters() if not torch.equal(p.grad, grads[n].grad)]
    assert not bad, bad
    # the layers keep one record: 2 layers x top-2 pairs of every token
    assert all(s.stats.all_to_all == 0 and s.stats.routed == ids.numel() * 2 * 2
               for s in states), [s.stats for s in states]


def capacity_parity_case(rank, world, family, factor):
    """Capacity mode against one process that applies the same rule: each rank's tokens
    through experts that keep at most ``capacity`` pairs per expert (the same
    implementation on a one-rank group), losses averaged over the chunks."""
    import torch.distributed as dist

    import meshlab as ml
    from meshlab.transforms.expert._dispatch import IMPL, EPState, EPStats, ep_experts_forward
    from meshlab.transforms.expert._install import _interface

    alone = [dist.new_group([r]) for r in range(world)][rank]
    data = M.batches(3, batch=4)
    ref = ml.init_weights(M.build(family), seed=0)
    _interface().register(IMPL, ep_experts_forward)
    stats = EPStats()
    prev = ref.config._experts_implementation
    for m in ref.modules():
        if hasattr(type(m), "_apply_gate"):
            m._meshlab_ep = EPState(alone, 1, 0, prev, factor, stats)
    ref.config._experts_implementation = IMPL
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    model = ml.parallelize(M.build(family), ml.expert_route("ep", capacity_factor=factor),
                           ml.Mesh(ep=world), seed=0)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=LR)
    part = model._meshlab.part(ExpertPart)
    got, want = [], []
    for b in data:
        chunks = b.chunk(world)
        loss = M.loss_fn(family)(model(input_ids=chunks[rank]),
                                 {"input_ids": chunks[rank], "labels": chunks[rank]})
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        got.append(float(t) / world)
        ref_loss = sum(M.loss_fn(family)(ref(input_ids=c), {"input_ids": c, "labels": c})
                       for c in chunks) / world
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want.append(float(ref_loss))
    M.assert_weights_match(model, ref)
    return dict(got=got, want=want, dropped=part.stats.dropped, ref_dropped=stats.dropped)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_capacity_matches_one_process_with_the_same_drops(world2, family):
    res = world2.run(capacity_parity_case, family=family, factor=0.75)
    for r in res:
        torch.testing.assert_close(r["got"], r["want"], atol=1e-5, rtol=1e-4)
    # the ranks together drop exactly what the one process drops over all the chunks
    assert sum(r["dropped"] for r in res) > 0
    assert sum(r["dropped"] for r in res) == res[0]["ref_dropped"]


def pipeline_case(rank, world, family, schedule):
    """pp=2 x ep=2: each stage's experts sharded over its ep ranks, the schedule's
    microbatches dispatched within them, against the single-process model."""
    import torch.distributed as dist

    import meshlab as ml

    layers = dict(num_hidden_layers=4)
    data = M.batches(3, batch=8)
    ref, ref_losses, _ = M.reference(family, data, LR, **layers)
    spec = ml.pipeline("pp", schedule=schedule, microbatches=2) | ml.expert_route("ep")
    model = ml.parallelize(M.build(family, **layers), spec, ml.Mesh(pp=2, ep=2), seed=0)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=LR)
    rt = model._meshlab
    r = dist.get_rank(rt.dp_group)
    losses = [ml.step(model, opt, {"input_ids": b.chunk(rt.dp_size)[r]}) for b in data]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                               atol=1e-5, rtol=1e-3)
    return sorted(M.assert_weights_match(model, ref))


@pytest.mark.parametrize("family,schedule", [("mixtral", "1f1b"), ("qwen2_moe", "gpipe"),
                                             ("deepseek_v3", "1f1b")])
def test_pipeline_with_expert_parallelism(world4, family, schedule):
    owned = world4.run(pipeline_case, family=family, schedule=schedule)
    assert owned[0] != owned[2] and owned[0] == owned[1]       # pp stages hold different layers


def empty_rank_case(rank, world, layout):
    """Every token routed to expert 0 (the post-attention norms zeroed: all router logits
    0, top-1 the first expert), which lives on ep rank 0: rank 1 receives no row. The
    experts' "eager" implementation loops over the experts hit, so on rank 1 it never
    read the exchanged rows, the exchanges fell out of that rank's graph, and its
    backward skipped their all-to-alls while rank 0 waited in them (a hang); its own
    tokens, sent to rank 0, got no gradient through the experts. One SGD step in float64
    against one process."""
    import meshlab as ml

    def build():
        m = M.build("mixtral", num_experts_per_tok=1).to(torch.float64)
        m.config._experts_implementation = "eager"
        return m

    def zero_norms(m):
        with torch.no_grad():
            for layer in m.model.layers:
                layer.post_attention_layernorm.weight.zero_()

    x = M.batches(1, batch=4)[0]
    ref = ml.init_weights(build(), seed=0)
    zero_norms(ref)
    ref(input_ids=x, labels=x).loss.backward()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    spec, mesh = _spec(layout)
    model = ml.parallelize(build(), spec, mesh, seed=0)
    zero_norms(model)
    r, n = _data_rank(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(input_ids=x.chunk(n)[r], labels=x.chunk(n)[r]).loss.backward()
    opt.step()
    M.assert_weights_match(model, ref, atol=1e-12, rtol=1e-12)
    return model._meshlab.part(ExpertPart).stats.routed


@pytest.mark.timeout(120)
def test_a_rank_that_receives_no_rows_trains_as_one_process(world2):
    assert all(routed > 0 for routed in world2.run(empty_rank_case, layout="ep2",
                                                     timeout=90))


def masked_aux_case(rank, world, layout):
    """The router's load-balancing loss of a padded batch (its attention mask counts only
    real tokens): under Megatron SP each tp rank routes its own part of every row's
    sequence, so its part of the mask is the one that counts (the whole mask met a
    quarter of the rows there: an untyped RuntimeError). Two AdamW steps against one
    process: the aux loss and the weights."""
    import meshlab as ml

    over = dict(output_router_logits=True)
    ref = ml.init_weights(M.build("mixtral", **over), seed=0)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    spec, mesh = _spec(layout)
    model = ml.parallelize(M.build("mixtral", **over), spec, mesh, seed=0)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=LR)
    r, n = _data_rank(model)
    auxes = []
    for b in M.batches(2, batch=4):
        mask = torch.ones_like(b)
        mask[1, :3] = 0                      # left padding in one row
        mask[2, :1] = 0
        out = model(input_ids=b.chunk(n)[r], attention_mask=mask.chunk(n)[r],
                    labels=b.chunk(n)[r])
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        want = ref(input_ids=b, attention_mask=mask, labels=b)
        want.loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        auxes.append((float(out.aux_loss), float(want.aux_loss)))
    M.assert_weights_match(model, ref)
    return auxes


@pytest.mark.parametrize("layout", ["ep2_tp2_sp", "ep2_tp2"])
def test_router_aux_loss_of_a_padded_batch_under_sequence_parallelism(world4, layout):
    for auxes in world4.run(masked_aux_case, layout=layout):
        for a, w in auxes:
            assert abs(a - w) <= 1e-5 * max(1.0, abs(w)), auxes
