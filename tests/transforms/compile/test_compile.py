"""compile_blocks(): every repeated block under torch.compile with fullgraph=True.

Two gloo processes: a fused tiny Llama with its blocks compiled (with
remat, and under ZeRO-3) trains to the eager model's losses and weights, with no graph
break (counted by dynamo) and one compiled graph per block; the blocks of a hand-written
decoder sharded by specs alone (DTensor mode) compile whole too; the compositions not yet
shown are refused by name."""

from __future__ import annotations

import pytest
import torch

from tests import _models as M

pytestmark = pytest.mark.timeout(900)


def _train(spec, mesh, steps=3):
    import meshlab as ml
    from meshlab.policies import presets

    model = ml.parallelize(presets.build("tiny-llama"), spec, mesh, seed=0)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    rt = model._meshlab
    ids = torch.randint(0, 256, (2 * rt.dp_size, 32), generator=g)
    dp_rank = rt.mesh.coordinate(rt.mesh.rank).get("dp", 0) if rt.dp_size > 1 else 0
    mine = ids.chunk(rt.dp_size)[dp_rank]
    losses = [ml.step(model, opt, {"input_ids": mine}) for _ in range(steps)]
    return model, losses


def compiled_case(rank, world, extra):
    import torch._dynamo
    from torch._dynamo.utils import counters

    import meshlab as ml

    spec = {"remat": ml.fuse() | ml.remat("full") | ml.data_parallel("dp"),
            "zero3": ml.fuse() | ml.zero_shard(3, "dp"),
            "zero3_remat": ml.fuse() | ml.remat("full") | ml.zero_shard(3, "dp")}[extra]
    mesh = ml.Mesh(dp=world)
    torch._dynamo.reset()
    counters.clear()
    _, eager = _train(spec, mesh)
    model, compiled = _train(spec | ml.compile_blocks(), mesh)
    breaks = sum(counters["graph_break"].values())
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), atol=2e-5, rtol=1e-5)
    blocks = [m for n, m in model.named_modules() if n.startswith("model.layers.")
              and n.count(".") == 2]
    assert blocks and all(getattr(m, "_compiled_call_impl", None) is not None for m in blocks)
    return {"breaks": breaks, "losses": compiled}


@pytest.mark.parametrize("extra", ["remat", "zero3", "zero3_remat"])
def test_compiled_blocks_gloo(world2, extra):
    out = world2.run(compiled_case, extra=extra)
    assert all(o["breaks"] == 0 for o in out)


