"""meshlab.inference on one process: the paged attention op against dense attention, the
engine against transformers' ``generate``, the sampling controls, and the refusals."""

from __future__ import annotations

import functools
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers

import meshlab as ml
from meshlab.inference import InferenceConfig, InferenceEngine
from meshlab.ops.paged_attention import paged_attention, write_cache

from tests import _models as M

pytestmark = pytest.mark.timeout(300)


def _dense(q, k, v, m):
    """SDPA of the last ``m`` of ``n`` positions over all ``n`` keys: (m, H, D)."""
    n, hq, hkv = k.shape[0], q.shape[1], k.shape[1]
    k, v = (t.repeat_interleave(hq // hkv, dim=1).transpose(0, 1) for t in (k, v))
    mask = torch.arange(n)[None, :] <= torch.arange(n - m, n)[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask) \
        .transpose(0, 1)


@pytest.mark.parametrize("dtype,cache_dtype,tol", [
    (torch.float64, None, 1e-12), (torch.float32, None, 1e-5),
    (torch.float32, torch.bfloat16, None)])
def test_paged_attention_matches_dense_attention(dtype, cache_dtype, tol):
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, bs, nblocks = 4, 2, 8, 4, 16
    lens, queries = [9, 1, 5, 12], [9, 1, 1, 3]       # two prefills, two decodes (one partial)
    kc = torch.zeros(nblocks, bs, hkv, d, dtype=cache_dtype or dtype)
    vc = torch.zeros_like(kc)
    perm = torch.randperm(nblocks, generator=g).tolist()        # blocks scattered
    tables, keys, vals = [], [], []
    for n in lens:
        need = math.ceil(n / bs)
        blocks, perm = perm[:need], perm[need:]
        tables.append(blocks + [0] * (4 - need))
        k = torch.randn(n, hkv, d, generator=g, dtype=dtype)
        v = torch.randn(n, hkv, d, generator=g, dtype=dtype)
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(n)])
        write_cache(kc, vc, slots, k, v)
        keys.append(k)
        vals.append(v)
    q = torch.randn(sum(queries), hq, d, generator=g, dtype=dtype)
    starts = [0]
    for m in queries:
        starts.append(starts[-1] + m)
    out = paged_attention(q, kc, vc, torch.tensor(tables, dtype=torch.int32), lens, starts)
    assert out.dtype == dtype and out.shape == q.shape
    for s, (n, m) in enumerate(zip(lens, queries)):
        k, v = keys[s], vals[s]
        if cache_dtype is not None:        # what the cache stored
            k, v = k.to(cache_dtype).to(dtype), v.to(cache_dtype).to(dtype)
        want = _dense(q[starts[s]:starts[s + 1]], k, v, m)
        torch.testing.assert_close(out[starts[s]:starts[s + 1]], want,
                                   atol=tol or 1e-5, rtol=tol or 1e-5)


def test_paged_attention_checks_its_arguments():
    kc = torch.zeros(2, 4, 2, 8)
    with pytest.raises(ValueError, match="divide"):
        paged_attention(torch.zeros(1, 3, 8), kc, kc, torch.zeros(1, 2, dtype=torch.int32),
                        [1], [0, 1])
    with pytest.raises(ValueError, match="queries <= keys"):
        paged_attention(torch.zeros(3, 4, 8), kc, kc, torch.zeros(1, 2, dtype=torch.int32),
                        [2], [0, 3])


def _tiny(family="llama"):
    return ml.init_weights(M.build(family), seed=0).eval()


def _prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 97, (n,), generator=g).tolist() for n in (5, 1, 12, 7, 3)]


def _engine(model, drafter_model=None, **kw):
    cfg = dict(dtype=torch.float32, max_batch_size=2, max_input_len=16, max_output_len=8,
               block_size=4)
    return InferenceEngine(model, inference_config=InferenceConfig(**{**cfg, **kw}),
                           drafter_model=drafter_model)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engine_greedy_equals_generate_alone(family):
    ref = _tiny(family)
    prompts = _prompts()
    want = [ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):]
            .tolist() for p in prompts]
    got = _engine(_tiny(family)).generate(prompts=prompts, max_new_tokens=8)
    assert got == want


def test_generation_config_settings_the_engine_does_not_read_are_named():
    """model.generate() applies the model's generation_config (a checkpoint's sampling
    settings, a repetition penalty); the engine decodes as its InferenceConfig says and
    read only the EOS ids there, so its tokens differed from generate()'s without a word.
    It now warns, naming each setting and the InferenceConfig field that applies it; with
    that field set, the tokens are generate()'s."""
    def model():
        m = _tiny()
        m.generation_config.repetition_penalty = 1.5
        m.generation_config.max_new_tokens = 5
        return m

    with pytest.warns(UserWarning, match=r"repetition_penalty=1\.5, max_new_tokens=5.*"
                                         r"InferenceConfig\(repetition_penalty=1\.5\)"):
        _engine(model())
    p = _prompts()[2]
    want = model().generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):]
    plain = _tiny().generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):]
    assert want.tolist() != plain.tolist()        # the penalty changes these tokens
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # the penalty given: only the length left
        warnings.filterwarnings("ignore", message=".*max_new_tokens=5")
        got = _engine(model(), repetition_penalty=1.5).generate(prompts=[p], max_new_tokens=8)
    assert got == [want.tolist()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")            # transformers' defaults: nothing to say
        _engine(_tiny())


def test_add_request_takes_one_prompt():
    """A (2, 4) tensor was flattened into one prompt of 8 tokens; generate(prompts=...)
    reads the same tensor as 2 prompts."""
    engine = _engine(_tiny())
    for bad in (torch.arange(8).view(2, 4), torch.arange(4.0), [[1, 2], [3, 4]]):
        with pytest.raises(ml.ConfigError, match="one sequence of token ids"):
            engine.add_request(bad)
    assert engine.add_request(torch.arange(4).view(1, 4)) == 0


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_engine_on_meshlab_kernels_equals_generate(family):
    """use_cuda_kernel=True: the norms, rotary and MLP on meshlab's ops (here the C++ CPU
    kernels) give transformers' greedy tokens; what was routed is recorded."""
    ref = _tiny(family)
    prompts = _prompts()
    want = [ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):]
            .tolist() for p in prompts]
    plain = _tiny(family)
    eng = _engine(_tiny(family), use_cuda_kernel=True)
    assert eng.generate(prompts=prompts, max_new_tokens=8) == want
    cfg = eng.model.config
    assert eng.model._meshlab_kernels.counts() == {
        "rms_norm": 2 * cfg.num_hidden_layers + 1, "rotary": cfg.num_hidden_layers,
        "mlp": cfg.num_hidden_layers, "residual_add": cfg.num_hidden_layers}
    merged = eng.model._meshlab_merged
    layers = cfg.num_hidden_layers
    # the output and down projections and the head go through decode_linear; every layer
    # normalizes its input in the query/key/value product and adds its residual in the down
    assert merged.counts() == {"qkv": layers, "gate_up": layers, "linear": 2 * layers + 1,
                               "layers": layers, "rotary_tables": 1}
    assert merged.unfused == {}
    assert merged.linear[-1] == "lm_head"
    assert merged.misses == 0
    # the merged weights are the modules' own parameters, names and values kept
    got, ref = eng.model.state_dict(), plain.state_dict()
    assert got.keys() == ref.keys()
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_a_one_request_decode_step_puts_every_product_on_the_row_kernel(monkeypatch):
    """Under use_cuda_kernel a decode step of one request hands every product to
    ``decode_linear`` in a form the Triton matrix-vector kernel takes (``one_row``; the
    kernel itself, and which widths it takes, are checked on the GPU), with the modules'
    weights, which are parameters; a prefill's products are not single rows. Each layer
    rotates its queries and keys in one call of the rotary op, by angles looked up in the
    rotary embedding's table."""
    import importlib

    from meshlab.inference import _merge

    seen, rotated = [], []
    real = _merge.one_row
    monkeypatch.setattr(_merge, "one_row", lambda *a: seen.append(real(*a)) or seen[-1])
    rot = importlib.import_module("meshlab.ops.rotary")
    real_rot = rot.rotary
    monkeypatch.setattr(rot, "rotary", lambda x, *a: rotated.append(x.shape) or real_rot(x, *a))
    for family in ("llama", "qwen2"):                  # qwen2: biases
        eng = _engine(_tiny(family), ignore_eos=True, use_cuda_kernel=True)
        seen.clear()                                       # the layer probe's products
        eng.add_request([1, 2, 3], 4)
        eng.step()                                         # the prefill
        layers = eng.model.config.num_hidden_layers
        assert seen == [False] * (4 * layers) + [True]     # the head reads the last row
        seen.clear()
        rotated.clear()
        rope = eng.model.model.rotary_emb
        looked_up = []
        rope._meshlab_table = _Counted(rope._meshlab_table, looked_up)
        eng.step()                                         # one decode step
        assert len(looked_up) == 1                         # the angles from the table
        assert seen == [True] * (4 * layers + 1)
        cfg = eng.model.config
        heads = cfg.num_attention_heads + cfg.num_key_value_heads
        assert [r[2] for r in rotated] == [heads] * layers     # queries and keys at once
        seen.clear()


