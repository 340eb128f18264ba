"""Decoding on parallelized models, on real gloo processes, token for token against
transformers' ``generate`` on one process (greedy).

Each case parallelizes a tiny Llama or Qwen2 (tensor parallelism, K/V heads fewer than
tp, ZeRO-3, LoRA under tp, a 2-stage pipeline, and on 4 ranks a pipeline of
tensor-parallel stages), then (a) calls transformers' own ``model.generate`` on a
batch, and (b) serves prompts of mixed lengths through ``meshlab.inference``'s engine with
``max_batch_size`` below the number of requests, so requests wait, join the running batch
while others decode, and leave as they finish; two more join half-way through. Every
output must equal the single process's ``generate`` of that prompt alone. A pipelined
model (pp=2) is served by the engine, its ``generate`` refused; sequence parallelism is
refused for both, with typed errors. Speculative decoding under tp=2 and pp=2 gives the
greedy tokens in fewer steps, and StreamingLLM under both gives transformers' tokens under
its sliding-window mask. Beam search under tp=2 gives transformers'
``generate(num_beams=...)`` of one process, and so does it on a pipelined model. Pipeline
micro-batches (``micro_batch_size=2``) give the same tokens as one process and as the engine
without them, greedy and sampled, and overlap across the stages: with each decoder layer
made 50 ms of work (a hook the test installs), the last stage starts micro-batch 0 of a
decode step before the first stage finishes its last one.
"""

from __future__ import annotations

import pytest
import torch

from tests import _models as M

pytestmark = pytest.mark.timeout(600)

NEW = 10                      # tokens generated per request
LENGTHS = (3, 11, 6, 17, 1, 9)
BUDGETS = (10, 4, 7, 10, 5, 8)  # max_new_tokens per request: they leave at different steps


def _prompts(vocab: int):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _alone(ref, prompts):
    """What one process's ``generate`` gives for each prompt on its own."""
    out = []
    for p in prompts:
        o = ref.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False)
        out.append(o[0, len(p):].tolist())
    return out


def _spec(layout: str):
    import meshlab as ml
    from peft import LoraConfig

    rules = ml.Rules(**M.TP_RULES)
    tp = ml.shard(ml.policies.auto, rules)
    lora = ml.lora(LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                              target_modules=["q_proj", "v_proj", "down_proj"]))
    return {"tp": (tp, dict(tp=2)), "zero3": (ml.zero_shard(3, "dp"), dict(dp=2)),
            "pp": (ml.pipeline("pp", schedule="1f1b", microbatches=2), dict(pp=2)),
            "pp_tp": (ml.pipeline("pp", schedule="1f1b", microbatches=2) | tp, dict(pp=2, tp=2)),
            "lora_tp": (tp | lora, dict(tp=2))}[layout]


def _lora_reference(model, family, kw):
    """peft on one process with the parallelized model's (gathered) weights."""
    from peft import LoraConfig, get_peft_model

    import meshlab as ml

    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                     target_modules=["q_proj", "v_proj", "down_proj"])
    ref = get_peft_model(ml.init_weights(M.build(family, **kw)), cfg)
    own = dict(ref.base_model.model.named_parameters())
    with torch.no_grad():
        for n, p in model.named_parameters():
            own[n].copy_(M.full(p))
    return ref


