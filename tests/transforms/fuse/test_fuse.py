"""fuse(): Hugging Face models' RMSNorm, rotary, attention, gated MLP and loss on meshlab's ops.

One process: the routed model's loss and gradients equal the unrouted one's for several
families; other models are untouched; probes refuse modules whose math differs; families
that transform their logits are refused for the loss; ``plan`` refuses, word for word, what
the install refuses (an op with nothing to route, a probe that disagrees), changing nothing.
Two gloo processes: fuse() composed with ZeRO-1, ZeRO-3 and tensor parallelism trains to the
single-process weights, and ``parallelize`` refuses what ``plan`` refuses."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from tests import _models as M

pytestmark = pytest.mark.timeout(600)

OPS = ("rms_norm", "rotary", "attention", "mlp", "loss")


def _model(family: str, **overrides):
    import meshlab as ml

    return ml.init_weights(M.build(family, **overrides), seed=0)


# Gemma: norms scaling by 1 + weight (their layers keep their own residual adds), a
# tanh-GELU gate; Phi-3: one gate_up_proj whose output's halves are gated in place.
_GATED = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=8), "geglu",
              {"rms_norm": 5, "rotary": 2, "attention": 1, "mlp": 2, "loss": 1}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0), "swiglu",
             {"rms_norm": 5, "rotary": 2, "attention": 1, "mlp": 2, "loss": 1,
              "residual_add": 2}),
}


@pytest.mark.parametrize("family", sorted(_GATED))
def test_gated_mlp_layouts_fuse(family):
    """Every op of fuse() routes in Gemma (its MLP on ``meshlab::geglu``) and Phi-3 (its
    merged gate/up product gated on ``meshlab::swiglu``), and the loss and every gradient
    equal the model's own."""
    import transformers

    import meshlab as ml
    from meshlab.ops import _build
    from meshlab.transforms.fuse import causal_lm_loss, fuse_model

    config, cls, extra, gate, counts = _GATED[family]
    cfg = getattr(transformers, config)(vocab_size=64, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, **extra)
    with torch.device("meta"):
        ref = getattr(transformers, cls)(cfg)
    ref = ml.init_weights(ref, seed=0)
    model = copy.deepcopy(ref)
    assert fuse_model(model).counts() == counts
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    want = ml.losses.causal_lm_loss(ref(input_ids=ids), batch)
    want.backward()
    _build.LAST_PATH.clear()
    got = causal_lm_loss(model, batch)
    got.backward()
    assert (gate, "cpu") in _build.LAST_PATH
    torch.testing.assert_close(got, want)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_residual_add_fuses_only_the_layers_its_probe_proves():
    """A decoder layer that scales its residual branch (Granite's residual_multiplier) has
    Llama's parts but other math: its probe says so and it keeps its own forward, its
    norms routed; a layer wrapped by another room (an instance forward) is left alone."""
    import transformers

    from meshlab.transforms.fuse import fuse_model

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)
    granite = transformers.GraniteForCausalLM(transformers.GraniteConfig(
        **small, residual_multiplier=0.5))
    ref = copy.deepcopy(granite)
    report = fuse_model(granite, ("rms_norm",))
    assert report.counts() == {"rms_norm": 5}
    assert "not norm, attention, add" in report.unfused["GraniteDecoderLayer"]
    ids = torch.randint(0, 64, (2, 7))
    torch.testing.assert_close(granite(input_ids=ids).logits, ref(input_ids=ids).logits)

    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small))
    wrapped = llama.model.layers[0]
    wrapped.forward = wrapped.forward            # as tensor parallelism's wrapper would sit
    state = torch.random.get_rng_state()
    report = fuse_model(llama, ("rms_norm",))
    assert torch.equal(torch.random.get_rng_state(), state)    # the probe draws on its own
    assert report.routed["residual_add"] == ["model.layers.1"]
    assert fuse_model(llama, ("rms_norm",)).counts() == report.counts()     # no doubles


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_fused_equals_unfused(family):
    import meshlab as ml
    from meshlab.ops import _build
    from meshlab.transforms.fuse import causal_lm_loss, fuse_model as fuse

    ref = _model(family)
    model = copy.deepcopy(ref)
    report = fuse(model, OPS)
    layers = M.TINY[family]["num_hidden_layers"]
    norms = 2 * layers + 1 + (2 * layers if family == "qwen3" else 0)   # + q/k norms
    assert report.counts() == {"rms_norm": norms, "rotary": layers, "attention": 1,
                               "mlp": layers, "loss": 1, "residual_add": layers}
    assert report.unfused == {}
    ids = M.batches(1, batch=3, seq=11)[0]
    ids[0, :3] = -100                      # ignored labels pass through
    batch = {"input_ids": ids.clamp_min(0), "labels": ids}
    want = ml.losses.causal_lm_loss(ref(input_ids=batch["input_ids"]), batch)
    want.backward()
    _build.LAST_PATH.clear()
    got = causal_lm_loss(model, batch)
    got.backward()
    for op in ("rms_norm", "rotary", "attention", "swiglu", "linear_cross_entropy"):
        assert (op, "cpu") in _build.LAST_PATH, op          # each routed op actually ran
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    refp = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, refp[n].grad, atol=1e-6, rtol=1e-4,
                                   msg=lambda m, n=n: f"grad of {n}: {m}")
    # Outside fused_labels the head is the plain projection: logits as before.
    torch.testing.assert_close(model(input_ids=batch["input_ids"]).logits,
                               ref(input_ids=batch["input_ids"]).logits, atol=1e-5, rtol=1e-5)