class _Counted(torch.Tensor):
    """A table that records its lookups."""

    @staticmethod
    def __new__(cls, t, log):
        out = t.as_subclass(cls)
        out.log = log
        return out

    def __getitem__(self, idx):
        self.log.append(idx)
        return torch.Tensor.__getitem__(self.as_subclass(torch.Tensor), idx)


def test_rotary_tables_give_the_modules_own_angles():
    """The rotary embedding's table rows are what its forward computes for those positions
    alone, bit for bit (a default and a llama3-scaled rope); a dynamic rope type, whose
    angles depend on the longest position seen, keeps its forward."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from meshlab.inference._merge import table_rotary
    from meshlab.inference._paged import running

    cfg = _tiny().config
    llama3 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                  high_freq_factor=4.0, original_max_position_embeddings=64)
    for rope, dtype in ((None, torch.float32), (llama3, torch.bfloat16)):
        c = type(cfg).from_dict(cfg.to_dict())
        if rope is not None:
            c.rope_parameters = rope
        holder = torch.nn.Module()
        holder.rotary_emb = LlamaRotaryEmbedding(c)
        plain = LlamaRotaryEmbedding(c)
        assert table_rotary(holder, 300, dtype) == ["rotary_emb"]
        x = torch.empty(0, dtype=dtype)
        looked_up = []
        holder.rotary_emb._meshlab_table = _Counted(holder.rotary_emb._meshlab_table,
                                                    looked_up)
        with running(object()):                        # inside an engine step
            for pos in (torch.tensor([[0, 7, 299]]), torch.tensor([[123]]),
                        torch.arange(40).view(2, 20)):
                got, want = holder.rotary_emb(x, pos), plain(x, pos)
                for a, b in zip(got, want):
                    assert a.dtype == dtype and torch.equal(a, b)
            assert len(looked_up) == 3
            assert torch.equal(holder.rotary_emb(x.double(), pos)[0],
                               plain(x.double(), pos)[0])
        far = torch.tensor([[5000]])                   # outside a step: the module's forward
        assert torch.equal(holder.rotary_emb(x, far)[0], plain(x, far)[0])
        assert len(looked_up) == 3
    c = type(cfg).from_dict(cfg.to_dict())
    c.rope_parameters = dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0)
    holder = torch.nn.Module()
    holder.rotary_emb = LlamaRotaryEmbedding(c)
    assert table_rotary(holder, 300, torch.float32) == []
    assert "forward" not in vars(holder.rotary_emb)


def test_queries_and_keys_of_one_product_rotate_in_one_launch(monkeypatch):
    """Queries and keys that are adjacent parts of one merged product (heads after heads,
    the same token strides) are rotated as one tensor: one call of the op, the results of
    two; tensors apart, or ones autograd records, take a call each."""
    import importlib

    from meshlab.transforms.fuse import _rotary

    rotary_mod = importlib.import_module("meshlab.ops.rotary")
    calls = []
    real = rotary_mod.rotary
    monkeypatch.setattr(rotary_mod, "rotary", lambda x, c, s: calls.append(x.shape) or real(x, c, s))
    hq, hkv, d, t = 4, 2, 8, 5
    row = torch.randn(1, t, (hq + 2 * hkv) * d)
    q = row[..., :hq * d].view(1, t, hq, d).transpose(1, 2)
    k = row[..., hq * d:(hq + hkv) * d].view(1, t, hkv, d).transpose(1, 2)
    angle = torch.outer(torch.arange(t, dtype=torch.float32), torch.rand(d // 2))
    cos = torch.cat([angle.cos(), angle.cos()], -1)[None]
    sin = torch.cat([angle.sin(), angle.sin()], -1)[None]
    with torch.no_grad():
        gq, gk = _rotary._fused_apply_rotary(q, k, cos, sin)
    assert calls == [(1, t, hq + hkv, d)]
    assert gq.shape == q.shape and gk.shape == k.shape
    calls.clear()
    wq, wk = _rotary._fused_apply_rotary(q.contiguous(), k.contiguous(), cos, sin)
    assert len(calls) == 2
    assert torch.equal(gq, wq) and torch.equal(gk, wk)
    calls.clear()
    qg = q.detach().requires_grad_()
    _rotary._fused_apply_rotary(qg, k, cos, sin)
    assert len(calls) == 2
    assert _rotary._adjacent(k, q) is None            # keys before queries: not one tensor
    # one token (a decode step): views of the size-1 dims may give q and k other strides
    one = torch.randn(1, 1, (hq + 2 * hkv) * d)
    q1, k1, _ = one.split([hq * d, hkv * d, hkv * d], -1)
    q1 = q1.view(1, 1, hq, d).transpose(1, 2)
    k1 = k1.view(1, 1, hkv, d).transpose(1, 2)
    assert q1.stride(0) != k1.stride(0)
    both = _rotary._adjacent(q1, k1)
    assert both is not None and both.shape == (1, 1, hq + hkv, d)
    assert torch.equal(both[0, 0], one[0, 0, :(hq + hkv) * d].view(hq + hkv, d))


def test_a_layer_whose_attention_reads_its_input_otherwise_keeps_its_norm_apart():
    """A layer class whose attention uses its input beyond the three projections (here it
    scales each token's output by its input's mean size) would compute something else if
    handed the layer's raw input: the probe refuses it, the reason is recorded, and the
    tokens are still transformers' own."""
    from transformers.models.llama import modeling_llama as ml_llama

    class Attention(ml_llama.LlamaAttention):
        def forward(self, hidden_states, **kw):
            out, w = super().forward(hidden_states, **kw)
            return out * hidden_states.abs().mean(-1, keepdim=True), w

    class Layer(ml_llama.LlamaDecoderLayer):
        def __init__(self, config, layer_idx):
            super().__init__(config, layer_idx)
            self.self_attn = Attention(config, layer_idx)

    def build():
        model = M.build("llama")
        with torch.device("meta"):
            model.model.layers = torch.nn.ModuleList(
                Layer(model.config, i) for i in range(model.config.num_hidden_layers))
        return ml.init_weights(model, seed=0).eval()

    ref = build()
    prompts = _prompts()
    want = [ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):]
            .tolist() for p in prompts]
    eng = _engine(build(), use_cuda_kernel=True, ignore_eos=True)
    merged = eng.model._meshlab_merged
    assert merged.layers == [] and "relative difference" in merged.unfused["Layer"]
    assert eng.model._meshlab_kernels.counts()["residual_add"] == 2     # fuse's own routing
    assert eng.generate(prompts=prompts, max_new_tokens=8) == want