def serve_case(rank, world, family, layout, kv_heads=2):
    import meshlab as ml
    from meshlab.inference import InferenceConfig, InferenceEngine

    kw = dict(num_key_value_heads=kv_heads)
    spec, mesh = _spec(layout)
    model = ml.parallelize(M.build(family, **kw), spec, ml.Mesh(**mesh), seed=0)
    if layout.startswith("lora"):
        with torch.no_grad():        # adapters that change the output (B starts at zero)
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.add_(0.05)
        ref = _lora_reference(model, family, kw)
    else:
        ref = ml.init_weights(M.build(family, **kw), seed=0)
    ref.eval()
    model.eval()
    prompts = _prompts(ref.config.vocab_size)
    want = _alone(ref, prompts)
    same = [p for p in prompts if len(p) == 6] * 2          # generate on an unpadded batch
    if layout.startswith("pp"):   # a rank holds only its stages: refused, the engine named
        with pytest.raises(ml.ConfigError, match="InferenceEngine"):
            model.generate(torch.tensor(same), max_new_tokens=NEW)
        hf = torch.tensor([[0] * 6 + want[LENGTHS.index(6)]] * 2)
    else:
        hf = model.generate(torch.tensor(same), max_new_tokens=NEW, do_sample=False)
    engine = InferenceEngine(model, inference_config=InferenceConfig(
        dtype=torch.float32, max_batch_size=3, max_input_len=32, max_output_len=NEW,
        block_size=4))
    got, batches = _serve(engine, prompts)
    return {"engine": got, "want": [w[:n] if len(w) > n else w for w, n in zip(want, BUDGETS)],
            "generate": hf[:, 6:].tolist(), "want_generate": [want[LENGTHS.index(6)]] * 2,
            "batches": batches, "stages_in_turn": engine.pipe is not None, "repr": repr(engine)}


def streaming_case(rank, world, family, layout):
    """StreamingLLM under tp=2 or pp=2: transformers' tokens under the sliding-window mask
    of one process (every rank evicts the same blocks of its own layers)."""
    import meshlab as ml
    from meshlab.inference import InferenceConfig, InferenceEngine

    from tests.inference.test_inference import _streaming_reference

    spec, mesh = _spec(layout)
    model = ml.parallelize(M.build(family), spec, ml.Mesh(**mesh), seed=0).eval()
    ref = ml.init_weights(M.build(family), seed=0).eval()
    prompts = _prompts(ref.config.vocab_size)[:3]
    engine = InferenceEngine(model, inference_config=InferenceConfig(
        dtype=torch.float32, max_batch_size=2, max_input_len=32, max_output_len=24,
        block_size=4, enable_streamingllm=True, generated_token_size=8, ignore_eos=True))
    return {"engine": engine.generate(prompts=prompts, max_new_tokens=24),
            "want": [_streaming_reference(ref, p, 24, 4, 2) for p in prompts]}


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_streamingllm_under_tensor_and_pipeline_parallelism(world2, layout):
    out = world2.run(streaming_case, family="llama", layout=layout)
    assert all(o["engine"] == out[0]["engine"] for o in out)
    assert out[0]["engine"] == out[0]["want"]


def _serve(engine, prompts):
    """Four requests, two more arriving at step 3; each one's tokens and every step's batch."""
    ids = [engine.add_request(p, n) for p, n in zip(prompts[:4], BUDGETS)]
    done, batches, start = {}, [], engine.steps
    while engine.has_work():
        if engine.steps - start == 3:        # two more arrive while the first decode
            ids += [engine.add_request(p, n) for p, n in zip(prompts[4:], BUDGETS[4:])]
        for r in engine.step():
            done[r.rid] = r.generated
        batches.append(engine.last_batch)
    return [done[i] for i in ids], batches


def speculate_case(rank, world, family, layout):
    """tp=2 or pp=2 serving with a drafter (the model with noise on its weights, whole on
    every rank): the greedy tokens of one process, in fewer steps."""
    import meshlab as ml
    from meshlab.inference import InferenceConfig, InferenceEngine

    spec, mesh = _spec(layout)
    model = ml.parallelize(M.build(family), spec, ml.Mesh(**mesh), seed=0).eval()
    ref = ml.init_weights(M.build(family), seed=0).eval()
    drafter = ml.init_weights(M.build(family), seed=0).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2 * p.std())
    prompts = _prompts(ref.config.vocab_size)
    want = _alone(ref, prompts)
    engine = InferenceEngine(model, inference_config=InferenceConfig(
        dtype=torch.float32, max_batch_size=3, max_input_len=32, max_output_len=NEW,
        block_size=4, use_spec_dec=True, max_n_spec_tokens=3), drafter_model=drafter)
    got, batches = _serve(engine, prompts)
    counts = engine.spec.accepted, engine.spec.proposed
    engine.disable_spec_dec()
    alone, plain = _serve(engine, prompts)
    return {"engine": got, "plain": alone, "want": [w[:n] for w, n in zip(want, BUDGETS)],
            "steps": len(batches), "plain_steps": len(plain),
            "accepted": counts[0], "proposed": counts[1]}