def test_causal_lm_loss_reads_labels_beside_inputs_embeds_and_refuses_a_padding_read():
    """``causal_lm_loss`` on a batch of ``inputs_embeds`` and ``labels`` raised a bare
    KeyError ('input_ids'); on a left-padded batch labelled -100 at the padding (the usual
    transformers labelling), the first real token's label was predicted from the last
    padding token's output, which meshlab's attention computes otherwise: the loss 2.3e-3
    off transformers', no error (``ml.step`` refused it; this function did not)."""
    import meshlab as ml
    from meshlab.transforms.fuse import causal_lm_loss, fuse_model

    ref = _model("llama")
    model = copy.deepcopy(ref)
    fuse_model(model, OPS)
    ids = M.batches(1, batch=2, seq=9)[0]
    embeds = ref.get_input_embeddings()(ids).detach()
    want = ml.losses.causal_lm_loss(ref(inputs_embeds=embeds), {"labels": ids})
    got = causal_lm_loss(model, {"inputs_embeds": embeds, "labels": ids})
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    with pytest.raises(ml.ConfigError, match="neither 'labels' nor 'input_ids'"):
        causal_lm_loss(model, {"inputs_embeds": embeds})
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    with pytest.raises(ml.ConfigError, match="causal_lm_loss: row 1 .* column 3 .*"
                                             "after a padding token"):
        causal_lm_loss(model, {"input_ids": ids, "attention_mask": mask, "labels": labels})
    labels[1, 3] = -100                # the first real token unlabelled: as one process
    want = ml.losses.causal_lm_loss(ref(input_ids=ids, attention_mask=mask), {"labels": labels})
    got = causal_lm_loss(model, {"input_ids": ids, "attention_mask": mask, "labels": labels})
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def _full_width_adds(model, batch) -> int:
    """The (batch, seq, hidden) adds one forward and backward of ``model`` runs outside
    meshlab's kernels (autograd's accumulations included)."""
    from meshlab.transforms.fuse import causal_lm_loss

    shape = [*batch["input_ids"].shape, model.config.hidden_size]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                record_shapes=True) as prof:
        causal_lm_loss(model, batch).backward()
    return sum(1 for e in prof.events() if e.name in ("aten::add", "aten::add_")
               and e.input_shapes and list(e.input_shapes[0]) == shape)


