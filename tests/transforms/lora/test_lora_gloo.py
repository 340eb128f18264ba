"""``lora`` on real gloo ranks against single-process peft on the same model.

* DP, ZeRO-1, ZeRO-3 and pp=2 on 2 ranks, ZeRO-3 over 4, with and without
  ``modules_to_save``: the loss of every step and the adapter weights after three AdamW
  steps equal single-process peft's (started from the same weights); the base weights do
  not change by a bit, and hold no gradient or optimizer state.
* Memory: gradient and optimizer bytes per rank are the adapters' share alone, as
  ``plan.memory()`` says.
* Round trips: ``save_adapter`` -> ``PeftModel.from_pretrained`` on one process gives the
  same logits; ``save_merged`` -> ``AutoModelForCausalLM.from_pretrained`` too;
  ``load_adapter`` reads an adapter back into a parallelized model.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests import _models as M

pytest.importorskip("peft")
pytestmark = pytest.mark.timeout(900)
LR = 1e-2


def _config(save: bool, default_targets: bool = False):
    """``default_targets``: no target_modules, peft's defaults for the model type."""
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                      target_modules=None if default_targets else ["q_proj", "v_proj",
                                                                    "down_proj"],
                      modules_to_save=["lm_head"] if save else None)


def _spec(layout: str, cfg):
    import meshlab as ml

    lo = ml.lora(cfg)
    return {"dp": (lo | ml.data_parallel("dp"), dict(dp=2)),
            "zero1": (lo | ml.zero_shard(1, "dp"), dict(dp=2)),
            "zero2": (lo | ml.zero_shard(2, "dp"), dict(dp=2)),
            "zero3": (lo | ml.zero_shard(3, "dp"), dict(dp=2)),
            "bf16": (lo | ml.precision("bf16") | ml.data_parallel("dp"), dict(dp=2)),
            "zero3_w4": (lo | ml.zero_shard(3, "dp"), dict(dp=4)),
            "pp2": (lo | ml.pipeline("pp", schedule="1f1b", microbatches=2), dict(pp=2)),
            "tp2": (ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES)) | lo, dict(tp=2)),
            "tp_zero3": (ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES)) | lo
                         | ml.zero_shard(3, "dp"), dict(dp=2, tp=2))}[layout]


def _reference(model, cfg):
    """Single-process peft on the weights the parallelized model starts from (every
    pipeline stage's, gathered)."""
    import torch.distributed as dist
    from peft import get_peft_model

    import meshlab as ml

    mine = {n: M.full(p).detach().clone() for n, p in model.named_parameters()}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    start = {n: t for part in parts for n, t in part.items()}
    ref = get_peft_model(ml.init_weights(M.build("llama", **LAYERS)), cfg)
    own = dict(ref.base_model.model.named_parameters())
    with torch.no_grad():
        for n, t in start.items():
            own[n].copy_(t)
    return ref, start


LAYERS = dict(num_hidden_layers=4)


