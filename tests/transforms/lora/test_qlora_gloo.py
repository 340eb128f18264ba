"""``lora(..., quantize=...)`` (QLoRA) on real gloo ranks against bitsandbytes and peft by hand.

* Parity: a tiny Llama (built from its config, initialized from the seed) with its Linear
  layers but the head in 4 bits and LoRA on q/v/down, three SGD steps under
  ``data_parallel``, ``zero_shard(1)``, ``zero_shard(2)`` and ``data_parallel |
  precision('fp32')`` on two ranks: the loss of every step and the adapters after the
  steps equal one process that quantizes the same layers with bitsandbytes, injects the
  same config with peft and trains on the whole global batch (compute dtype float32); the
  4-bit base holds the same bytes and scales as that reference, before and after, and no
  gradient.
* 16 bits: Colossal-AI's defaults (bf16 products, adapters in bf16) under
  ``precision('bf16')`` and ``precision('fp16')`` (its dynamic loss scale) beside
  ``data_parallel``, ``zero_shard(1)`` and ``zero_shard(2)``, against the same reference
  under the same autocast (torch's ``GradScaler`` for fp16), to bf16's rounding.
* Replicas: a base whose weights differ across ranks is refused, and with
  ``sync_module_states=True`` every rank quantizes rank 0's values.
* Refusals (plan time, no process group): ``zero_shard(3)``, tensor parallelism and a
  pipeline beside a quantized base raise ``ConfigError`` naming the fix.
* Memory: the plan counts a 4-bit weight at half a byte an element plus its scales.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests import _models as M

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.timeout(900)

LAYERS = dict(num_hidden_layers=2)
LR = 0.5
TARGETS = ["q_proj", "v_proj", "down_proj"]


def _config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS)


def _spec(layout: str):
    import meshlab as ml

    lo = ml.lora(_config(), quantize=ml.Quantize(compute_dtype="float32"))
    return {"dp": lo | ml.data_parallel("dp"),
            "zero1": lo | ml.zero_shard(1, "dp"),
            "zero2": lo | ml.zero_shard(2, "dp"),
            "dp_fp32": lo | ml.data_parallel("dp") | ml.precision("fp32")}[layout]


def reference(compute=torch.float32):
    """One process, by hand: the seeded model, every Linear but the head replaced by a
    bitsandbytes Linear4bit (nf4, double quantization, blocks of 64, products in
    ``compute``),
    peft's adapters injected, A drawn from a generator seeded 0 in module order, B zero."""
    import bitsandbytes as bnb
    from peft import inject_adapter_in_model
    from peft.tuners.lora import LoraLayer

    import meshlab as ml

    model = ml.init_weights(M.build("llama", **LAYERS), seed=0)
    for name, mod in list(model.named_modules()):
        for child, lin in list(mod.named_children()):
            if type(lin) is not torch.nn.Linear or child == "lm_head":
                continue
            q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False,
                                  compute_dtype=compute, compress_statistics=True,
                                  quant_type="nf4")
            q.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False,
                                         blocksize=64, compress_statistics=True,
                                         quant_type="nf4", module=q).to("cpu")
            setattr(mod, child, q)
    model.is_loaded_in_4bit = True       # as transformers marks a model loaded in 4 bits
    inject_adapter_in_model(_config(), model)
    for n, p in model.named_parameters():
        p.requires_grad_(".lora_" in n)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoraLayer):
                for k in m.lora_A:
                    torch.nn.init.kaiming_uniform_(m.lora_A[k].weight, a=math.sqrt(5),
                                                   generator=g)
                    m.lora_B[k].weight.zero_()
    return model


def _packed(model) -> dict:
    """Each 4-bit weight's bytes and its scales, as plain tensors."""
    import bitsandbytes as bnb

    out = {}
    for n, p in model.named_parameters():
        if isinstance(p, bnb.nn.Params4bit):
            qs = p.quant_state
            out[n] = (p.data.clone(), qs.absmax.clone(), qs.state2.absmax.clone(),
                      qs.offset.clone())
    return out