def test_the_engine_says_what_it_runs():
    eng = _engine(_tiny(), use_cuda_kernel=True, use_spec_dec=True, max_n_spec_tokens=3,
                  drafter_model=_noisy(0.3), ignore_eos=True)
    eng.generate(prompts=_prompts()[:2], max_new_tokens=4)
    text = repr(eng)
    layers = eng.model.config.num_hidden_layers
    assert text.startswith("InferenceEngine(LlamaForCausalLM, float32 on cpu, max_batch_size=2")
    assert "blocks of 4 tokens" in text and "CUDA graphs" not in text
    assert f"'residual_add': {layers}" in text and f"'layers': {layers}" in text
    assert f"3 drafted tokens a step, {eng.spec.accepted} of {eng.spec.proposed}" in text
    assert text.endswith(f"0 waiting, 0 running, {eng.steps} steps run)")
    plain = repr(_engine(_tiny()))
    assert "kernels" not in plain and "speculative" not in plain


def test_merged_projections_make_four_products_per_layer():
    """A decode step under use_cuda_kernel, of one request or several: one product for the
    query, key and value, one for the gate and up, the output and down projections, and
    the head."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Products(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
            return func(*args, **(kwargs or {}))

    def products(requests=1, **kw):
        eng = _engine(_tiny("qwen2"), ignore_eos=True, **kw)
        for r in range(requests):
            eng.add_request([1, 2, 3 + r], 4)
        eng.step()                          # the prefill
        with Products() as count:
            eng.step()                      # one decode step
        assert getattr(eng.model, "_meshlab_merged", None) is None or \
            eng.model._meshlab_merged.misses == 0
        return count.n

    layers = _tiny("qwen2").config.num_hidden_layers
    assert products() == 7 * layers + 1
    assert products(use_cuda_kernel=True) == 4 * layers + 1
    assert products(3, use_cuda_kernel=True) == 4 * layers + 1     # rows of several requests


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_eager_decode_step_never_reads_the_device(family):
    """An eager decode step (no graphs: tensor-parallel serving runs so) launches its work
    without waiting on the device: no scalar is read back inside it (transformers' search
    of the position ids for packed sequences read one before the paged attention stopped
    registering a mask function)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    eng = _engine(_tiny(family), ignore_eos=True)
    for r in range(2):
        eng.add_request([1, 2, 3 + r], 4)
    eng.step()                              # the prefill
    with Reads() as reads:
        eng.step()
    assert reads.n == 0


def test_meshlab_kernels_refused_where_not_built(one_process):
    with pytest.raises(ml.ConfigError, match="use_cuda_kernel=True.*one process"):
        _engine(ml.parallelize(M.build("llama"), ml.precision("fp32"), ml.Mesh(dp=1), seed=0),
                use_cuda_kernel=True)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=97, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(ml.ConfigError, match="nothing meshlab's kernels route"):
        _engine(gpt2, use_cuda_kernel=True)


def test_gemma_kernels_equal_generate():
    """Gemma under ``use_cuda_kernel``: its norms (weights offset by one) on meshlab's norm,
    its tanh-GELU MLP's gate and up products merged and gated by ``meshlab::geglu``; the
    tokens are transformers' greedy ones."""
    # Untied: with the head tied to the embeddings a tiny random Gemma repeats its last
    # token whatever its layers compute, which would prove nothing here.
    cfg = transformers.GemmaConfig(vocab_size=97, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)

    def build():
        with torch.device("meta"):
            model = transformers.GemmaForCausalLM(cfg)
        return ml.init_weights(model, seed=0).eval()

    ref = build()
    ref.generation_config.eos_token_id = None
    prompts = _prompts()
    want = [ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):]
            .tolist() for p in prompts]
    assert all(len(set(w)) > 1 for w in want[:4]), want           # not a repeated token
    eng = _engine(build(), use_cuda_kernel=True, ignore_eos=True)
    assert eng.generate(prompts=prompts, max_new_tokens=8) == want
    assert eng.model._meshlab_merged.counts() == {"qkv": 2, "gate_up": 2, "linear": 5,
                                                   "layers": 0,     # offset norms
                                                   "rotary_tables": 1}
    assert eng.model._meshlab_kernels.counts()["mlp"] == 2
    from meshlab.ops import _build

    assert _build.LAST_PATH[("geglu", "cpu")].native or not _build.ops_cpu()


def test_chunked_argmax_is_argmax_with_its_ties():
    """The greedy choice through chunk maxima (what CUDA runs for small batches) gives
    ``argmax``'s index, the first among equal maxima, whether the ties lie in one chunk or
    across chunks; vocabularies with no divisor in range keep the plain ``argmax``."""
    from meshlab.inference._sampling import _chunk, chunked_argmax

    assert _chunk(128256) == 1002 and _chunk(32000) == 1000 and _chunk(151936) == 128
    assert _chunk(97) is None and _chunk(2 * 1009) is None
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (7, 6000), generator=g).bfloat16()  # many ties everywhere
    x[1, 4321] = x[1, 17] = 9                       # a tie across chunks: the first wins
    x[2, 2001] = x[2, 2005] = 9                     # a tie inside one chunk
    for c in (_chunk(6000), 1000, 6):
        assert torch.equal(chunked_argmax(x, c), x.argmax(-1)), c
    assert chunked_argmax(x, 1000)[1] == 17 and chunked_argmax(x, 1000)[2] == 2001


def test_sampling_controls():
    prompts = _prompts()
    greedy = _engine(_tiny(), ignore_eos=True).generate(prompts=prompts, max_new_tokens=6)
    top1 = _engine(_tiny(), ignore_eos=True, do_sample=True, top_k=1).generate(
        prompts=prompts, max_new_tokens=6)
    assert top1 == greedy                       # top_k=1 sampling is greedy
    draw = dict(ignore_eos=True, do_sample=True, temperature=1.5, top_p=0.9)
    a = _engine(_tiny(), seed=1, **draw).generate(prompts=prompts, max_new_tokens=6)
    b = _engine(_tiny(), seed=1, **draw).generate(prompts=prompts, max_new_tokens=6)
    c = _engine(_tiny(), seed=2, **draw).generate(prompts=prompts, max_new_tokens=6)
    assert a == b and a != c                    # seeded: the same draws, another seed others
    rep = _engine(_tiny(), ignore_eos=True, no_repeat_ngram_size=1).generate(
        prompts=prompts, max_new_tokens=6)
    for p, o in zip(prompts, rep):              # no token of the history appears again
        assert not set(o) & set(p) and len(set(o)) == len(o)
    forced = _engine(_tiny(), ignore_eos=True, forced_eos_token_id=5).generate(
        prompts=prompts, max_new_tokens=4)
    assert all(len(o) == 4 and o[-1] == 5 for o in forced)


def test_repetition_penalty_is_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from meshlab.inference._sampling import _repetition

    g = torch.Generator().manual_seed(0)
    # every row at once, each with its own history (of any length, empty included)
    logits, seen = torch.randn(3, 50, generator=g), [[3, 7, 7, 20], [49, 0], []]
    got = _repetition(logits.clone(), seen, 1.3)
    for row, hist in enumerate(seen):
        want = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([hist], dtype=torch.long),
                                                     logits[row][None].clone())[0]
        torch.testing.assert_close(got[row], want)