def parity_case(rank, world, layout, save, bf16=False, default_targets=False):
    import torch.distributed as dist

    import meshlab as ml

    cfg = _config(save, default_targets)
    spec, mesh = _spec(layout, cfg)
    model = ml.parallelize(M.build("llama", **LAYERS), spec, ml.Mesh(**mesh), seed=0)
    ref, gathered = _reference(model, cfg)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=LR)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR)
    rt = model._meshlab
    r = dist.get_rank(rt.dp_group) if rt.dp_group is not None else 0
    data = M.batches(3, batch=4)
    got, want = [], []
    for b in data:
        got.append(ml.step(model, opt, {"input_ids": b.chunk(rt.dp_size)[r]}))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = M.loss_fn("llama")(ref(input_ids=b), {"input_ids": b, "labels": b})
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want.append(float(loss))
    refp = dict(ref.base_model.model.named_parameters())
    trainable, frozen_same, changed = 0, True, 0
    for n, p in model.named_parameters():
        w = M.full(p).detach()
        if p.requires_grad:
            trainable += 1
            torch.testing.assert_close(w, refp[n].detach(), atol=3e-2 if bf16 else 1e-5,
                                       rtol=1.0 if bf16 else 1e-4,
                                       msg=lambda m, n=n: f"{n}: {m}")
            changed += not torch.equal(w, gathered[n])
        else:
            frozen_same &= torch.equal(w, gathered[n]) and p.grad is None
    grads = sum(p.grad is not None for p in model.parameters() if not p.requires_grad)
    est = rt.plan.memory()
    from meshlab.core.tensors import local

    state_bytes = sum(local(v).numel() * v.element_size() for st in opt.state.values()
                      for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return dict(got=got, want=want, trainable=trainable, changed=changed,
                frozen_same=frozen_same, frozen_grads=grads,
                state_bytes=state_bytes, opt_bytes=est.optimizer, grad_bytes=est.grads,
                adapter_bytes=sum(e.numel * 4 for e in rt.plan.params if e.requires_grad
                                  and e.tied_to is None))


def _check(results, layout):
    for r in results:
        torch.testing.assert_close(r["got"], r["want"], atol=1e-5, rtol=1e-4)
        assert r["frozen_same"] and r["frozen_grads"] == 0, r
        assert r["trainable"] > 0 and r["changed"] == r["trainable"], r
        # the gradients hold the adapters' share alone (ZeRO-1: whole, plus the fp32
        # slice of the reduced ones; ZeRO-3: sharded)
        a = r["adapter_bytes"]
        want = {"dp": a, "zero1": a * 1.5, "zero2": a / 2, "zero3": a / 2,
                "zero3_w4": a / 4}.get(layout)
        if want is not None:
            assert abs(r["grad_bytes"] - want) <= 0.15 * want, (r, want)
        # the optimizer's state, measured: AdamW's two moments of this rank's adapters
        # (ZeRO-1: of its fp32 slices), as plan.memory() counts them
        # (under a pipeline the plan counts the heaviest stage's rank: the most any holds)
        held = max(x["state_bytes"] for x in results) if layout == "pp2" else r["state_bytes"]
        moments = r["opt_bytes"] * (2 / 3 if layout == "zero1" else 1)   # ZeRO-1: + master
        assert abs(held - moments) <= 0.15 * moments, (r, held)


@pytest.mark.parametrize("layout", ["dp", "zero1", "zero2", "zero3", "pp2"])
@pytest.mark.parametrize("save", [False, True])
def test_lora_matches_single_process_peft(world2, layout, save):
    _check(world2.run(parity_case, layout=layout, save=save), layout)


def test_lora_under_bf16(world2):
    # bf16 rounding follows the order of operations: losses within 2e-2 of single-process
    # peft under autocast; adapters after three steps within 3e-2 (AdamW moves a weight
    # by up to the learning rate, 1e-2, a step, whatever the gradient's size)
    for r in world2.run(parity_case, layout="bf16", save=False, bf16=True):
        torch.testing.assert_close(r["got"], r["want"], atol=2e-2, rtol=1e-2)
        assert r["frozen_same"] and r["frozen_grads"] == 0


def test_lora_zero3_on_4_ranks(world4):
    _check(world4.run(parity_case, layout="zero3_w4", save=True), "zero3_w4")


@pytest.mark.parametrize("save", [False, True])
def test_lora_under_tensor_parallelism(world2, save):
    _check(world2.run(parity_case, layout="tp2", save=save), "tp2")


def test_lora_under_tp_and_zero3(world4):
    _check(world4.run(parity_case, layout="tp_zero3", save=True), "tp_zero3")


# -- round trips ----------------------------------------------------------------------------
def export_case(rank, world, directory):
    import meshlab as ml

    cfg = _config(True)
    spec, mesh = _spec("zero3", cfg)
    model = ml.parallelize(M.build("llama", **LAYERS), spec, ml.Mesh(**mesh), seed=0)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=LR)
    b = M.batches(1, batch=4)[0]
    ml.step(model, opt, {"input_ids": b.chunk(world)[rank]})
    ml.save_adapter(os.path.join(directory, "adapter"), model)
    ml.save_merged(os.path.join(directory, "merged"), model)
    full = {n: M.full(p).detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():                        # every rank the same tokens
        logits = model(input_ids=M.batches(1, batch=2, seed=3)[0]).logits.detach().clone()
    # a fresh parallelized model takes the adapter back
    model2 = ml.parallelize(M.build("llama", **LAYERS), spec, ml.Mesh(**mesh), seed=5)
    ml.load_adapter(os.path.join(directory, "adapter"), model2)
    back = {n: M.full(p).detach() for n, p in model2.named_parameters()}
    same = all(torch.equal(back[n], full[n]) for n in full if ".lora_" in n or
               ".modules_to_save." in n)
    return full, same, logits


def test_exports_load_in_peft_and_transformers(world2, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import meshlab as ml

    (full, same, logits), _ = world2.run(export_case, directory=str(tmp_path))
    assert same
    base = ml.init_weights(M.build("llama", **LAYERS))
    with torch.no_grad():                      # the frozen base the adapters were trained on
        own = dict(base.named_parameters())
        for n, t in full.items():
            key = n.replace(".base_layer.", ".").replace(".original_module.", ".")
            if ".lora_" not in n and ".modules_to_save." not in n:
                own[key].copy_(t)
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    x = M.batches(1, batch=2, seed=3)[0]
    peft_model.eval()
    merged.eval()
    with torch.no_grad():
        a = peft_model(input_ids=x).logits
        b = merged(input_ids=x).logits
    # the trained, parallelized model's logits, from the adapter and from the merged model
    torch.testing.assert_close(a, logits, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(b, logits, atol=1e-4, rtol=1e-4)
    trained = dict(peft_model.base_model.model.named_parameters())
    for n, t in full.items():
        if ".lora_" in n or ".modules_to_save." in n:
            assert torch.equal(trained[n], t), n


def test_plan_memory_counts_the_adapters_alone():
    import meshlab as ml

    cfg = _config(False)
    plain = ml.plan(M.build("llama", **LAYERS), ml.data_parallel("dp"),
                    ml.Mesh(dp=2, fake=True)).memory()
    p = ml.plan(M.build("llama", **LAYERS), ml.lora(cfg) | ml.data_parallel("dp"),
                ml.Mesh(dp=2, fake=True))
    est = p.memory()
    adapters = sum(e.numel * 4 for e in p.params if e.requires_grad)
    assert est.grads == adapters and est.optimizer == 2 * adapters
    assert est.params == plain.params + adapters
    assert {e.fqn for e in p.params if e.requires_grad} == {
        e.fqn for e in p.params if ".lora_" in e.fqn}


def test_peft_default_targets_match_single_process_peft(world2):
    """A LoraConfig without target_modules (as Colossal-AI's LoRA test and ColossalChat's
    lora_finetune.py write it) takes the modules peft picks for the model type, q_proj and
    v_proj for Llama, and trains as get_peft_model with the same config on one process."""
    results = world2.run(parity_case, layout="dp", save=False, default_targets=True)
    _check(results, "dp")
    assert all(r["trainable"] == 2 * 2 * LAYERS["num_hidden_layers"] for r in results), results


def test_peft_default_targets_in_the_plan():
    import meshlab as ml
    from peft import LoraConfig

    plan = ml.plan(M.build("llama"), ml.lora(LoraConfig(r=2)), ml.Mesh(dp=1, fake=True))
    wrapped = {e.fqn.rsplit(".", 3)[0].rsplit(".", 1)[1] for e in plan.params
               if ".lora_A." in e.fqn}
    assert wrapped == {"q_proj", "v_proj"}, wrapped
    assert "peft's for the model type" in repr(plan.options[0])
    with pytest.raises(ml.ConfigError, match="peft has no defaults for model type "
                                             "'qwen3_moe'"):
        ml.plan(M.build("qwen3_moe"), ml.lora(LoraConfig(r=2)), ml.Mesh(dp=1, fake=True))


def test_refusals_name_the_fix():
    import meshlab as ml
    from peft import LoraConfig

    with pytest.raises(ml.ConfigError, match="match no module"):
        ml.plan(M.build("llama"), ml.lora(LoraConfig(target_modules=["nope"])),
                ml.Mesh(dp=1, fake=True))
    with pytest.raises(ml.ConfigError, match="not a Linear"):
        ml.plan(M.build("llama"), ml.lora(LoraConfig(target_modules=["embed_tokens"])),
                ml.Mesh(dp=1, fake=True))
    with pytest.raises(ml.ConfigError, match="LoraConfig"):
        ml.lora("q_proj")
    with pytest.raises(ml.ConfigError, match="rank_pattern"):     # per-module ranks: unplanned
        ml.lora(LoraConfig(target_modules=["q_proj"], rank_pattern={"q_proj": 8}))
    with pytest.raises(ml.ConfigError):           # the policy would not see the model
        ml.plan(M.build("llama"), ml.lora(LoraConfig(target_modules=["q_proj"]))
                | ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES)), ml.Mesh(tp=2, fake=True))


def merge_case(rank, world, layout):
    """Merging on the sharded model gives the same logits without the adapters' path;
    unmerging gives the base weights back (within float32 rounding)."""
    import meshlab as ml

    spec, mesh = _spec(layout, _config(False))
    model = ml.parallelize(M.build("llama", **LAYERS), spec, ml.Mesh(**mesh), seed=0)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=LR)
    b = M.batches(1, batch=4)[0]
    ml.step(model, opt, {"input_ids": b.chunk(world)[rank]})     # B is no longer zero
    x = M.batches(1, batch=2, seed=3)[0]
    base = {n: M.full(p).detach().clone() for n, p in model.named_parameters()
            if ".base_layer." in n}
    with torch.no_grad():
        before = model(input_ids=x).logits
        layers = ml.merge_adapters(model)
        merged = model(input_ids=x).logits
        changed = sum(not torch.equal(M.full(p), base[n]) for n, p in model.named_parameters()
                      if n in base)
        ml.unmerge_adapters(model)
        after = model(input_ids=x).logits
    back = max(float((M.full(p) - base[n]).abs().max()) for n, p in model.named_parameters()
               if n in base)
    return layers, changed, float((merged - before).abs().max()), \
        float((after - before).abs().max()), back