def _beside_reference(spec, compute=torch.float32, autocast=None, scale=None) -> tuple:
    """Three SGD steps of ``spec`` on two ranks beside ``reference(compute)`` trained on the
    whole batch (under ``autocast``'s dtype, with torch's ``GradScaler`` at ``scale``):
    (the model, the losses of both, each adapter of both with its dtypes, whether the
    4-bit bytes and scales equal the reference's and their start, how many 4-bit
    weights)."""
    import contextlib

    import torch.distributed as dist

    import meshlab as ml

    model = ml.parallelize(M.build("llama", **LAYERS), spec, ml.Mesh(dp=2), seed=0)
    ref = reference(compute)
    start_base = _packed(model)
    opt = ml.optimizer(model, torch.optim.SGD, lr=LR)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale) if scale else None
    rt = model._meshlab
    r = dist.get_rank(rt.dp_group)
    got, want = [], []
    for b in M.batches(3, batch=4):
        got.append(ml.step(model, opt, {"input_ids": b.chunk(rt.dp_size)[r]}))
        with torch.autocast("cpu", dtype=autocast) if autocast else contextlib.nullcontext():
            loss = M.loss_fn("llama")(ref(input_ids=b), {"input_ids": b, "labels": b})
        if scaler is None:
            loss.backward()
            ref_opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(ref_opt)
            scaler.update()
        ref_opt.zero_grad()
        want.append(float(loss.detach()))
    refp = dict(ref.named_parameters())
    adapters = {n: (M.full(p).detach().float().clone(), refp[n].detach().float().clone(),
                    str(p.dtype), str(refp[n].dtype))
                for n, p in model.named_parameters() if p.requires_grad}
    base, ref_base = _packed(model), _packed(ref)
    same_base = set(base) == set(ref_base) == set(start_base) and all(
        torch.equal(x, y) and torch.equal(x, z)
        for n in base for x, y, z in zip(base[n], ref_base[n], start_base[n]))
    return model, dict(got=got, want=want, adapters=adapters, same_base=same_base,
                       n_base=len(base))


def parity_case(rank, world, layout):
    import meshlab as ml

    model, out = _beside_reference(_spec(layout))
    frozen_grads = sum(p.grad is not None for p in model.parameters() if not p.requires_grad)
    try:
        ml.save_merged("/nonexistent/merged", model)
        merged = "ran"
    except ml.ConfigError as e:
        merged = str(e)
    return dict(out, merged=merged, frozen_grads=frozen_grads,
                cls={type(m).__module__ + "." + type(m).__name__
                     for n, m in model.named_modules() if n.endswith("q_proj")})


@pytest.mark.parametrize("layout", ["dp", "zero1", "zero2", "dp_fp32"])
def test_qlora_matches_bitsandbytes_and_peft(world2, layout):
    for r in world2.run(parity_case, layout=layout):
        torch.testing.assert_close(r["got"], r["want"], atol=1e-6, rtol=1e-6)
        assert r["adapters"] and all(".lora_" in n for n in r["adapters"])
        for n, (mine, theirs, *_) in r["adapters"].items():
            torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-6,
                                       msg=lambda m, n=n: f"{n}: {m}")
        # q/k/v/o, gate/up/down in each of the 2 blocks; the head stays in full precision
        assert r["n_base"] == 7 * LAYERS["num_hidden_layers"], r["n_base"]
        assert r["same_base"] and r["frozen_grads"] == 0
        assert "held in 4 bits" in r["merged"] and "save_adapter" in r["merged"], r["merged"]
        assert r["cls"] == {"peft.tuners.lora.bnb.Linear4bit"}, r["cls"]
    # the adapters moved: a step that changed nothing would also agree with the reference
    moved = [n for n, (mine, *_) in r["adapters"].items() if ".lora_B." in n
             and mine.abs().max() > 0]
    assert len(moved) == len(TARGETS) * LAYERS["num_hidden_layers"]


# 16-bit precisions with Colossal-AI's defaults (nf4, double quantization, bf16 products):
# layout -> (autocast dtype, the reference's loss scale, (atol, rtol)). The adapters and
# their gradients are bf16 (peft makes them in the base's compute dtype, 8 bits of
# mantissa), so a gradient summed in two halves and averaged rounds apart from the whole
# batch's: measured, 1 to 2 of bf16's ulps of the adapters (at most 9.8e-4, 2% of the
# largest) and 1.5e-4 of the loss. A term missing or doubled moves B, started at zero, by
# all of its value.
_SIXTEEN = {
    "dp_bf16": ("bfloat16", None, (2e-3, 4 * 2 ** -8)),
    "zero2_bf16": ("bfloat16", None, (2e-3, 4 * 2 ** -8)),
    "dp_fp16": ("float16", 2.0 ** 16, (2e-3, 4 * 2 ** -8)),
    "zero1_fp16": ("float16", 2.0 ** 16, (2e-3, 4 * 2 ** -8)),
}