def _word_tokenizer():
    """A word-level tokenizer of the tiny models' vocabulary: 'wN' is token N + 3."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(94)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def test_prompt_templates():
    """prompt_template: a format string with {input_text}, or 'chat' (the tokenizer's chat
    template, the prompt one user message): the tokens of the templated text; refusals."""
    tokenizer = _word_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}w7 {{ m['content'] }} w8{% endfor %}"
                               "{% if add_generation_prompt %} w9{% endif %}")
    cfg = dict(dtype=torch.float32, max_input_len=16, max_output_len=4, ignore_eos=True)

    def run(template, prompts):
        return InferenceEngine(_tiny(), tokenizer, InferenceConfig(
            prompt_template=template, **cfg)).generate(prompts=prompts, max_new_tokens=4)

    plain = run(None, ["w5 w1 w2 w3 w6", "w7 w40 w8 w9"])
    assert run("w5 {input_text} w6", ["w1 w2 w3"]) == plain[:1]
    assert run("chat", ["w40"]) == plain[1:]
    for bad, match in (("llama", "format string with {input_text}"),
                       ("{x} {input_text}", "does not format with input_text alone")):
        with pytest.raises(ml.ConfigError, match=re.escape(match)):
            InferenceConfig(prompt_template=bad)
    engine = InferenceEngine(_tiny(), tokenizer, InferenceConfig(prompt_template="chat", **cfg))
    with pytest.raises(ml.ConfigError, match="applies to string prompts"):
        engine.add_request([1, 2, 3])
    tokenizer.chat_template = None
    with pytest.raises(ml.ConfigError, match="no chat_template"):
        engine.add_request("w1")


def test_string_prompts_with_a_tokenizer():
    tokenizer = _word_tokenizer()
    model = _tiny()
    engine = InferenceEngine(model, tokenizer, InferenceConfig(
        dtype=torch.float32, max_input_len=16, max_output_len=4, ignore_eos=True))
    out = engine.generate(prompts=["w1 w2 w3", "w40"], max_new_tokens=4)
    ids = engine.generate(prompts=[[int(w[1:]) + 3 for w in p.split()]
                                   for p in ("w1 w2 w3", "w40")], max_new_tokens=4)
    assert out == [tokenizer.decode(i, skip_special_tokens=True) for i in ids]


@pytest.mark.parametrize("field,value", [
    ("pad_input", True), ("pp_size", 2),
    ("prefill_ratio", 2.0), ("glimpse_large_kv", True)])
def test_fields_not_built_are_refused_by_name(field, value):
    with pytest.raises(ml.ConfigError, match=rf"InferenceConfig\({field}="):
        InferenceConfig(**{field: value})


def _noisy(scale: float, family="llama"):
    """The tiny model with noise on every weight: a drafter that agrees only sometimes."""
    d = _tiny(family)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std())
    return d


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_speculative_decoding_gives_the_greedy_tokens(family):
    prompts = _prompts()
    ref = _tiny(family)
    want = [ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):]
            .tolist() for p in prompts]
    plain = _engine(_tiny(family))
    assert plain.generate(prompts=prompts, max_new_tokens=8) == want
    seen = []
    for drafter in (_tiny(family), _noisy(0.3, family), _noisy(1.0, family)):
        engine = _engine(_tiny(family), use_spec_dec=True, max_n_spec_tokens=3,
                         drafter_model=drafter)
        assert engine.generate(prompts=prompts, max_new_tokens=8) == want
        seen.append((engine.spec.accepted, engine.spec.proposed, engine.steps))
    (a0, p0, s0), (a1, p1, s1), (a2, p2, s2) = seen
    assert a0 == p0 and s0 < plain.steps / 2       # the model itself drafts: all kept
    assert 0 < a1 < p1 and s0 < s1 < plain.steps   # some kept, some written over
    assert a2 < a1 and s2 <= plain.steps


def test_speculative_decoding_on_meshlab_kernels_gives_the_greedy_tokens():
    """use_cuda_kernel with a drafter: the verification steps (several rows a sequence)
    and the drafter's single rows take the routed layers; the tokens are the greedy ones."""
    prompts = _prompts()
    ref = _tiny()
    want = [ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):]
            .tolist() for p in prompts]
    engine = _engine(_tiny(), use_spec_dec=True, max_n_spec_tokens=3, use_cuda_kernel=True,
                     drafter_model=_noisy(0.3))
    assert engine.model._meshlab_merged.counts()["layers"] == ref.config.num_hidden_layers
    assert engine.generate(prompts=prompts, max_new_tokens=8) == want
    assert 0 < engine.spec.accepted < engine.spec.proposed


def test_speculative_decoding_switched_on_and_off():
    prompts = _prompts()
    engine = _engine(_tiny())
    want = engine.generate(prompts=prompts, max_new_tokens=8)
    steps = engine.steps
    engine.enable_spec_dec(_noisy(0.1), n_spec_tokens=2)
    assert engine.spec.k == 2 and engine.generate(prompts=prompts, max_new_tokens=8) == want
    assert engine.steps - steps < steps
    engine.disable_spec_dec()
    assert engine.spec is None and engine.generate(prompts=prompts, max_new_tokens=8) == want


def test_speculative_decoding_refusals():
    with pytest.raises(ml.ConfigError, match="drafter_model"):
        _engine(_tiny(), use_spec_dec=True)
    with pytest.raises(ml.ConfigError, match="use_spec_dec=True"):
        _engine(_tiny(), drafter_model=_tiny())
    with pytest.raises(ml.ConfigError, match=r"do_sample=True\).*plain greedy"):
        _engine(_tiny(), use_spec_dec=True, do_sample=True, drafter_model=_tiny())
    with pytest.raises(ml.ConfigError, match="repetition_penalty"):
        _engine(_tiny(), use_spec_dec=True, repetition_penalty=1.2, drafter_model=_tiny())
    with pytest.raises(ml.ConfigError, match="vocabulary has 64 tokens, the model's 97"):
        _engine(_tiny(), use_spec_dec=True, drafter_model=ml.init_weights(
            M.build("llama", vocab_size=64), seed=0))
    with pytest.raises(ml.ConfigError, match="max_n_spec_tokens=0"):
        InferenceConfig(max_n_spec_tokens=0)
    engine = _engine(_tiny())
    with pytest.raises(ml.ConfigError, match="n_spec_tokens=0"):
        engine.enable_spec_dec(_tiny(), n_spec_tokens=0)
    engine.add_request([1, 2, 3], 4)
    with pytest.raises(ml.ConfigError, match="in flight"):
        engine.enable_spec_dec(_tiny())


@functools.lru_cache(maxsize=None)
def _beam_setup(family, dtype):
    """Two tiny models (transformers' reference, the engine's) and their EOS: a token the
    model's greedy runs emit early, the first with which beam search (width 2) stops some
    prompt before its budget with early_stopping=False (its hypotheses ended by EOS and no
    better one possible), and gives other tokens with early_stopping=True."""
    ref = _tiny(family).to(dtype)
    ref.generation_config.eos_token_id = None
    prompts = _prompts()
    greedy = [_hf(ref, p, 1, False, 10)[0] for p in prompts]
    for eos in dict.fromkeys(t for o in greedy for t in o[1:6]):
        ref.generation_config.eos_token_id = eos
        late = [_hf(ref, p, 2, False, 10) for p in prompts]
        if all(n == 10 for _, n in late):
            continue
        if [_hf(ref, p, 2, True, 10) for p in prompts] != late:
            model = _tiny(family).to(dtype)
            model.generation_config.eos_token_id = eos
            return ref, model, prompts
    raise AssertionError("no token of the greedy runs ends a beam search early")


def _hf(ref, prompt, beams, early_stopping, n):
    """transformers' beam search on one prompt alone: its best beam's new tokens, and the
    steps the search ran (one score tensor each)."""
    out = ref.generate(torch.tensor([prompt]), num_beams=beams, do_sample=False,
                       early_stopping=early_stopping, max_new_tokens=n, length_penalty=1.0,
                       num_return_sequences=1, return_dict_in_generate=True,
                       output_scores=True)
    return out.sequences[0, len(prompt):].tolist(), len(out.scores)