@pytest.mark.parametrize("layout", ["dp", "zero3"])
def test_merge_and_unmerge_on_the_sharded_model(world2, layout):
    for layers, changed, merged, after, back in world2.run(merge_case, layout=layout):
        assert layers == 3 * LAYERS["num_hidden_layers"] and changed == layers
        assert merged < 1e-5 and after < 1e-5 and back < 1e-6


def test_without_peft_the_error_names_the_install(monkeypatch):
    import sys

    import meshlab as ml

    monkeypatch.setitem(sys.modules, "peft", None)          # import peft now fails
    with pytest.raises(ml.ConfigError, match=r"pip install 'meshlab\[lora\]'"):
        ml.lora(r=4, target_modules=["q_proj"])


# -- load_adapter checks what it reads -------------------------------------------------------
def _caught(fn):
    import meshlab as ml

    try:
        fn()
    except ml.MeshlabError as e:
        return type(e).__name__, str(e)
    return None


def adapter_checks_case(rank, world, directory):
    """An adapter saved with alpha 64 and rslora is refused by an alpha-8 model (both
    values named); a flipped bit, a tensor the model lacks and a foreign adapter's
    config are caught before any weight is written; what fits loads."""
    import shutil

    import torch.distributed as dist
    from peft import LoraConfig
    from safetensors.torch import load_file, save_file

    import meshlab as ml

    targets = ["q_proj", "v_proj", "down_proj"]
    big = LoraConfig(r=4, lora_alpha=64, use_rslora=True, lora_dropout=0.0,
                     target_modules=targets)
    small = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets)

    def build(cfg, seed):
        spec, mesh = _spec("zero3", cfg)
        return ml.parallelize(M.build("llama", **LAYERS), spec, ml.Mesh(**mesh), seed=seed)

    src = build(big, 0)
    opt = ml.optimizer(src, torch.optim.AdamW, lr=LR)
    ml.step(src, opt, {"input_ids": M.batches(1, batch=4)[0].chunk(world)[rank]})
    path = os.path.join(directory, "adapter")
    ml.save_adapter(path, src)
    saved = {n: M.full(p).detach().clone() for n, p in src.named_parameters() if ".lora_" in n}
    out = {}
    other = build(small, 5)
    before = {n: M.full(p).detach().clone() for n, p in other.named_parameters()}
    out["alpha"] = _caught(lambda: ml.load_adapter(path, other))
    out["untouched"] = all(torch.equal(M.full(p), before[n]) for n, p in other.named_parameters())
    flipped, foreign = os.path.join(directory, "flipped"), os.path.join(directory, "foreign")
    if rank == 0:
        shutil.copytree(path, flipped)
        data = bytearray(open(os.path.join(flipped, "adapter_model.safetensors"), "rb").read())
        data[-3] ^= 0x10
        open(os.path.join(flipped, "adapter_model.safetensors"), "wb").write(bytes(data))
        shutil.copytree(path, foreign)           # as peft writes one: no manifest
        if os.path.exists(os.path.join(foreign, "meshlab.manifest.json")):
            os.remove(os.path.join(foreign, "meshlab.manifest.json"))
    dist.barrier()
    same = build(big, 5)
    out["flip"] = _caught(lambda: ml.load_adapter(flipped, same))
    out["foreign_alpha"] = _caught(lambda: ml.load_adapter(foreign, other))
    ml.load_adapter(foreign, same)               # a foreign adapter of this config loads
    out["loaded"] = all(torch.equal(M.full(p), saved[n]) for n, p in same.named_parameters()
                        if ".lora_" in n)
    dist.barrier()
    if rank == 0:
        tensors = load_file(os.path.join(foreign, "adapter_model.safetensors"))
        tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 32)
        save_file(tensors, os.path.join(foreign, "adapter_model.safetensors"))
    dist.barrier()
    out["unexpected"] = _caught(lambda: ml.load_adapter(foreign, same))
    return out