def _sixteen_spec(layout: str):
    import meshlab as ml

    lo = ml.lora(_config(), quantize=True)
    axis, prec = layout.split("_")
    zero = {"dp": ml.data_parallel("dp"), "zero1": ml.zero_shard(1, "dp"),
            "zero2": ml.zero_shard(2, "dp")}[axis]
    return lo | zero | ml.precision(prec)       # fp16: a dynamic loss scale from 2**16


def sixteen_case(rank, world, layout):
    dtype, scale, _ = _SIXTEEN[layout]
    _, out = _beside_reference(_sixteen_spec(layout), torch.bfloat16, getattr(torch, dtype),
                               scale)
    return out


@pytest.mark.parametrize("layout", list(_SIXTEEN))
def test_qlora_in_sixteen_bits_matches_autocast(world2, layout):
    """Colossal-AI's QLoRA defaults under ``precision('bf16')`` and ``precision('fp16')``
    (its dynamic loss scale): one process under the same autocast, with torch's
    ``GradScaler`` for fp16."""
    atol, rtol = _SIXTEEN[layout][2]
    for r in world2.run(sixteen_case, layout=layout):
        torch.testing.assert_close(r["got"], r["want"], atol=atol, rtol=rtol)
        assert r["adapters"] and r["same_base"]
        assert r["n_base"] == 7 * LAYERS["num_hidden_layers"], r["n_base"]
        for n, (mine, theirs, dt, ref_dt) in r["adapters"].items():
            assert dt == ref_dt, (n, dt, ref_dt)
            torch.testing.assert_close(mine, theirs, atol=atol, rtol=rtol,
                                       msg=lambda m, n=n: f"{n}: {m}")
    moved = [n for n, (mine, *_) in r["adapters"].items() if ".lora_B." in n
             and mine.abs().max() > 0]
    assert len(moved) == len(TARGETS) * LAYERS["num_hidden_layers"]


def replicas_case(rank, world, sync):
    import meshlab as ml
    from meshlab.core.errors import RankMismatchError

    model = ml.init_weights(M.build("llama", **LAYERS), seed=0)
    if rank == 1:              # a replica built from other values
        with torch.no_grad():
            model.model.layers[0].self_attn.q_proj.weight.add_(0.5)
    try:
        ml.parallelize(model, _spec("dp"), ml.Mesh(dp=2), sync_module_states=sync)
    except RankMismatchError as e:
        return "refused", str(e)
    import torch.distributed as dist

    mine = _packed(model)
    held = [None, None]
    dist.all_gather_object(held, {n: [t.tolist() for t in v] for n, v in mine.items()})
    ref = _packed(reference())
    return "ran", (held[0] == held[1], all(
        all(torch.equal(x, y) for x, y in zip(mine[n], ref[n])) for n in ref))


def test_replicas_agree_before_the_base_is_quantized(world2):
    out = world2.run(replicas_case, sync=False)
    assert all(kind == "refused" and "q_proj.weight" in msg for kind, msg in out), out
    out = world2.run(replicas_case, sync=True)
    # every rank quantized rank 0's values: the bytes and scales of the reference
    assert all(kind == "ran" and res == (True, True) for kind, res in out), out


# -- refusals at plan time (fake meshes, no process group) ----------------------------------
@pytest.mark.parametrize("other,mesh,fix", [
    ("zero3", dict(dp=2), "ZeRO-3 would shard the 4-bit base"),
    ("tp", dict(tp=2), "tensor parallelism would split the 4-bit base"),
    ("pp", dict(pp=2), "a pipeline's stages are not yet shown with a 4-bit base"),
])
def test_what_would_touch_the_base_is_refused_by_name(other, mesh, fix):
    import meshlab as ml

    lo = ml.lora(_config(), quantize=True)
    spec = {"zero3": lo | ml.zero_shard(3, "dp"),
            "tp": ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES)) | lo,
            "pp": lo | ml.pipeline("pp")}[other]
    with pytest.raises(ml.ConfigError) as e:
        ml.plan(M.build("llama", **LAYERS), spec, ml.Mesh(**mesh, fake=True))
    text = str(e.value)
    assert fix in text and "drop quantize from lora(...)" in text
    assert "zero_shard(2)" in text and "lora(quantize)" in text and "docs/composition.md" in text