def _serve_beams(engine, prompts, budgets, late=0):
    """Serve the prompts, the last ``late`` of them added at the engine's third step:
    each one's tokens, the steps each ran, and every step's batch."""
    first = len(prompts) - late
    ids = [engine.add_request(p, n) for p, n in zip(prompts[:first], budgets)]
    done, batches, start = {}, [], engine.steps
    while engine.has_work():
        if late and engine.steps - start == 2:
            ids += [engine.add_request(p, n) for p, n in zip(prompts[first:], budgets[first:])]
        for r in engine.step():
            done[r.rid] = r.generated
        batches.append(set(engine.last_batch))
    return ([(done[i], sum(i in b for b in batches)) for i in ids], batches)


@pytest.mark.parametrize("family,dtype", [("llama", torch.float32), ("qwen2", torch.float64)])
def test_beam_search_equals_generate_alone(family, dtype):
    """Widths 2 and 3, early_stopping True, False and 'never', prompts of 1 to 12 tokens:
    the engine's tokens are transformers' best beam, with hypotheses ended by EOS, and each
    search stops at transformers' step."""
    ref, model, prompts = _beam_setup(family, dtype)
    ended, differ, short = 0, 0, 0
    for w in (2, 3):
        outs = {}
        for es in (True, False, "never"):
            want = [_hf(ref, p, w, es, 10) for p in prompts]
            engine = _engine(model, dtype=dtype, beam_width=w, early_stopping=es,
                             max_batch_size=2 * w, max_output_len=10)
            got, _ = _serve_beams(engine, prompts, [10] * len(prompts))
            assert got == want, (w, es)
            assert len(engine.blocks.free) == engine.blocks.n and not engine.beam.searches
            assert engine.cache.copied > 0
            ended += sum(len(o) < 10 for o, _ in want)
            short += es is False and sum(n < 10 for _, n in want)   # stopped: no better
            outs[es] = want
        differ += outs[True] != outs[False]
    assert ended and differ and short   # EOS ended hypotheses; the stopping rules mattered


def test_beam_search_continuous_batching():
    """max_batch_size 5 with width 2: two requests at a time (beams counted); requests of
    different budgets, two more added between steps; each gives its generate() tokens."""
    ref, model, prompts = _beam_setup("llama", torch.float32)
    budgets = [10, 4, 7, 10, 6]
    engine = _engine(model, beam_width=2, max_batch_size=5, max_output_len=10)
    got, batches = _serve_beams(engine, prompts, budgets, late=2)
    assert got == [_hf(ref, p, 2, False, n) for p, n in zip(prompts, budgets)]
    assert max(map(len, batches)) == 2 and len(batches) < sum(budgets)
    assert any((now - before) and (now & before) for before, now in zip(batches, batches[1:]))
    assert any((before - now) and (now & before) for before, now in zip(batches, batches[1:]))
    assert len(engine.blocks.free) == engine.blocks.n


def test_beams_fork_by_copying_blocks():
    """After the prompt, the second beam holds blocks of its own with the prompt's keys and
    values copied in every layer; the first keeps the prompt's blocks uncopied."""
    engine = _engine(_tiny(), beam_width=2, ignore_eos=True)
    engine.add_request(list(range(1, 7)), 4)                # 6 tokens: 2 blocks of 4
    engine.step()
    (s,) = engine.beam.searches.values()
    (a, b), cache = s.beams, engine.cache
    assert a.cached == b.cached == 6 and not set(a.blocks) & set(b.blocks)
    assert cache.copied == 2 and not s.spare
    for layer in cache.k:
        for t in (cache.k[layer], cache.v[layer]):
            torch.testing.assert_close(t[b.blocks[:2]], t[a.blocks[:2]], rtol=0, atol=0)
    while engine.has_work():
        engine.step()
    assert len(engine.blocks.free) == engine.blocks.n == 2 * 6      # 2 beams, 6 blocks each


@pytest.mark.parametrize("kw,field", [
    (dict(do_sample=True), "do_sample"), (dict(use_spec_dec=True), "use_spec_dec"),
    (dict(use_cuda_graph=True), "use_cuda_graph"),
    (dict(repetition_penalty=1.2), "repetition_penalty"),
    (dict(no_repeat_ngram_size=2), "no_repeat_ngram_size"),
    (dict(forced_eos_token_id=5), "forced_eos_token_id"),
    (dict(max_batch_size=1), "max_batch_size")])
def test_beam_search_refusals(kw, field):
    with pytest.raises(ml.ConfigError, match=rf"beam_width=2, {field}=.*set {field}|"
                                             rf"beam_width=2, {field}=1\).*raise {field}"):
        InferenceConfig(beam_width=2, **kw)


def test_beam_width_and_early_stopping_are_checked():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ml.ConfigError, match=rf"beam_width={bad!r}\): a positive"):
            InferenceConfig(beam_width=bad)
    with pytest.raises(ml.ConfigError, match=r"early_stopping='sometimes'\): True, False"):
        InferenceConfig(beam_width=2, early_stopping="sometimes")
    with pytest.raises(ml.ConfigError, match=r"early_stopping=True\) with beam_width=1"):
        InferenceConfig(early_stopping=True)
    engine = _engine(_tiny(), beam_width=2)
    with pytest.raises(ml.ConfigError, match=r"beam_width=2\).*set beam_width=1"):
        engine.enable_spec_dec(_tiny())


def test_defaults_are_colossalai_guide():
    c = InferenceConfig()
    assert (c.max_batch_size, c.max_input_len, c.max_output_len, c.dtype, c.block_size,
            c.top_k, c.top_p, c.temperature, c.beam_width, c.tp_size) == \
        (8, 256, 256, torch.float16, 16, 50, 1.0, 1.0, 1, 1)


def test_bad_requests_are_refused_before_any_step():
    engine = _engine(_tiny())
    with pytest.raises(ml.ConfigError, match="max_input_len=16"):
        engine.add_request(list(range(17)))
    with pytest.raises(ml.ConfigError, match="max_output_len=8"):
        engine.add_request([1, 2], max_new_tokens=9)
    with pytest.raises(ml.ConfigError, match=r"\[0, 97\)"):
        engine.add_request([1, 97])
    with pytest.raises(ml.ConfigError, match="tokenizer"):
        engine.add_request("hello")
    with pytest.raises(ml.ConfigError, match="not a transformers model"):
        InferenceEngine(torch.nn.Linear(2, 2))
    assert engine.steps == 0 and not engine.has_work()


def _saved(tmp_path):
    model = _tiny()
    model.generation_config.eos_token_id = None        # every run makes all its tokens
    path = tmp_path / "tiny-llama"
    model.save_pretrained(path, safe_serialization=True)
    return model, str(path)