def test_a_deep_copy_of_a_fused_model_computes_with_its_own_weights():
    """copy.deepcopy of a fused Llama (an EMA copy, a reference model) gets hand-offs of its
    own: its query projection computes its own key and value products, so a copy whose
    weights change computes with them (the copy once computed with the original's)."""
    import meshlab as ml
    from meshlab.transforms.fuse import fuse_model as fuse

    ref = _model("llama")
    model = copy.deepcopy(ref)
    fuse(model, OPS)
    twin, twin_ref = copy.deepcopy(model), copy.deepcopy(ref)
    with torch.no_grad():
        for t in (twin, twin_ref):
            for p in t.parameters():
                p.mul_(0.5)
    ids = M.batches(1, batch=2, seq=9)[0]
    for got, want in ((twin, twin_ref), (model, ref)):
        torch.testing.assert_close(got(input_ids=ids).logits, want(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-4)
        want_loss = ml.losses.causal_lm_loss(want(input_ids=ids), {"input_ids": ids})
        got_loss = ml.losses.causal_lm_loss(got(input_ids=ids), {"input_ids": ids})
        want_loss.backward()
        got_loss.backward()
        for (n, a), b in zip(got.named_parameters(), want.parameters()):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=n)


def test_layer_sums_run_inside_norms_and_products():
    """A routed Llama layer adds its residual stream's gradient inside the first norm's
    backward, sums its query/key/value input gradient inside the products and adds the
    residual stream inside the MLP's down product: of the six full-width adds a layer's
    own forward and its backward run on routed norms (two residual adds, the
    input-gradient sums of the three projections, the residual stream's gradient at the
    layer's two norms), none is left. The query
    projection computes the three products for whatever input it is handed, so an attention
    that changes its input first keeps them, with the same gradients."""
    import meshlab as ml
    from meshlab.transforms.fuse import causal_lm_loss, fuse_model as fuse

    ref = _model("llama")
    layers = M.TINY["llama"]["num_hidden_layers"]
    ids = M.batches(1, batch=2, seq=9)[0]
    batch = {"input_ids": ids, "labels": ids}
    model = copy.deepcopy(ref)
    fuse(model, OPS)
    routed = [m for layer in model.model.layers for m in (
        layer, layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)]
    own = [m.__dict__.pop("forward") for m in routed]
    assert _full_width_adds(model, batch) == 6 * layers      # the modules' own forwards
    for m, forward in zip(routed, own):
        m.forward = forward
    assert _full_width_adds(model, batch) == 0

    for layer in model.model.layers:
        attn_forward = layer.self_attn.forward
        layer.self_attn.forward = lambda hidden_states, f=attn_forward, **kw: f(
            hidden_states=hidden_states * 1.0, **kw)
    for m in (model, ref):
        for p in m.parameters():
            p.grad = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _full_width_adds(model, batch) == 0
    want = ml.losses.causal_lm_loss(ref(input_ids=ids), batch)
    want.backward()
    for p in model.parameters():
        p.grad = None
    got = causal_lm_loss(model, batch)
    got.backward()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    refp = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, refp[n].grad, atol=1e-6, rtol=1e-4,
                                   msg=lambda m, n=n: f"grad of {n}: {m}")


def test_projections_called_on_other_inputs_run_their_own_products(monkeypatch):
    """A key or value projection called on another input than the query projection's runs
    its own product (its output is that input's), with a warning, and the layer's
    projections stop computing ahead; one called before the query projection runs its own
    product too."""
    import importlib

    from meshlab.transforms.fuse import fuse_model as fuse

    shared = importlib.import_module("meshlab.transforms.fuse._residual")._SharedInput
    calls = []
    apply = shared.apply
    monkeypatch.setattr(shared, "apply", lambda *a: calls.append(1) or apply(*a))
    model = _model("llama")
    fuse(model, OPS)
    calls.clear()                                      # the layer's probe ran it too
    attn = model.model.layers[0].self_attn
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(2, 3, q.in_features, generator=g) for _ in "xy")
    plain = torch.nn.functional.linear
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(k(x), plain(x, k.weight, k.bias))   # before q: its own
        torch.testing.assert_close(q(x), plain(x, q.weight, q.bias))
        torch.testing.assert_close(k(x), plain(x, k.weight, k.bias))   # handed over
    assert len(calls) == 1
    with pytest.warns(UserWarning, match="called its key or value projection on another input"):
        torch.testing.assert_close(v(y), plain(y, v.weight, v.bias))
    q(x)
    assert len(calls) == 1                                             # no longer ahead