def test_load_adapter_checks_config_keys_and_bits(world2, tmp_path):
    for out in world2.run(adapter_checks_case, directory=str(tmp_path)):
        assert out["alpha"] is not None, "an alpha-64 rslora adapter loaded into alpha 8"
        cls, msg = out["alpha"]
        assert cls in ("AdapterConfigError", "CheckpointPeerError"), (cls, msg)
        assert "lora_alpha=64" in msg and "lora_alpha=8" in msg, msg
        assert out["untouched"]
        assert "adapter_model.safetensors is damaged: its SHA-256" in out["flip"][1], out
        assert "lora_alpha=64" in out["foreign_alpha"][1], out
        assert out["loaded"]
        assert "base_model.model.lm_head.lora_A.weight" in out["unexpected"][1], out


def merged_float64_case(rank, world):
    """A float64 model's merged weights are ``W + scale * B @ A`` in float64."""
    import meshlab as ml
    from meshlab.checkpoint.adapters import merged_state

    torch.set_default_dtype(torch.float64)
    try:
        cfg = _config(save=False)
        model = ml.parallelize(M.build("llama"), _spec("dp", cfg)[0], ml.Mesh(dp=2), seed=0)
        with torch.no_grad():          # adapters away from their zero start
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
        named = {n: M.full(p).detach() for n, p in model.named_parameters()}
        merged = merged_state(model)
        if rank != 0:
            return 0.0
        worst = 0.0
        for n, w in named.items():
            if not n.endswith(".base_layer.weight"):
                continue
            mod = n[:-len(".base_layer.weight")]
            want = w + (cfg.lora_alpha / cfg.r) * (named[f"{mod}.lora_B.default.weight"] @
                                                   named[f"{mod}.lora_A.default.weight"])
            key = next(k for k in merged if k.endswith(mod.split("model.", 1)[-1] + ".weight"))
            worst = max(worst, float((merged[key] - want).abs().max() / want.abs().max()))
        return worst
    finally:
        torch.set_default_dtype(torch.float32)