def test_generate_command_on_a_local_directory(tmp_path, capsys):
    import json

    from meshlab import cli

    model, path = _saved(tmp_path)
    want = [model.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False)[0, len(p):]
            .tolist() for p in ([1, 2, 3], [9, 4])]
    assert cli.main(["generate", path, "--prompt-ids", "1,2,3", "--prompt-ids", "9,4",
                     "--max-new-tokens", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [o["output"] for o in out] == want
    assert cli.main(["generate", str(tmp_path), "--prompt-ids", "1"]) == 2
    assert "no config.json" in capsys.readouterr().err
    _word_tokenizer().save_pretrained(path)
    assert cli.main(["generate", path, "--prompt", "w1 w2", "--prompt-template",
                     "w5 {input_text} w6", "--max-new-tokens", "3", "--json"]) == 0
    templated = json.loads(capsys.readouterr().out)[0]["output"]
    assert cli.main(["generate", path, "--prompt", "w5 w1 w2 w6", "--max-new-tokens", "3",
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["output"] == templated
    assert cli.main(["generate", path, "--prompt-ids", "1", "--prompt-template", "chat"]) == 2
    assert "--prompt-template applies to --prompt text" in capsys.readouterr().err


def test_engine_from_a_local_directory(tmp_path):
    """InferenceEngine(path): the directory's model (safetensors) and its tokenizer, as
    the guide's engine takes a path; a directory without config.json is refused."""
    model, path = _saved(tmp_path)
    _word_tokenizer().save_pretrained(path)
    cfg = InferenceConfig(dtype=torch.float32, max_input_len=16, max_output_len=4,
                          ignore_eos=True)
    eng = InferenceEngine(path, inference_config=cfg)
    assert eng.tokenizer is not None
    want = model.generate(torch.tensor([[4, 5]]), max_new_tokens=4, do_sample=False)[0, 2:]
    assert eng.generate(prompts=["w1 w2"]) == [eng.tokenizer.decode(want.tolist(),
                                                                     skip_special_tokens=True)]
    with pytest.raises(ml.ConfigError, match="no config.json"):
        InferenceEngine(str(tmp_path), inference_config=cfg)


def test_generate_command_tensor_parallel_under_the_launcher(tmp_path):
    """``meshlab run --nproc-per-node 2 -m meshlab.cli generate``: tp=2 over gloo gives the
    single process's tokens."""
    import json
    import os
    import subprocess
    import sys

    model, path = _saved(tmp_path)
    want = model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=6,
                          do_sample=False)[0, 4:].tolist()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "meshlab.cli", "run", "--nproc-per-node", "2",
                        "-m", "meshlab.cli", "generate", path, "--prompt-ids", "5,6,7,8",
                        "--max-new-tokens", "6", "--json"], capture_output=True, text=True,
                       env=env, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("[{"))
    assert json.loads(line)[0]["output"] == want


def test_paged_attention_op_is_its_reference():
    from meshlab.ops.paged_attention import paged_attention_reference

    g = torch.Generator().manual_seed(1)
    kc, vc = torch.randn(10, 4, 2, 16, generator=g), torch.randn(10, 4, 2, 16, generator=g)
    tables = torch.tensor([[3, 1, 7], [0, 2, 0], [9, 5, 4]], dtype=torch.int32)
    lens, starts = [11, 6, 9], [0, 4, 5, 14]              # 4, 1 and 9 new tokens
    q = torch.randn(14, 8, 16, generator=g)
    torch.testing.assert_close(paged_attention(q, kc, vc, tables, lens, starts),
                               paged_attention_reference(q, kc, vc, tables, lens, starts),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_paged_attention_cpu_kernel_is_its_reference(dtype, tol):
    """The C++ kernel (keys read through the tables) against the reference in float32,
    prefills and decodes of several lengths, grouped-query heads, scattered blocks; the
    gathered-SDPA path with kernels off gives the same."""
    from meshlab.ops import _build
    from meshlab.ops.paged_attention import paged_attention_reference

    g = torch.Generator().manual_seed(2)
    kc = torch.randn(24, 4, 2, 16, generator=g).to(dtype)
    vc = torch.randn(24, 4, 2, 16, generator=g).to(dtype)
    tables = torch.randperm(24, generator=g)[:20].view(4, 5)
    lens, starts = [17, 1, 20, 6], [0, 5, 6, 7, 13]      # 5, 1, 1 and 6 new tokens
    q = torch.randn(13, 6, 16, generator=g).to(dtype)
    out = paged_attention(q, kc, vc, tables, lens, starts, scale=0.3)
    took = _build.LAST_PATH[("paged_attention", "cpu")]
    assert took.native, took.reason
    assert out.dtype == dtype and out.shape == q.shape
    want = paged_attention_reference(*(t.float() for t in (q, kc, vc)), tables, lens, starts,
                                     scale=0.3)
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
    with _build.force_reference():
        sdpa = paged_attention(q, kc, vc, tables, lens, starts, scale=0.3)
    assert not _build.LAST_PATH[("paged_attention", "cpu")].native
    torch.testing.assert_close(out.float(), sdpa.float(), atol=tol, rtol=tol)
    paged_attention(q.double(), kc.double(), vc.double(), tables, lens, starts)
    assert "float64" in _build.LAST_PATH[("paged_attention", "cpu")].reason


def test_cuda_graphs_need_a_gpu_and_one_process():
    with pytest.raises(ml.ConfigError, match="CUDA graphs need it on a GPU"):
        _engine(_tiny(), use_cuda_graph=True)


def _streaming_reference(model, prompt, n, bs, w):
    """transformers' greedy tokens when a generated token at position t attends to the
    first block and to blocks t // bs - w on (the prompt's own tokens: to all before them),
    from whole forwards under that mask: StreamingLLM with ``w`` whole blocks of window."""
    ids = list(prompt)
    for _ in range(n):
        t = torch.arange(len(ids))
        blk = t // bs
        keep = (blk[None, :] == 0) | (blk[None, :] >= blk[:, None] - w)
        allowed = (t[None, :] <= t[:, None]) & (keep | (t < len(prompt))[:, None])
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        logits = model(torch.tensor([ids]), attention_mask=mask[None, None]).logits
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_streamingllm_keeps_the_first_block_and_a_window(family):
    """enable_streamingllm: each request holds the first block and a window of whole blocks
    (generated_token_size tokens, plus the block being filled), the oldest evicted as it
    slides; tokens equal transformers' under the same mask, for prompts shorter and longer
    than the window, with requests joining, eagerly and through the decode graphs' steps
    (uncaptured); the cache holds windows, not budgets."""
    ref = _tiny(family)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (3, 21, 9)]
    new = 30
    want = [_streaming_reference(ref, p, new, 4, 2) for p in prompts]
    cfg = dict(max_batch_size=2, max_input_len=24, max_output_len=new, block_size=4,
               enable_streamingllm=True, start_token_size=4, generated_token_size=8,
               ignore_eos=True)
    eng = _engine(_tiny(family), **cfg)
    assert eng.blocks.n == 2 * 6            # a window of 4 blocks, the longest prompt 6
    assert eng.generate(prompts=prompts, max_new_tokens=new) == want
    ahead, _ = _ahead(_tiny(family), **cfg)
    assert ahead.generate(prompts=prompts, max_new_tokens=new) == want
    plain = _engine(_tiny(family), ignore_eos=True, max_input_len=24, max_output_len=new,
                    block_size=4).generate(prompts=prompts, max_new_tokens=new)
    assert plain != want                    # the window changed what the model saw


def test_streamingllm_refusals():
    for kw, match in ((dict(start_token_size=8, block_size=4), "start_token_size=8"),
                      (dict(generated_token_size=6, block_size=4), "generated_token_size=6"),
                      (dict(beam_width=2), "beam_width=2"),
                      (dict(use_spec_dec=True), "use_spec_dec=True")):
        with pytest.raises(ml.ConfigError, match=re.escape(match)):
            InferenceConfig(enable_streamingllm=True, **kw)


def _ahead(model, **kw):
    """An engine whose decode steps run through ``DecodeGraphs`` uncaptured: the graphs'
    static buffers and the one-step-ahead launches, on the CPU."""
    from meshlab.inference._graphs import DecodeGraphs

    eng = _engine(model, **kw)
    eng.graphs = DecodeGraphs(eng, capture=False)
    reads = []                          # steps launched and not read, at each read
    read = eng.graphs.read
    eng.graphs.read = lambda step: (reads.append(eng.graphs.launched - eng.graphs.read_count),
                                    read(step))[1]
    return eng, reads


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_decode_launched_ahead_gives_generate_tokens(family):
    """Greedy decode steps launched one ahead of the host (a token taken on the device from
    the step before, read a step later): transformers' tokens, with requests of different
    budgets joining and leaving, and a step always launched before the one before it is
    read."""
    ref = _tiny(family)
    prompts, budgets = _prompts(), [8, 3, 6, 1, 8]
    want = [ref.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p):]
            .tolist() for p, n in zip(prompts, budgets)]
    eng, reads = _ahead(_tiny(family), max_batch_size=3)
    rids = [eng.add_request(p, n) for p, n in zip(prompts, budgets)]
    done = {}
    while eng.has_work():
        done.update((r.rid, r.generated) for r in eng.step())
    assert [done[i] for i in rids] == want
    assert max(reads) == 2 and eng.graphs.read_count == eng.graphs.launched
    assert len(eng.blocks.free) == eng.blocks.n and eng.inflight is None
    inorder, reads = _ahead(_tiny(family), max_batch_size=3)
    inorder.launch_ahead = False        # each step read before the next: the same tokens
    keep = [0, 1, 2, 4]                 # the budgets of 3 or more
    assert inorder.generate(prompts=[prompts[i] for i in keep], max_new_tokens=3) == \
        [want[i][:3] for i in keep]
    assert not reads and inorder.graphs.graphs