@pytest.mark.parametrize("case", ["all", "frozen", "unused", "q_unused", "bias"])
def test_shared_input_products_give_autograds_gradients(case):
    """The query/key/value products computed as one function: the input gradient summed in
    the products and the key and value parts' gradients as one product each way give the
    gradients autograd gives three ``F.linear`` calls, with frozen weights, an output not
    used and biases."""
    import importlib

    shared = importlib.import_module("meshlab.transforms.fuse._residual")._SharedInput
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 16, generator=g, dtype=torch.float64)
    ws = [torch.randn(n, 16, generator=g, dtype=torch.float64) for n in (16, 4, 4)]
    bs = [torch.randn(n, generator=g, dtype=torch.float64) if case == "bias" else None
          for n in (16, 4, 4)]
    dys = [torch.randn(2, 5, n, generator=g, dtype=torch.float64) for n in (16, 4, 4)]
    used = {"unused": (0, 2), "q_unused": (1, 2)}.get(case, (0, 1, 2))

    def grads(fn):
        leaves = [x.clone().requires_grad_()]
        leaves += [t.clone().requires_grad_(case != "frozen") for t in ws]
        leaves += [None if b is None else b.clone().requires_grad_() for b in bs]
        outs = fn(leaves[0], leaves[1:4], leaves[4:])
        loss = sum((outs[i] * dys[i]).sum() for i in used)
        loss.backward()
        return [None if t is None else t.grad for t in leaves]

    got = grads(lambda x, w, b: shared.apply(x, *(t for p in zip(w, b) for t in p)))
    want = grads(lambda x, w, b: [torch.nn.functional.linear(x, *p) for p in zip(w, b)])
    for a, b in zip(got, want):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b)