@pytest.mark.parametrize("family,layout", [("llama", "tp"), ("qwen2", "tp"), ("llama", "pp")])
def test_speculative_decoding_under_tensor_and_pipeline_parallelism(world2, family, layout):
    out = world2.run(speculate_case, family=family, layout=layout)
    assert all(o["engine"] == out[0]["engine"] for o in out)
    o = out[0]
    assert o["engine"] == o["want"] == o["plain"], (o["engine"], o["want"])
    assert 0 < o["accepted"] < o["proposed"] and o["steps"] < o["plain_steps"]

@pytest.mark.parametrize("family,layout,kv_heads", [
    ("llama", "tp", 2), ("qwen2", "tp", 2), ("qwen2", "tp", 1), ("llama", "zero3", 2),
    ("llama", "lora_tp", 2), ("llama", "pp", 2), ("qwen2", "pp", 2)])
def test_decoding_matches_one_process(world2, family, layout, kv_heads):
    out = world2.run(serve_case, family=family, layout=layout, kv_heads=kv_heads)
    assert all(o["engine"] == out[0]["engine"] for o in out)     # every rank the same
    o = out[0]
    assert o["generate"] == o["want_generate"]
    assert o["stages_in_turn"] == layout.startswith("pp")
    assert "parallelized over Mesh(" in o["repr"]
    assert ("pipelined" in o["repr"]) == layout.startswith("pp")
    assert o["engine"] == o["want"], (o["engine"], o["want"])
    # continuous batching: at most 3 at a time; some step ran a request that joined
    # while others were decoding, and one where a request had left and others went on
    b = [set(x) for x in o["batches"]]
    assert max(map(len, b)) == 3 and NEW < len(b) < sum(BUDGETS)
    assert any((now - before) and (now & before) for before, now in zip(b, b[1:]))
    assert any((before - now) and (now & before) for before, now in zip(b, b[1:]))

def beam_case(rank, world, family):
    """tp=2 beam search (widths 2 and 3, both early_stopping), requests joining between
    steps: transformers' generate(num_beams=...) of each prompt alone on one process. And
    the same on a pipelined model (pp=2, width 2): the last stage's candidates broadcast,
    every rank copying the blocks of its own layers."""
    import meshlab as ml
    from meshlab.inference import InferenceConfig, InferenceEngine

    from tests.inference.test_inference import _beam_setup, _hf, _serve_beams

    ref, _, prompts = _beam_setup(family, torch.float32)     # EOS ending hypotheses early
    spec, mesh = _spec("tp")
    model = ml.parallelize(M.build(family), spec, ml.Mesh(**mesh), seed=0).eval()
    model.generation_config.eos_token_id = ref.generation_config.eos_token_id
    out = {"engine": [], "want": [], "copied": []}
    for w, es in ((2, False), (3, True)):
        engine = InferenceEngine(model, inference_config=InferenceConfig(
            dtype=torch.float32, max_batch_size=2 * w, max_input_len=16, max_output_len=10,
            block_size=4, beam_width=w, early_stopping=es))
        got, _ = _serve_beams(engine, prompts, [10, 4, 7, 10, 6], late=2)
        out["engine"].append(got)
        out["want"].append([_hf(ref, p, w, es, n) for p, n in zip(prompts, [10, 4, 7, 10, 6])])
        out["copied"].append(engine.cache.copied)
    spec, mesh = _spec("pp")
    piped = ml.parallelize(M.build(family), spec, ml.Mesh(**mesh), seed=0).eval()
    piped.generation_config.eos_token_id = ref.generation_config.eos_token_id
    engine = InferenceEngine(piped, inference_config=InferenceConfig(
        dtype=torch.float32, max_batch_size=4, max_input_len=16, max_output_len=10,
        block_size=4, beam_width=2))
    out["pipeline"], _ = _serve_beams(engine, prompts, [10, 4, 7, 10, 6], late=2)
    out["pipeline_copied"] = engine.cache.copied
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_beam_search_under_tensor_parallelism(world2, family):
    out = world2.run(beam_case, family=family)
    assert all(o["engine"] == out[0]["engine"] for o in out)     # every rank the same
    o = out[0]
    assert o["engine"] == o["want"], (o["engine"], o["want"])
    assert all(o["copied"])
    assert o["pipeline"] == o["want"][0], (o["pipeline"], o["want"][0])
    assert all(r["pipeline_copied"] for r in out)   # each stage's rank forked its own blocks