def test_decode_launched_ahead_stops_at_eos_and_forces_eos():
    """A request that emits EOS at step t has run step t+1 already: that token is dropped
    and its blocks are freed for the next request; forced EOS replaces the last token."""
    ref = _tiny()
    ref.generation_config.eos_token_id = None
    prompts = _prompts()
    free = [ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):]
            .tolist() for p in prompts]
    for eos in dict.fromkeys(t for o in free for t in o[1:6]):   # ends some, not all, early
        ref.generation_config.eos_token_id = eos
        want = [ref.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)
                [0, len(p):].tolist() for p in prompts]
        if any(1 < len(w) < 8 for w in want) and any(len(w) == 8 for w in want):
            break
    else:
        raise AssertionError("no token of the greedy runs ends some of them early")
    model = _tiny()
    model.generation_config.eos_token_id = eos
    eng, reads = _ahead(model, max_batch_size=2)
    assert eng.generate(prompts=prompts, max_new_tokens=8) == want
    assert max(reads) == 2 and len(eng.blocks.free) == eng.blocks.n
    assert eng.past_eos                 # steps ran past an EOS and their tokens were dropped
    forced, _ = _ahead(_tiny(), ignore_eos=True, forced_eos_token_id=5)
    plain = _engine(_tiny(), ignore_eos=True, forced_eos_token_id=5)
    assert forced.generate(prompts=prompts, max_new_tokens=4) == \
        plain.generate(prompts=prompts, max_new_tokens=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_cuda_graph_decoding_equals_eager(family):
    """Decode steps replayed from captured graphs give the eager engine's tokens, with
    requests joining and leaving (buckets 1, 2, 4 padded with scratch rows)."""
    prompts = _prompts()
    want = _engine(_tiny(family).cuda()).generate(prompts=prompts, max_new_tokens=8)
    eng = _engine(_tiny(family).cuda(), use_cuda_graph=True, max_batch_size=3)
    assert eng.generate(prompts=prompts, max_new_tokens=8) == want
    assert eng.graphs.graphs                    # steps ran as graphs
    assert eng.graphs.launched == eng.graphs.read_count > 0    # launched ahead, all read


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2),
                                       (torch.float16, 2e-3)])