def test_quantize_values_are_checked():
    import meshlab as ml

    with pytest.raises(ml.ConfigError, match="quant_type"):
        ml.Quantize(quant_type="int4")
    with pytest.raises(ml.ConfigError, match="compute_dtype"):
        ml.Quantize(compute_dtype="float64")
    with pytest.raises(ml.ConfigError, match="8-bit bases are not implemented"):
        from transformers import BitsAndBytesConfig

        ml.lora(_config(), quantize=BitsAndBytesConfig(load_in_8bit=True))
    q = ml.lora(_config(), quantize=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype=torch.float16))
    assert q.quantize == ml.Quantize("fp4", False, "float16")
    assert ml.lora(_config(), quantize=True).quantize == ml.Quantize()
    with pytest.raises(ml.ConfigError, match="bitsandbytes quantizes float32, bfloat16"):
        ml.plan(M.build("llama", **LAYERS).to(torch.float64), ml.lora(_config(), quantize=True),
                ml.Mesh(dp=1, fake=True))
    # skip_modules replaces the head as the modules kept in full precision
    p = ml.plan(M.build("llama", **LAYERS), ml.lora(_config(), quantize=ml.Quantize(
        skip_modules=["lm_head", "down_proj"])), ml.Mesh(dp=1, fake=True))
    kept = {e.fqn for e in p.params if e.fqn.endswith("weight") and e.dtype == "float32"}
    assert "lm_head.weight" in kept and "model.layers.0.mlp.down_proj.base_layer.weight" in kept
    assert p["model.layers.0.mlp.up_proj.weight"].dtype == "nf4"


def test_without_bitsandbytes_quantize_names_the_extra(monkeypatch):
    import sys

    import meshlab as ml

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)      # import fails
    with pytest.raises(ml.ConfigError, match=r"pip install 'meshlab\[qlora\]'"):
        ml.lora(_config(), quantize=True)
    assert ml.lora(_config()).quantize is None                  # LoRA alone needs none


def test_plan_records_the_4bit_base_and_counts_it():
    import meshlab as ml

    mesh = ml.Mesh(dp=2, fake=True)
    model = M.build("llama", **LAYERS).to(torch.bfloat16)
    plain = ml.plan(model, ml.lora(_config()) | ml.data_parallel("dp"), mesh)
    q = ml.plan(model, ml.lora(_config(), quantize=True) | ml.data_parallel("dp"), mesh)
    four = [e for e in q.params if e.dtype == "nf4"]
    assert len(four) == 7 * LAYERS["num_hidden_layers"]
    assert all(not e.requires_grad and "keep_whole" in e.tags for e in four)
    assert {e.fqn for e in four if ".base_layer." in e.fqn} == {
        e.fqn for e in q.params if ".base_layer.weight" in e.fqn}
    assert q["lm_head.weight"].dtype == "bfloat16"          # the head stays as it was
    # bf16 -> 4 bits: half a byte an element, an 8-bit scale per block of 64, and per
    # weight a float32 scale per 256 blocks and their offset: about a quarter of bf16's
    n = sum(e.numel for e in four)
    est, base = q.memory(), plain.memory()
    held = est.params - (base.params - 2 * n)
    assert held == sum(math.ceil(e.numel / 2) + math.ceil(e.numel / 64)
                       + 4 * (math.ceil(e.numel / 64 / 256) + 1) for e in four), held
    assert 0.25 * 2 * n < held < 0.28 * 2 * n, (held, n)
    assert est.grads == base.grads and est.optimizer == base.optimizer    # adapters only
    text = str(q)                                          # the table prints the 4-bit type
    assert "nf4[" in text
    # under ZeRO-2 the 4-bit base stays whole on each rank (FSDP2 leaves it out)
    z2 = ml.plan(model, ml.lora(_config(), quantize=True) | ml.zero_shard(2, "dp"), mesh)
    assert z2.memory().by_category["params"]["nf4"] == est.by_category["params"]["nf4"]
    assert ml.Plan.from_json(q.to_json()).params == q.params