def refuse_case(rank, world):
    import meshlab as ml
    from meshlab.inference import InferenceConfig, InferenceEngine

    spec = ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES) | ml.Rules(seq="tp"))
    model = ml.parallelize(M.build("llama"), spec, ml.Mesh(tp=2), seed=0)
    errors = []
    try:
        InferenceEngine(model, inference_config=InferenceConfig(dtype=torch.float32))
    except ml.ConfigError as e:
        errors.append(str(e))
    try:
        model.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=2)
    except ml.ConfigError as e:
        errors.append(str(e))
    return errors


def test_sequence_parallel_decoding_is_refused(world2):
    (engine, generate), _ = world2.run(refuse_case)
    assert "sequence parallelism" in engine
    assert "generate under sequence parallelism" in generate


def test_pipeline_with_tensor_parallel_stages_matches_one_process(world4):
    """pp=2 x tp=2: each stage tensor-parallel, its K/V heads cached per rank."""
    out = world4.run(serve_case, family="llama", layout="pp_tp")
    assert all(o["engine"] == out[0]["engine"] for o in out)
    assert out[0]["stages_in_turn"] and out[0]["engine"] == out[0]["want"]


def micro_case(rank, world, family):
    """pp=2 with micro-batches of 2 requests (5 prompts, at most 4 running, the fifth
    joining once one leaves): greedy, the single process's tokens and the engine's own
    without micro-batches; sampled, the same tokens with and without."""
    import meshlab as ml
    from meshlab.inference import InferenceConfig, InferenceEngine

    spec, mesh = _spec("pp")
    model = ml.parallelize(M.build(family), spec, ml.Mesh(**mesh), seed=0).eval()
    ref = ml.init_weights(M.build(family), seed=0).eval()
    prompts = _prompts(ref.config.vocab_size)[:5]
    out = {"want": [w[:n] for w, n in zip(_alone(ref, prompts), BUDGETS)]}
    for sample in (False, True):
        for k in (2, 1):
            engine = InferenceEngine(model, inference_config=InferenceConfig(
                dtype=torch.float32, max_batch_size=4, max_input_len=32, max_output_len=NEW,
                block_size=4, micro_batch_size=k, do_sample=sample, top_k=None, seed=3))
            out[sample, k], batches = _serve(engine, prompts)
            out["batches", sample, k] = batches
    out["buffer"], out["in_flight"] = _bounded(model, prompts)
    return out