def dtensor_case(rank, world, sp, backend):
    """The hand-written decoder of tests/_models.py sharded by specs alone (DTensor mode:
    its own forward on DTensors), trained 3 AdamW steps eagerly and with compile_blocks()
    in the spec (fullgraph): the same losses and weights, no graph break. A model whose
    policy runs tensor-parallel regions stays refused with compile_blocks()."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import meshlab as ml
    from meshlab import P
    from meshlab.transforms.shard._layout import tp_layout

    spec = ml.shard({k: P(*v) for k, v in M.HAND_SPECS.items()}, ml.Rules(**M.HAND_RULES))
    mesh = ml.Mesh(dp=1, tp=world)
    data = M.batches(3, batch=4, seq=8, vocab=M.HAND["vocab"])
    torch._dynamo.reset()
    counters.clear()
    runs = {}
    for compiled in (False, True):
        extra = ml.compile_blocks(backend=backend) if compiled else None
        model = ml.parallelize(M.build_hand(sp=sp), spec | extra if extra else spec, mesh,
                               seed=0)
        opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-2)
        losses = []
        for b in data:
            loss = M.hand_loss(model(b), b)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs[compiled] = (model, losses)
    (eager, e_losses), (compiled, c_losses) = runs[False], runs[True]
    assert tp_layout(compiled._meshlab.plan, 0)[0].dtensor
    assert all(hasattr(b, "_compiled_call_impl") and b._compiled_call_impl is not None
               for b in compiled.blocks)
    torch.testing.assert_close(torch.tensor(c_losses), torch.tensor(e_losses), atol=2e-5,
                               rtol=1e-5)
    M.assert_weights_match(compiled, eager, atol=2e-5, rtol=1e-4)
    return {"breaks": sum(counters["graph_break"].values()),
            "graphs": counters["stats"]["unique_graphs"], "losses": c_losses}


@pytest.mark.parametrize("sp,backend", [(False, "inductor"), (True, "aot_eager")],
                         ids=["tp", "tp_sp"])
def test_blocks_compile_in_dtensor_mode_gloo(world2, sp, backend):
    """Specs without policy regions run the model's own forward on DTensors; with
    compile_blocks() its blocks trace whole (the block wrapper and the mode that reads
    plain tensors as replicated run under dynamo) and train like the eager run, with
    sequence parallelism written in the model (constrain between blocks) too."""
    out = world2.run(dtensor_case, sp=sp, backend=backend)
    assert all(o["breaks"] == 0 and o["graphs"] >= 1 for o in out), out
    assert all(o["losses"] == out[0]["losses"] for o in out)


def test_refused_compositions():
    import meshlab as ml

    with torch.device("meta"):
        model = M.build("llama")
    assert ml.plan(model, ml.pipeline("pp", microbatches=2) | ml.compile_blocks(),
                   ml.Mesh(pp=2, fake=True)).runnable
    tp = ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES)) | ml.sequence("tp", "split_gather")
    assert ml.plan(model, tp | ml.compile_blocks(), ml.Mesh(tp=2, fake=True)).runnable
    with torch.device("meta"):
        drops = M.build("llama", attention_dropout=0.1)
    assert ml.plan(drops, tp, ml.Mesh(tp=2, fake=True)).runnable
    with pytest.raises(ml.ConfigError, match="model that drops.*compiled block cannot trace"):
        ml.plan(drops, tp | ml.compile_blocks(), ml.Mesh(tp=2, fake=True))
    with pytest.raises(ml.ConfigError, match="mode"):
        ml.compile_blocks(mode="fastest")
    with pytest.raises(ml.ConfigError, match="modes are inductor's"):
        ml.compile_blocks(mode="reduce-overhead", backend="aot_eager")


def test_models_compiled_one_after_another_in_one_process(one_process):
    """Three 5-block models compiled in turn in one process (a notebook cell run again):
    dynamo keeps every block's cache entry, so the third model's blocks must still fit
    under the recompile limit, or fullgraph makes its first forward an error."""
    import meshlab as ml
    from meshlab.policies import presets

    torch._dynamo.reset()
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        model = ml.parallelize(presets.build("tiny-llama", num_hidden_layers=5),
                               ml.compile_blocks(backend="eager"), ml.Mesh(dp=1), seed=0)
        model(input_ids=ids).logits.sum().backward()
    assert torch._dynamo.config.recompile_limit >= 15 + 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_blocks_on_cuda_without_graph_breaks(one_process):
    """On CUDA (cuDNN attention, Triton kernels) every fused block compiles as one graph and
    trains to the eager model's losses within bf16 rounding."""
    import transformers

    import meshlab as ml

    cfg = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, use_cache=False,
                                   tie_word_embeddings=False)
    ids = torch.randint(0, 1024, (4, 128), generator=torch.Generator().manual_seed(0)).cuda()

    def train(spec) -> list[float]:
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        model = ml.parallelize(model, spec, ml.Mesh(dp=1))
        opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-3)
        return [ml.step(model, opt, {"input_ids": ids}) for _ in range(4)]

    from torch._dynamo.utils import counters

    eager = train(ml.fuse())
    compiled = train(ml.fuse() | ml.compile_blocks())
    assert eager[-1] < eager[0] - 0.5
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), atol=5e-3, rtol=0)
    # CUDA graphs of every block's forward and backward: recorded, none skipped, and the
    # same losses over steps that replay them.
    counters.clear()
    graphs = train(ml.fuse() | ml.compile_blocks(mode="reduce-overhead"))
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    from torch._inductor.cudagraph_trees import get_manager

    manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    recorded = next(manager.graph_counter) if manager is not None else 0
    assert recorded >= 2 * cfg.num_hidden_layers, recorded      # forward and backward each
    torch.testing.assert_close(torch.tensor(graphs), torch.tensor(eager), atol=5e-3, rtol=0)