def test_paged_attention_triton_kernel_is_its_reference(dtype, tol):
    """Decode batches (a few queries per sequence) run the Triton kernel; grouped heads,
    head dims that are not powers of two and scattered blocks; each query's keys in one
    share or cut into several (flash-decoding, what a small batch gets); a prefill runs
    SDPA."""
    from meshlab.ops import _build, _triton_paged
    from meshlab.ops.paged_attention import layout, paged_attention_reference

    g = torch.Generator().manual_seed(0)
    for hq, hkv, d, bs, m in ((32, 8, 128, 16, (1, 1, 1, 1)), (8, 2, 64, 4, (1, 2, 3, 1)),
                              (6, 6, 80, 16, (1, 1, 1, 1)), (4, 1, 256, 8, (2, 1, 1, 4))):
        lens = [5, 300, 4, 33]
        starts = [0]
        for k in m:
            starts.append(starts[-1] + k)
        width = max(-(-n // bs) for n in lens)
        nb = len(lens) * width + 3
        kc, vc = (torch.randn(nb, bs, hkv, d, generator=g).to(dtype).cuda() for _ in "kv")
        tables = torch.randperm(nb, generator=g)[:len(lens) * width].view(len(lens), width)
        q = torch.randn(starts[-1], hq, d, generator=g).to(dtype).cuda()
        out = paged_attention(q, kc, vc, tables.int().cuda(), lens, starts, scale=0.3)
        assert _build.LAST_PATH[("paged_attention", "cuda")].native
        want = paged_attention_reference(q.float(), kc.float(), vc.float(), tables.cuda(),
                                         lens, starts, scale=0.3)
        torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
        where = layout(tables.cuda(), lens, starts, bs)
        for splits in (1, 3, 64):
            got = _triton_paged.paged_attention_fwd(q, kc, vc, where.tables, where.seq,
                                                    where.keys, 0.3, splits=splits)
            torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    q = torch.randn(40, 32, 128, generator=g).to(dtype).cuda()       # a prefill of 40
    kc, vc = (torch.randn(3, 16, 8, 128, generator=g).to(dtype).cuda() for _ in "kv")
    paged_attention(q, kc, vc, torch.tensor([[2, 0, 1]]).cuda(), [40], [0, 40])
    assert "prefill" in _build.LAST_PATH[("paged_attention", "cuda")].reason


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_greedy_on_cuda_is_argmax_in_one_launch():
    """Greedy's arg-max on CUDA is one Triton launch and equals ``argmax``: the first of
    equal maxima, one row or many, a vocabulary not a multiple of its chunk, a row view;
    replayed from a CUDA graph, its counters back at 0 each time."""
    from meshlab.inference._sampling import greedy
    from meshlab.ops import _build

    g = torch.Generator(device="cuda").manual_seed(0)
    for rows, v, dtype in ((1, 128256, torch.bfloat16), (40, 32000, torch.float32),
                           (3, 151936, torch.bfloat16), (2, 5, torch.float16)):
        x = torch.randn(rows, v + 3, device="cuda", generator=g).to(dtype)[:, 3:]
        x[0, v // 3] = x[0, v - 1] = 60.0          # a tie: the first index wins
        if rows > 1:
            x[-1, :] = 1.0                         # all equal: index 0
        greedy(x)                                  # first call: compiles, makes counters
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
            got = greedy(x)
            torch.cuda.synchronize()
        assert _build.LAST_PATH[("argmax", "cuda")].native
        kernels = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert len(kernels) == 1 and "_argmax" in kernels[0].name
        assert torch.equal(got, x.argmax(-1)) and got[0] == v // 3
        assert rows == 1 or got[-1] == 0
    x = torch.randn(2, 128256, device="cuda", generator=g).to(torch.bfloat16)
    greedy(x)                                      # warm-up, outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = greedy(x)
    for i in range(5):
        x.normal_(generator=g)
        x[1, 1000 * i] = 99.0
        graph.replay()
        assert torch.equal(got, x.argmax(-1)) and got[1] == 1000 * i


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_stores_its_keys_inside_the_attention_launch(dtype):
    """A decode step (one query per sequence) on CUDA stores each query's key and value in
    the attention's own launch (``meshlab::paged_decode``): the caches and the output equal
    a separate cache write and the attention after it, whether a query's keys are one
    share or several, and a step of several queries per sequence keeps the two launches."""
    from meshlab.ops import _triton_paged
    from meshlab.ops.paged_attention import layout, write_and_attend, write_cache

    g = torch.Generator().manual_seed(0)
    hq, hkv, d, bs = 32, 8, 128, 16
    lens = [5, 300, 17, 64, 1]
    width = max(-(-n // bs) for n in lens)
    nb = len(lens) * width + 1
    kc0, vc0 = (torch.randn(nb, bs, hkv, d, generator=g).to(dtype).cuda() for _ in "kv")
    tables = torch.randperm(nb, generator=g)[:len(lens) * width].view(len(lens), width).cuda()
    slots = torch.tensor([int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs
                          for i, n in enumerate(lens)], device="cuda")
    row = torch.randn(len(lens), (hq + 2 * hkv) * d, generator=g).to(dtype).cuda()
    q = row[:, :hq * d].view(-1, hq, d)                 # strided parts of one product
    k = row[:, hq * d:(hq + hkv) * d].view(-1, hkv, d)
    v = row[:, (hq + hkv) * d:].view(-1, hkv, d)
    where = layout(tables, lens, list(range(len(lens) + 1)), bs)
    kw, vw = kc0.clone(), vc0.clone()
    write_cache(kw, vw, slots, k, v)
    for splits in (1, 3, 64):
        want = _triton_paged.paged_attention_fwd(q, kw, vw, where.tables, where.seq,
                                                 where.keys, 0.1, splits=splits)
        kc, vc = kc0.clone(), vc0.clone()
        got = _triton_paged.paged_attention_fwd(q, kc, vc, where.tables, where.seq,
                                                where.keys, 0.1, splits=splits,
                                                new=(k, v, slots))
        assert torch.equal(kc, kw) and torch.equal(vc, vw)
        assert torch.equal(got, want)
    kc, vc = kc0.clone(), vc0.clone()
    got = write_and_attend(q, kc, vc, slots, k, v, where, 0.1)
    assert torch.equal(kc, kw) and torch.equal(vc, vw)
    assert torch.equal(got, _triton_paged.paged_attention_fwd(q, kw, vw, where.tables,
                                                              where.seq, where.keys, 0.1))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        write_and_attend(q, kc0.clone(), vc0.clone(), slots, k, v, where, 0.1)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert not any("_write_kv" in n for n in names) and any("_paged_decode" in n for n in names)
    two = layout(tables[:2], [6, 300], [0, 2, 3], bs)         # two queries in sequence 0
    kc, vc = kc0.clone(), vc0.clone()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        write_and_attend(q[:3], kc, vc, slots[:3], k[:3], v[:3], two, 0.1)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("_write_kv" in n for n in names)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2),
                                       (torch.float16, 2e-3)])
def test_decode_linear_triton_kernel_is_f_linear(dtype, tol, monkeypatch):
    """One row on CUDA runs the Triton matrix-vector kernel (both tile widths, sizes that
    are not multiples of the tiles, a bias, a weight that is a row slice of a larger one,
    a row that is a view, an RMS norm of the row and a residual inside it); several rows
    and the wide gated-MLP shapes stay on cuBLAS."""
    from meshlab.inference._merge import decode_linear
    from meshlab.ops import _build, _triton

    g = torch.Generator().manual_seed(0)
    for n, k, bias in ((2048, 2048, False), (3072, 2048, True), (4099, 1000, True),
                       (1000, 8200, False), (3100, 8200, True), (70, 33, True)):
        w = (torch.randn(n + 5, k, generator=g) * 0.05).to(dtype).cuda()[5:]
        b = torch.randn(n, generator=g).to(dtype).cuda() if bias else None
        x = torch.randn(1, 2, k, generator=g).to(dtype).cuda()[:, 1:]
        got = decode_linear(x, w, b)
        assert _build.LAST_PATH[("decode_linear", "cuda")].native
        assert got.shape == (1, 1, n) and got.dtype == dtype
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        torch.testing.assert_close(got.double(), want, atol=tol * k ** 0.5 / 10, rtol=tol)
    from meshlab.transforms.fuse._hf import Norm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for n, k in ((3072, 2048), (4100, 1000)):       # the norm inside, the residual added
        norm = LlamaRMSNorm(k, eps=1e-5).cuda()
        norm.weight.data = torch.randn(k, generator=g).to(dtype).cuda()
        norm._meshlab_norm = Norm()
        w = (torch.randn(n, k, generator=g) * 0.05).to(dtype).cuda()
        x, r = (torch.randn(1, 1, m, generator=g).to(dtype).cuda() for m in (k, n))
        got = decode_linear(x, w, norm=norm, residual=r)
        xd = x.double()
        xd = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
        want = F.linear(xd, w.double()) + r.double()
        torch.testing.assert_close(got.double(), want, atol=tol * k ** 0.5 / 10, rtol=tol)
    mod = _build.triton_kernels("decode_linear")
    ran = []
    monkeypatch.setattr(mod, "gemv",
                        lambda x, w, b, *rest, **kw: ran.append(x) or F.linear(x, w, b))
    x2 = torch.randn(2, 64, device="cuda", dtype=dtype)
    w2 = torch.randn(16384, 64, device="cuda", dtype=dtype)
    decode_linear(x2, w2[:32])                  # two rows
    assert not ran
    decode_linear(x2[:1], w2)                   # a gated MLP's width: cuBLAS without PDL
    assert len(ran) == (1 if _triton.pdl(x2.device) else 0)
    decode_linear(x2[:1], w2[:32])
    assert len(ran) == (2 if _triton.pdl(x2.device) else 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_meshlab_kernels_under_cuda_graphs_give_the_tokens():
    """use_cuda_kernel with CUDA graphs: transformers' greedy tokens (float32)."""
    ref = _tiny().cuda()
    prompts = _prompts()
    want = [ref.generate(torch.tensor([p]).cuda(), max_new_tokens=8, do_sample=False)
            [0, len(p):].tolist() for p in prompts]
    eng = _engine(_tiny().cuda(), use_cuda_graph=True, use_cuda_kernel=True,
                  max_batch_size=3)
    assert eng.generate(prompts=prompts, max_new_tokens=8) == want


def _row_by_row(logits, histories, force, cfg, gen):
    """The sampling rule one row at a time (transformers' processors in order), as a
    reference for the batched ``choose``."""
    out = []
    for row, seen, forced in zip(logits.float(), histories, force):
        if forced is not None:
            out.append(forced)
            continue
        row = row.clone()
        if cfg.repetition_penalty not in (None, 1.0):
            idx = torch.tensor(sorted(set(seen)))
            got = row[idx]
            row[idx] = torch.where(got < 0, got * cfg.repetition_penalty,
                                   got / cfg.repetition_penalty)
        if not cfg.do_sample:
            out.append(int(row.argmax()))
            continue
        if cfg.temperature not in (None, 1.0):
            row = row / cfg.temperature
        if cfg.top_k:
            row = row.masked_fill(row < torch.topk(row, cfg.top_k).values[-1], float("-inf"))
        if cfg.top_p is not None and cfg.top_p < 1.0:
            srt, order = torch.sort(row, descending=True)
            p = srt.softmax(-1)
            drop = p.cumsum(-1) - p >= cfg.top_p
            row = row.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
        out.append(int(torch.multinomial(row.softmax(-1), 1, generator=gen)))
    return out


@pytest.mark.parametrize("kw", [dict(do_sample=True), dict(do_sample=True, temperature=0.7,
                                                              top_k=20),
                                dict(do_sample=True, top_p=0.8, repetition_penalty=1.3),
                                dict(repetition_penalty=1.3)])
def test_sampling_runs_on_the_whole_batch_and_draws_the_same_tokens(kw):
    """Every row processed at once, no host read per row, the same tokens as row by row
    for the same generator seed (forced rows draw nothing)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshlab.inference import InferenceConfig
    from meshlab.inference._sampling import choose

    class Reads(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Reads.n += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    cfg = InferenceConfig(**kw)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 500, generator=g)
    hist = [torch.randint(0, 500, (n,), generator=g).tolist() for n in range(1, 9)]
    force = [None, 7] + [None] * 6
    want = _row_by_row(logits, hist, force, cfg, torch.Generator().manual_seed(3))
    with Reads():
        got = choose(logits, hist, force, cfg, torch.Generator().manual_seed(3))
    assert got == want and Reads.n == 0