def test_fused_under_autocast():
    """Under bf16 autocast the fused head runs in bf16, as the unfused head's matmul does."""
    import meshlab as ml
    from meshlab.transforms.fuse import causal_lm_loss, fuse_model as fuse

    ref = _model("llama")
    model = copy.deepcopy(ref)
    fuse(model, OPS)
    ids = M.batches(1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ml.losses.causal_lm_loss(ref(input_ids=ids), {"input_ids": ids})
        got = causal_lm_loss(model, {"input_ids": ids})
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    want.backward()
    got.backward()
    refp = dict(ref.named_parameters())
    for n, p in model.named_parameters():       # bf16 rounding, not a different gradient
        rel = float((p.grad - refp[n].grad).norm() / refp[n].grad.norm())
        assert rel < 3e-2, (n, rel)


def test_other_models_untouched_and_idempotent():
    from meshlab.ops import _build
    from meshlab.transforms.fuse import fuse_model as fuse

    routed, plain = _model("llama"), _model("llama")
    first = fuse(routed, OPS)
    assert fuse(routed, OPS).counts() == first.counts()         # again: same routes, no doubles
    attn = routed.model.layers[0].self_attn     # rotary: the instance forward, once, no hooks
    assert "forward" in vars(attn) and not attn._forward_pre_hooks
    modeling = __import__("sys").modules[type(attn).__module__]      # the file's function kept
    assert not hasattr(modeling.apply_rotary_pos_emb, "_meshlab_original")
    _build.LAST_PATH.clear()
    plain(input_ids=M.batches(1)[0])
    assert not _build.LAST_PATH, _build.LAST_PATH               # no meshlab op ran


def test_probe_refuses_different_math():
    import meshlab as ml
    from meshlab.transforms.fuse import fuse_model as fuse

    class OddRMSNorm(torch.nn.Module):          # looks like an RMSNorm, is not one
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            return x * self.weight + 1

    with pytest.raises(ml.ConfigError, match="OddRMSNorm.*does not reproduce"):
        fuse(torch.nn.Sequential(OddRMSNorm()), ("rms_norm",))
    with pytest.raises(ml.ConfigError, match="nothing in Sequential to route"):
        fuse(torch.nn.Sequential(torch.nn.Linear(2, 2)), ("rotary",))
    with pytest.raises(ml.ConfigError, match="unknown"):
        fuse(_model("llama"), ("softmax",))

    # another library's GPU-only kernel patched into the modeling module: a named refusal
    from transformers.models.llama import modeling_llama

    def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        raise ValueError("Pointer argument (at 0) cannot be accessed from Triton")

    original = modeling_llama.apply_rotary_pos_emb
    modeling_llama.apply_rotary_pos_emb = apply_rotary_pos_emb
    try:
        with pytest.raises(ml.ConfigError, match="LlamaAttention calls .*failed on a CPU "
                                                 "probe.*fresh process"):
            fuse(_model("llama"), ("rotary",))
    finally:
        modeling_llama.apply_rotary_pos_emb = original


def test_mlp_route_saves_less_for_backward_and_refuses_other_math():
    """A routed MLP of bare linears keeps its gate and up outputs for the backward and
    nothing else of the intermediate width (the unfused one keeps four such tensors); with
    a hook on a projection the module's own calls run and the gate's product is kept too.
    An MLP whose forward differs is refused by its probe, and one with another activation
    (GELU) is not a SwiGLU and is left alone."""
    import meshlab as ml
    from meshlab.transforms.fuse import fuse_model as fuse

    ref = _model("llama")
    model = copy.deepcopy(ref)
    fuse(model, ("mlp",))
    x = torch.randn(2, 5, ref.config.hidden_size)

    def saved_wide(mlp) -> int:
        """Distinct activations of the intermediate width the backward keeps, read off the
        autograd graph (saved-tensor hooks would change the route)."""
        seen, todo, done = set(), [mlp(x.clone().requires_grad_()).grad_fn], {}
        while todo:
            fn = todo.pop()
            if fn is None or id(fn) in done:
                continue
            done[id(fn)] = fn                  # held: a freed node's id could come back
            held = list(getattr(fn, "saved_tensors", ()) or ())
            held += [getattr(fn, a) for a in dir(fn) if a.startswith("_saved_")]
            for t in held:
                if isinstance(t, torch.Tensor) and t.shape[-1:] == (ref.config.intermediate_size,) \
                        and t.numel() == 2 * 5 * t.shape[-1]:
                    seen.add(t.untyped_storage().data_ptr())
            todo += [f for f, _ in fn.next_functions]
        return len(seen)

    assert saved_wide(ref.model.layers[0].mlp) == 4        # gate, silu(gate), up, product
    assert saved_wide(model.model.layers[0].mlp) == 2      # gate, up
    torch.testing.assert_close(model.model.layers[0].mlp(x), ref.model.layers[0].mlp(x))
    hooked = model.model.layers[1].mlp
    handle = hooked.down_proj.register_forward_hook(lambda m, i, o: None)
    assert saved_wide(hooked) == 3                         # the module's calls: product kept
    handle.remove()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert saved_wide(model.model.layers[0].mlp) == 3   # hooks decide: the module's calls
    xg = x.clone().requires_grad_()
    model.model.layers[0].mlp(xg).square().sum().backward()
    xr = x.clone().requires_grad_()
    ref.model.layers[0].mlp(xr).square().sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad)
    for (n, p), q in zip(model.model.layers[0].mlp.named_parameters(),
                         ref.model.layers[0].mlp.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)

    class OddMLP(type(ref.model.layers[0].mlp)):         # gated, but not silu(g) * u
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) + self.up_proj(x))

    odd = copy.deepcopy(ref)
    odd.model.layers[0].mlp.__class__ = OddMLP
    with pytest.raises(ml.ConfigError, match="OddMLP.*does not reproduce"):
        fuse(odd, ("mlp",))
    gelu = copy.deepcopy(ref)
    for layer in gelu.model.layers:
        layer.mlp.act_fn = torch.nn.GELU()
    with pytest.raises(ml.ConfigError, match="nothing in LlamaForCausalLM to route"):
        fuse(gelu, ("mlp",))