def _bounded(model, prompts):
    """Greedy with micro_batch_buffer_size=1: the tokens, and the most sends in flight."""
    import torch.distributed as dist

    from meshlab.inference import InferenceConfig, InferenceEngine

    live, most, isend = set(), [0], dist.isend

    class Watched:
        def __init__(self, work):
            self.work = work
            live.add(self)
            most[0] = max(most[0], len(live))

        def wait(self):
            self.work.wait()
            live.discard(self)

    dist.isend = lambda *a, **k: Watched(isend(*a, **k))
    try:
        engine = InferenceEngine(model, inference_config=InferenceConfig(
            dtype=torch.float32, max_batch_size=4, max_input_len=32, max_output_len=NEW,
            block_size=4, micro_batch_size=2, micro_batch_buffer_size=1))
        tokens, _ = _serve(engine, prompts)
    finally:
        dist.isend = isend
    return tokens, most[0]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_pipeline_micro_batches_match_one_process(world2, family):
    out = world2.run(micro_case, family=family)
    assert all(o[False, 2] == out[0][False, 2] for o in out)     # every rank the same
    o = out[0]
    assert o[False, 2] == o["want"] == o[False, 1] == o["buffer"], (o[False, 2], o["want"])
    # two micro-batches a step: the first stage's rank holds at most one send in flight
    assert sorted(x["in_flight"] for x in out) == [0, 1], [x["in_flight"] for x in out]
    assert o[True, 2] == o[True, 1] != o[False, 2]
    b = [set(x) for x in o["batches", False, 2]]
    assert max(map(len, b)) == 4 and 3 in map(len, b) and any(4 in x for x in b)


def overlap_case(rank, world):
    """One decode step of 6 requests in micro-batches of 2 on pp=2, each decoder layer
    made 50 ms of work: each rank's (start, end) of its stage's compute per micro-batch."""
    import time

    import torch.distributed as dist

    import meshlab as ml
    from meshlab.inference import InferenceConfig, InferenceEngine

    spec, mesh = _spec("pp")
    model = ml.parallelize(M.build("llama"), spec, ml.Mesh(**mesh), seed=0).eval()
    engine = InferenceEngine(model, inference_config=InferenceConfig(
        dtype=torch.float32, max_batch_size=6, max_input_len=32, max_output_len=NEW,
        block_size=4, micro_batch_size=2))
    for p in _prompts(model.config.vocab_size):
        engine.add_request(p, NEW)
    engine.step()                                   # the prompts' prefill
    times, pipe = [], engine.pipe
    layers = [m.layers[str(i)] for m in pipe.mine.values() for i in m.layer_ids]
    hooks = [layers[0].register_forward_pre_hook(lambda m, a: times.append([time.time()]))]
    hooks += [x.register_forward_hook(lambda m, a, o: time.sleep(0.05)) for x in layers]
    hooks.append(layers[-1].register_forward_hook(lambda m, a, o: times[-1].append(time.time())))
    engine.step()                                   # every request decodes one token
    for h in hooks:
        h.remove()
    mine = [s for s in pipe.all if s.rank == pipe.me]
    every = [None] * world
    dist.all_gather_object(every, (mine[0].first, mine[-1].last, times))
    return every


def test_pipeline_micro_batches_overlap_across_stages(world2):
    every = world2.run(overlap_case)[0]
    first = next(t for f, _, t in every if f)
    last = next(t for _, la, t in every if la)
    assert len(first) == len(last) == 3
    # the last stage started micro-batch 0 while the first still computed the others
    assert last[0][0] < first[-1][1], (first, last)


def test_micro_batch_size_refusals():
    import meshlab as ml
    from meshlab.inference import InferenceConfig, InferenceEngine

    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ml.ConfigError, match=r"InferenceConfig\(micro_batch_size="):
            InferenceConfig(micro_batch_size=bad)
    with pytest.raises(ml.ConfigError, match=r"micro_batch_size=2, use_spec_dec=True"):
        InferenceConfig(micro_batch_size=2, use_spec_dec=True)
    with pytest.raises(ml.ConfigError, match=r"micro_batch_size=2, beam_width=2"):
        InferenceConfig(micro_batch_size=2, beam_width=2)
    with pytest.raises(ml.ConfigError, match=r"micro_batch_buffer_size=2\) bounds"):
        InferenceConfig(micro_batch_buffer_size=2)
    for bad in (0, 1.5, True):
        with pytest.raises(ml.ConfigError, match=r"micro_batch_buffer_size="):
            InferenceConfig(micro_batch_size=2, micro_batch_buffer_size=bad)
    with pytest.raises(ml.ConfigError, match=r"micro_batch_size=2\) on a model that is not "
                                             r"pipelined"):
        InferenceEngine(M.build("llama"), inference_config=InferenceConfig(
            dtype=torch.float32, micro_batch_size=2))