def test_fused_checkpointed_blocks_compile_first_in_a_process(one_process):
    """fuse() | remat | compile_blocks() compiled before anything ran eagerly in the process
    (a fresh process): the rotary routing reads no run-time state, so dynamo traces the
    checkpointed blocks whole (a depth counter the routing kept was a side effect
    torch.utils.checkpoint's higher-order op refused), and they train as the eager run."""
    import threading

    import torch._dynamo

    import meshlab as ml
    from meshlab.transforms.fuse import _rotary

    torch._dynamo.reset()
    _rotary._ROUTED = threading.local()           # as in a process that ran nothing yet
    spec = ml.fuse() | ml.remat("full")
    _, compiled = _train(spec | ml.compile_blocks(backend="aot_eager"), ml.Mesh(dp=1))
    _, eager = _train(spec, ml.Mesh(dp=1))
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), atol=2e-5, rtol=1e-5)


def test_compiled_blocks_compute_the_shared_input_products(one_process):
    """A compiled block's query projection computes the key and value products with its
    own (fuse's ``_SharedInput``: the input-gradient sums inside the products), traced into
    the block's graph as it runs eagerly; a checkpointed compiled block's projections run
    their own products (a side effect dynamo refuses inside checkpointing's higher-order
    op), and both train as the eager model."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import meshlab as ml

    graphs = []

    def backend(gm, example_inputs):
        graphs.append([getattr(n.target, "__name__", "") for n in gm.graph.nodes
                       if n.op == "call_function"])
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    if "meshlab_graphs_seen" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(backend, name="meshlab_graphs_seen")
    else:   # registered by an earlier run in this process: record into this run's list
        torch._dynamo.backends.registry._COMPILER_FNS["meshlab_graphs_seen"] = backend

    torch._dynamo.reset()
    counters.clear()
    # (spec, blocks whose graph holds the products): a block's graph (a checkpointed
    # block's outer graph holds none: its body is the higher-order op's) calls three
    # autograd functions where the products are shared: the first norm's fork (the residual
    # gradient added in the norm's backward), the gated MLP's and theirs
    for spec, shared in ((ml.fuse(), 2), (ml.fuse() | ml.remat("full", count=1), 1)):
        _, eager = _train(spec, ml.Mesh(dp=1), steps=2)
        graphs.clear()
        model, compiled = _train(spec | ml.compile_blocks(backend="meshlab_graphs_seen"),
                                 ml.Mesh(dp=1),
                                 steps=2)
        assert len(graphs) == 2
        assert sum(g.count("autograd_function_apply") for g in graphs) == 3 * shared, spec
        torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), atol=2e-5,
                                   rtol=1e-5)
        kept = ["forward" in vars(layer.self_attn.k_proj) for layer in model.model.layers]
        assert sum(kept) == shared
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_a_block_with_eager_modules_is_compiled_around_them():
    """compile_blocks compiles a block whole, or, where another room runs some of its
    modules eagerly (the expert dispatch), each child that holds none of them."""
    from meshlab.transforms.compile import compiled_units

    with torch.device("meta"):
        model = M.build("qwen3_moe")
    mods = dict(model.named_modules())
    block = "model.layers.0"
    experts = next(n for n in mods if n.startswith(f"{block}.") and n.endswith(".experts"))
    units = compiled_units(block, mods, frozenset({experts}))
    assert experts not in units and block not in units
    assert f"{block}.self_attn" in units and experts.rsplit(".", 1)[0] + ".gate" in units
    assert not any(u.startswith(experts) for u in units)
    assert compiled_units("model.layers.1", mods, frozenset({experts})) == ["model.layers.1"]


@pytest.mark.slow
def test_experts_on_one_rank_compile_with_their_block(one_process):
    """expert_route over a one-rank axis runs the family's own expert path (no exchange,
    no host read of split sizes), so compile_blocks compiles each block whole, experts
    included, and it trains as the eager run (aot_eager: the same ops). The blocks compile
    in the first steps only: the routed-pairs count is a tensor the graph adds to (as a
    Python int it was a constant dynamo guarded on, and every step compiled every block
    again until the recompile limit failed the step), and it still counts every pair."""
    import torch._dynamo.utils

    import meshlab as ml
    from meshlab.transforms.expert._install import ExpertPart

    graphs = torch._dynamo.utils.counters["stats"]

    def train(spec, steps=5):
        model = ml.parallelize(M.build("mixtral"), spec, ml.Mesh(ep=1), seed=0)
        opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-2)
        ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
        losses, compiled_by_step = [], []
        for _ in range(steps):
            before = graphs["unique_graphs"]
            losses.append(ml.step(model, opt, {"input_ids": ids}))
            compiled_by_step.append(graphs["unique_graphs"] - before)
        return model, losses, compiled_by_step

    model, compiled, frames_by_step = train(ml.expert_route("ep")
                                            | ml.compile_blocks(backend="aot_eager"))
    layers = model.model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert frames_by_step[0] > 0 and frames_by_step[2:] == [0, 0, 0], frames_by_step
    stats = next(p for p in model._meshlab.parts if isinstance(p, ExpertPart)).stats
    k = model.config.num_experts_per_tok
    assert stats.routed == 5 * len(layers) * 2 * 16 * k, stats.routed
    _, eager, _ = train(ml.expert_route("ep"))
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), atol=1e-5, rtol=0)


def test_inductor_options_add_to_the_mode(one_process, monkeypatch):
    """``options`` are inductor's configuration on top of the mode's own (torch.compile
    takes one or the other): each block is compiled with the two merged and no ``mode``;
    a name inductor lacks, or options for another backend, are refused when the plan is
    made."""
    import meshlab as ml
    from meshlab.policies import presets

    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: seen.append(kw))
    ml.parallelize(presets.build("tiny-llama", num_hidden_layers=2),
                   ml.fuse() | ml.compile_blocks(mode="reduce-overhead",
                                                 options={"force_pointwise_cat": True}),
                   ml.Mesh(dp=1), seed=0)
    assert seen == [{"fullgraph": True, "dynamic": False, "backend": "inductor",
                     "options": {"triton.cudagraphs": True, "force_pointwise_cat": True}}] * 2
    seen.clear()
    ml.parallelize(presets.build("tiny-llama", num_hidden_layers=2), ml.compile_blocks(),
                   ml.Mesh(dp=1), seed=0)
    assert [kw.get("options") for kw in seen] == [None, None]

    c = ml.compile_blocks(options={"force_pointwise_cat": True, "max_autotune": False})
    assert c.options == (("force_pointwise_cat", True), ("max_autotune", False))
    assert hash(c) == hash(ml.compile_blocks(options={"max_autotune": False,
                                                      "force_pointwise_cat": True}))
    with pytest.raises(ml.ConfigError, match=r"\['force_pointwise_concat'\] not in "
                                             r"torch._inductor.config"):
        ml.compile_blocks(options={"force_pointwise_concat": True})
    with pytest.raises(ml.ConfigError, match="options are inductor's"):
        ml.compile_blocks(options={"force_pointwise_cat": True}, backend="aot_eager")
    with pytest.raises(ml.ConfigError, match="a dict of inductor's"):
        ml.compile_blocks(options=["force_pointwise_cat"])