def test_loss_refused_where_logits_are_transformed():
    import meshlab as ml
    from meshlab.transforms.fuse import fuse_model as fuse

    model = _model("llama")
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ml.ConfigError, match="final_logit_softcapping=30.0"):
        fuse(model, ("loss",))
    with pytest.raises(ml.ConfigError, match="has no fused loss"):
        from meshlab.transforms.fuse import causal_lm_loss
        causal_lm_loss(_model("llama"), {"input_ids": M.batches(1)[0]})


def test_fuse_transform_repr_and_validation():
    import meshlab as ml
    from meshlab.transforms.fuse._hf import FUSABLE

    from meshlab.transforms.fuse import FUSABLE as PLANNED

    assert PLANNED == FUSABLE
    assert repr(ml.fuse()) == "fuse()"
    assert repr(ml.fuse("rms_norm")) == "fuse('rms_norm')"
    assert eval(repr(ml.fuse("rms_norm", "loss")), {"fuse": ml.fuse}) == ml.fuse("rms_norm", "loss")
    with pytest.raises(ml.ConfigError, match="choose distinct op names"):
        ml.fuse("rms_norm", "rms_norm")
    assert repr(ml.fuse("rms_norm", "mlp", absent="leave")) == \
        "fuse('rms_norm', 'mlp', absent='leave')"
    every = "fuse('rms_norm', 'rotary', 'attention', 'mlp', 'loss')"
    assert repr(ml.fuse(*FUSABLE)) == every and ml.fuse(*FUSABLE) != ml.fuse()
    with pytest.raises(ml.ConfigError, match="absent"):
        ml.fuse("rms_norm", absent="skip")


def test_fuse_leaves_what_the_model_lacks_and_says_so():
    """``fuse()`` as written without names routes each op the model has: a mixture of
    experts has no gated MLP (left, with the finding); the plan records what was left and
    its JSON keeps it. Named, the same ops are refused as before. Under tensor parallelism
    the loss is routed too, split over the vocabulary as the head is."""
    import meshlab as ml
    from meshlab.transforms.fuse import FuseLeft

    moe = M.build("qwen3_moe")
    plan = ml.plan(moe, ml.fuse(), ml.Mesh(dp=1, fake=True))
    fuse = next(t for t in plan.rooms if t.kind == "fuse")
    assert fuse.routed(plan) == ("rms_norm", "rotary", "attention", "loss")
    left = plan.decision(FuseLeft)
    assert [op for op, _ in left.left] == ["mlp"] and "nothing in" in left.left[0][1]
    assert "fuse left mlp" in left.describe() and "fuse left mlp" in str(plan)
    assert ml.Plan.from_json(plan.to_json()).decision(FuseLeft) == left
    with pytest.raises(ml.ConfigError, match="nothing in Qwen3MoeForCausalLM to route"):
        ml.plan(moe, ml.fuse("rms_norm", "mlp"), ml.Mesh(dp=1, fake=True))

    # a head split over the vocabulary takes the split loss: nothing is left
    llama = M.build("llama")
    tp = ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES))
    plan = ml.plan(llama, tp | ml.fuse(), ml.Mesh(tp=2, fake=True))
    fuse = next(t for t in plan.rooms if t.kind == "fuse")
    assert plan.runnable and plan.decision(FuseLeft) is None and "loss" in fuse.routed(plan)
    assert ml.plan(llama, tp | ml.fuse("loss"), ml.Mesh(tp=2, fake=True)).runnable
    assert ml.plan(llama, ml.fuse(), ml.Mesh(dp=1, fake=True)).decision(FuseLeft) is None