# -- the ranks serve the same requests, or every rank raises ----------------------------------
def divergent_case(rank, world, what, layout):
    """Under tp=2 (or pp=2), rank 1's requests or sampling differ from rank 0's in one way."""
    import meshlab as ml
    from meshlab.inference import InferenceConfig, InferenceEngine

    spec, mesh = _spec(layout)
    model = ml.parallelize(M.build("llama"), spec, ml.Mesh(**mesh), seed=0).eval()
    odd = rank == 1
    cfg = dict(dtype=torch.float32, max_batch_size=3, max_input_len=32, max_output_len=NEW,
               block_size=4, ignore_eos=True)
    if what == "sampling seed":
        cfg.update(do_sample=True, seed=1 if odd else 0)
    if what == "temperature":
        cfg.update(do_sample=True, temperature=0.5 if odd else 1.0)
    engine = InferenceEngine(model, inference_config=InferenceConfig(**cfg))
    prompts, budgets = [[5, 9, 11, 2], [7, 3]], [NEW, NEW]
    if odd and what == "tokens":
        prompts[0] = [5, 9, 12, 2]              # the same length, one other token
    if odd and what == "prompt length":
        prompts[0] = [5, 9, 11, 2, 4]
    if odd and what == "request count":
        prompts, budgets = prompts[:1], budgets[:1]
    if odd and what == "max_new_tokens":
        budgets[1] = NEW - 3
    try:
        for p, n in zip(prompts, budgets):
            engine.add_request(p, n)
        while engine.has_work():
            engine.step()
    except ml.MeshlabError as e:
        return type(e).__name__, str(e), engine.steps
    return None, "", engine.steps


@pytest.mark.parametrize("what,words", [
    ("tokens", "requests added"), ("prompt length", "requests added"),
    ("request count", "requests added"), ("max_new_tokens", "requests added"),
    ("sampling seed", "InferenceConfig.seed"), ("temperature", "InferenceConfig.temperature"),
])
@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_ranks_serving_different_requests_fail_before_the_first_collective(world2, what,
                                                                          words, layout):
    out = world2.run(divergent_case, what=what, layout=layout, timeout=120)
    for kind, msg, steps in out:
        assert kind == "RankMismatchError", (kind, msg)
        assert words in msg and "ranks [1]" in msg and "ranks [0]" in msg, msg
        assert "same requests" in msg, msg
        assert steps == 0                      # nothing ran


def forced_eos_case(rank, world, token):
    import meshlab as ml
    from meshlab.inference import InferenceConfig, InferenceEngine

    model = ml.parallelize(M.build("llama"), _spec("tp")[0], ml.Mesh(tp=2), seed=0).eval()
    try:
        InferenceEngine(model, inference_config=InferenceConfig(
            dtype=torch.float32, max_batch_size=2, max_input_len=16, max_output_len=4,
            block_size=4, ignore_eos=True, forced_eos_token_id=token))
    except ml.ConfigError as e:
        return str(e)
    return None


def test_a_forced_eos_outside_the_vocabulary_is_refused(world2):
    for msg in world2.run(forced_eos_case, token=10 ** 6):
        assert msg is not None and "forced_eos_token_id=1000000" in msg and "0..96" in msg, msg
    assert world2.run(forced_eos_case, token=96) == [None, None]