def test_merged_state_of_a_float64_model_is_float64(world2):
    """It went through float32 (6e-9 off peft's merge_and_unload in float64)."""
    worst, _ = world2.run(merged_float64_case)
    assert worst < 1e-14, worst


def tp_merge_case(rank, world):
    """Under tensor parallelism peft's merge multiplied a plain A by a split B (or the
    other way round): torch's untyped "mixed torch.Tensor and DTensor" error. Now refused
    by name, before any layer changes, naming save_merged; save_merged itself gathers."""
    import meshlab as ml

    spec, mesh = _spec("tp2", _config(False))
    model = ml.parallelize(M.build("llama", **LAYERS), spec, ml.Mesh(**mesh), seed=0)
    before = {n: M.full(p).detach().clone() for n, p in model.named_parameters()}
    try:
        ml.merge_adapters(model)
    except ml.MeshlabError as e:
        same = all(torch.equal(M.full(p).detach(), before[n]) for n, p in model.named_parameters())
        return type(e).__name__, str(e), same
    return None


def test_merge_under_tensor_parallelism_is_refused_by_name(world2):
    for kind, msg, same in world2.run(tp_merge_case):
        assert kind == "ConfigError" and "ml.save_merged" in msg, (kind, msg)
        assert same


def float64_adapters_case(rank, world, layout):
    """peft made the adapters of a float64 model in float32 on the meta device, where the
    plan lists them as float64 (and peft in one process makes them float64): gradients
    1e-8 off peft's. Now float64, and one step's gradients match peft's to float64
    rounding (B set off zero first, the same on both sides)."""
    import torch.distributed as dist
    from peft import get_peft_model

    import meshlab as ml

    def build():
        return M.build("llama", **LAYERS).to(torch.float64)

    spec, mesh = _spec(layout, _config(False))
    model = ml.parallelize(build(), spec, ml.Mesh(**mesh), seed=0)
    dtypes = {str(p.dtype) for n, p in model.named_parameters() if "lora_" in n}
    planned = {e.dtype for e in model._meshlab.plan.params if "lora_" in e.fqn}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.fill_(0.05)
    ref = get_peft_model(ml.init_weights(build(), seed=0), _config(False))
    own = dict(ref.base_model.model.named_parameters())
    with torch.no_grad():
        for n, p in model.named_parameters():
            own[n].copy_(M.full(p))
    x = M.batches(1, batch=4)[0]
    n_dp = world if layout == "dp" else 1
    xs = x.chunk(n_dp)[rank % n_dp]
    M.loss_fn("llama")(model(input_ids=xs), {"input_ids": xs}).backward()
    M.loss_fn("llama")(ref(input_ids=x), {"input_ids": x}).backward()
    err = 0.0
    for n, p in model.named_parameters():
        if p.grad is not None and "lora_" in n:
            g = M.full(p.grad).clone()
            if n_dp > 1:
                dist.all_reduce(g)
                g /= n_dp
            err = max(err, float((g - own[n].grad).abs().max()))
    return dtypes, planned, err