def test_attention_with_dropout_is_left_to_the_model():
    """meshlab's fused attention has no dropout: a model whose attention drops
    probabilities out in training (GPT-2's default attn_pdrop=0.1) keeps its own under
    ``fuse()`` (left, with the reason, in the plan), and ``fuse('attention')`` is refused
    at plan, where the forward would otherwise raise mid-step. Without dropout it routes."""
    import transformers as T

    import meshlab as ml
    from meshlab.transforms.fuse import FuseLeft

    def gpt2(pdrop):
        with torch.device("meta"):
            return T.GPT2LMHeadModel(T.GPT2Config(n_embd=32, n_layer=2, n_head=4,
                                                  vocab_size=64, attn_pdrop=pdrop))

    mesh = ml.Mesh(dp=1, fake=True)
    plan = ml.plan(gpt2(0.1), ml.fuse(), mesh)
    fuse = next(t for t in plan.rooms if t.kind == "fuse")
    left = dict(plan.decision(FuseLeft).left)
    assert "attention" not in fuse.routed(plan) and "attn_pdrop=0.1" in left["attention"]
    with pytest.raises(ml.ConfigError, match=r"drops probabilities out in training "
                                             r"\(attn_pdrop=0.1\).*set attn_pdrop=0.0"):
        ml.plan(gpt2(0.1), ml.fuse("attention"), mesh)
    plan = ml.plan(gpt2(0.0), ml.fuse(), mesh)
    assert "attention" in next(t for t in plan.rooms if t.kind == "fuse").routed(plan)


def fuse_case(rank, world, spec_name, ops):
    import torch.distributed as dist

    import meshlab as ml

    data = M.batches(3)
    ref, ref_losses, _ = M.reference("llama", data)
    model = ml.parallelize(M.build("llama"), M.spec(spec_name) | ml.fuse(*ops),
                           M.mesh_for(spec_name, world), seed=0)
    assert getattr(model, "_meshlab_fused_loss", False) == ("loss" in ops)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-3)
    rt = model._meshlab
    dp_rank = dist.get_rank(rt.dp_group) if rt.dp_group is not None else 0
    losses = [ml.step(model, opt, {"input_ids": b.chunk(rt.dp_size)[dp_rank]}) for b in data]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5,
                               rtol=1e-4)
    M.assert_weights_match(model, ref)
    if "loss" not in ops:
        return None
    try:
        ml.step(model, opt, {"input_ids": data[0]}, ml.losses.causal_lm_loss)
    except ml.ConfigError as e:
        return str(e)
    raise AssertionError("a loss_fn was accepted for a fused loss")


@pytest.mark.parametrize("spec_name,ops", [("zero3", OPS), ("zero1", OPS), ("tp", OPS)])
def test_fuse_composes_gloo(world2, spec_name, ops):
    out = world2.run(fuse_case, spec_name=spec_name, ops=ops)
    if "loss" in ops:
        assert all("leave 'loss' out" in m for m in out)


# -- plan refuses what the install refuses ----------------------------------------------
def _refused_model(name: str):
    """A model that some op of fuse() has nothing to route in, or whose probe disagrees
    (on the meta device, the odd norm aside)."""
    if name == "plain":                         # not a transformers model
        with torch.device("meta"):
            return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    if name == "odd_norm":
        return torch.nn.Sequential(_OddRMSNorm())
    return M.build(name)


class _OddRMSNorm(torch.nn.Module):             # named as an RMSNorm, computes otherwise
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(8))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return x * self.weight + 1


PLAN_REFUSED = [
    # (model, op, message fragment)
    ("gpt2", "mlp", "nothing in GPT2LMHeadModel to route to meshlab::mlp"),
    ("gpt2", "rotary", "nothing in GPT2LMHeadModel to route to meshlab::rotary"),
    ("bert", "rotary", "nothing in BertForMaskedLM to route to meshlab::rotary"),
    ("bert", "loss", "output head has a bias"),
    ("plain", "attention", "Sequential is not a transformers model"),
    ("odd_norm", "rms_norm", "_OddRMSNorm: meshlab's op does not reproduce"),
]


def _untouched(model) -> list:
    """What an install would leave on the model: instance forwards, hooks, routing marks."""
    return [(n, k) for n, m in model.named_modules() for k in vars(m)
            if k == "forward" or k.startswith("_meshlab")] + \
        [n for n, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]