@pytest.mark.parametrize("layout", ["dp", "tp2"])
def test_adapters_of_a_float64_model_are_float64(world2, layout):
    for dtypes, planned, err in world2.run(float64_adapters_case, layout=layout):
        assert dtypes == {"torch.float64"} and planned == {"float64"}, (dtypes, planned)
        assert err < 1e-12, err


def test_adapter_dropout_under_tensor_parallelism_is_not_runnable():
    """peft drops the adapter's input inside the split module, where each tp rank draws
    from its own stream: with lora_dropout 0.3 on tp=2 the loss was 4e-4 off peft's at the
    first step, no error. The plan says so before anything runs; without dropout it runs."""
    from peft import LoraConfig

    import meshlab as ml

    def plan(drop):
        cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=drop, target_modules=["q_proj"])
        return ml.plan(M.build("llama"), ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES))
                       | ml.lora(cfg), ml.Mesh(tp=2, fake=True))

    assert not plan(0.3).runnable
    assert "lora_dropout=0.0" in plan(0.3).not_runnable[0]
    assert plan(0.0).runnable


def tied_lora_case(rank, world):
    import meshlab as ml

    data = [{"input_ids": b} for b in M.batches(2, batch=4, seq=8)]
    spec = ml.lora(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) | \
        ml.data_parallel("dp")
    report = ml.verify(M.build("llama", tie_word_embeddings=True), spec, ml.Mesh(dp=world),
                       data, optimizer=torch.optim.SGD, lr=0.1, dtype=torch.float64,
                       atol=1e-10, rtol=1e-9)
    return report.ok, str(report)


def test_lora_on_a_model_with_a_tied_head_trains_as_one_process(world2):
    """The plan lists a tied head under both names, the model once: the install refused
    every LoRA of a tied model with advice about target_modules (the plan had passed)."""
    for ok, text in world2.run(tied_lora_case):
        assert ok, text