@pytest.mark.parametrize("name,op,msg", PLAN_REFUSED, ids=[f"{m}-{o}" for m, o, _ in PLAN_REFUSED])
def test_plan_refuses_what_the_install_refuses(name, op, msg):
    """``plan`` raises the ConfigError the install (``fuse_model``) raises, word for word,
    on a fake mesh without processes, and leaves the model and the global RNG as they were."""
    import torch.distributed as dist

    import meshlab as ml
    from meshlab.transforms.fuse import fuse_model
    from meshlab.transforms.fuse._hf import check

    assert not dist.is_initialized()
    model = _refused_model(name)
    rng = torch.get_rng_state()
    with pytest.raises(ml.ConfigError, match=msg) as planned:
        ml.plan(model, ml.fuse(op), ml.Mesh(dp=1, fake=True))
    with pytest.raises(ml.ConfigError) as checked:
        check(model, (op,))
    assert torch.equal(torch.get_rng_state(), rng)
    assert _untouched(model) == []
    assert getattr(getattr(model, "config", None), "_attn_implementation", "eager") == "eager"
    with pytest.raises(ml.ConfigError) as installed:
        fuse_model(_refused_model(name), (op,))
    assert str(planned.value) == str(checked.value) == str(installed.value)


def test_plan_of_a_supported_model_installs_nothing():
    """fuse() of a Llama plans (every op routes) without touching the model; a traced plan
    keeps what it found through JSON, and one read from JSON written without it is not
    refused at plan (the install checks)."""
    import json

    import meshlab as ml

    model, mesh = M.build("llama"), ml.Mesh(dp=1, fake=True)
    rng = torch.get_rng_state()
    p = ml.plan(model, ml.fuse(), mesh)
    assert p.runnable and p.model.fuse_refusals == () and p.get(ml.parallel.Fuse) == ml.fuse()
    assert torch.equal(torch.get_rng_state(), rng)
    assert _untouched(model) == [] and model.config._attn_implementation == "eager"
    assert ml.Plan.from_json(p.to_json()) == p
    gpt2 = M.build("gpt2")            # the ops that route do not hide one that does not
    assert ml.plan(gpt2, ml.fuse("attention", "loss"), mesh).runnable
    with pytest.raises(ml.ConfigError, match="nothing in GPT2LMHeadModel to route to meshlab::mlp"):
        ml.plan(gpt2, ml.fuse("attention", "mlp", "loss"), mesh)
    assert _untouched(gpt2) == []

    traced = ml.fuse("mlp")(ml.trace(M.build("gpt2")))
    assert dict(traced.model.fuse_refusals).keys() == {"mlp"}
    with pytest.raises(ml.ConfigError, match="nothing in GPT2LMHeadModel to route"):
        ml.Plan.from_json(traced.to_json()).bind(mesh)
    d = json.loads(ml.trace(M.build("gpt2")).to_json())
    del d["model"]["fuse_refusals"]
    older = ml.Plan.from_json(json.dumps(d))
    assert older.model.fuse_refusals == ()
    assert ml.plan(older, ml.fuse("mlp"), mesh).runnable      # unknown: the install decides


def refused_plan_case(rank, world, index):
    import meshlab as ml

    name, op, _ = PLAN_REFUSED[index]
    try:
        ml.parallelize(_refused_model(name), ml.data_parallel("dp") | ml.fuse(op),
                       ml.Mesh(dp=world))
    except ml.ConfigError as e:
        return type(e).__name__, str(e)
    raise AssertionError(f"parallelize accepted fuse({op!r}) on {name}")


def test_parallelize_refuses_what_plan_refuses(world2):
    import meshlab as ml

    for index, (name, op, _) in enumerate(PLAN_REFUSED):
        with pytest.raises(ml.ConfigError) as planned:
            ml.plan(_refused_model(name), ml.data_parallel("dp") | ml.fuse(op),
                    ml.Mesh(dp=2, fake=True))
        got = world2.run(refused_plan_case, index=index)
        assert got == [("ConfigError", str(planned.value))] * 2, (name, op, got)
