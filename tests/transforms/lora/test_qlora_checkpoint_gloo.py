"""A 4-bit base (``lora(quantize=...)``) through every checkpoint path, on two gloo ranks.

* Resume: a QLoRA model trained two AdamW steps is saved (``checkpoint.save`` with its
  optimizer, under ``data_parallel`` and ``zero_shard(2)``, in float32, under
  ``zero_shard(2) | precision('bf16')`` and ``data_parallel | precision('fp16')`` (its loss
  scale) with bf16 products; the Booster's ``save_model`` as meshlab's checkpoint, ``shard=True`` and
  ``use_safetensors=True`` exports, with ``save_optimizer``) and loaded into a model built
  from other values (another seed: other base bytes, scales, offsets, adapters). After the
  load every parameter, every tensor of each 4-bit weight's quant state (packed bytes,
  scales, nested scales, offset, code tables) and the optimizer's state equal the saved
  model's, and one more step equals the step of the model that was never saved, exactly.
* ``state_dict`` given to ``parallelize``: the base is quantized from those values (its
  bytes and scales equal bitsandbytes quantizing them by hand), not from the seed's.
* ``HybridParallelPlugin(tp_size=1, pp_size=1, precision='fp32')`` with a 4-bit base
  trains as bitsandbytes and peft by hand on one process (three SGD steps).
* Refusals, before any file is written and with the model unchanged: merge and unmerge
  on a 4-bit base, ``merged_state``; one file (``save_model('model.pt')``); a file of
  bitsandbytes' own ``state_dict`` keys and a full-precision export loaded into a 4-bit
  base (``strict`` or not); a checkpoint quantized otherwise (fp4 into nf4); a weight
  repacked by bitsandbytes' CPU inference path.
* Dropout: ``lora_dropout > 0`` under ``data_parallel`` draws each rank's masks from its
  own generator over its own rows, as the full-precision LoRA does (see docs/transforms.md).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests import _models as M
from tests.transforms.lora.test_qlora_gloo import LAYERS, _config, reference

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.timeout(900)


def _spec(quant_type: str = "nf4", layout: str = "dp"):
    """``dp`` or ``zero2``, with ``_bf16``/``_fp16`` the precision (then the base's products
    in bf16, Colossal-AI's default; float32 otherwise)."""
    import meshlab as ml

    axis, _, prec = layout.partition("_")
    lo = ml.lora(_config(), quantize=ml.Quantize(
        quant_type, compute_dtype="bfloat16" if prec else "float32"))
    spec = lo | (ml.data_parallel("dp") if axis == "dp" else ml.zero_shard(2, "dp"))
    return spec | ml.precision(prec) if prec else spec


def _model(seed: int, quant_type: str = "nf4", layout: str = "dp"):
    import meshlab as ml

    return ml.parallelize(M.build("llama", **LAYERS), _spec(quant_type, layout),
                          ml.Mesh(dp=2), seed=seed)


def held(model) -> dict:
    """Every parameter (each 4-bit weight as every tensor of its quant state), by name."""
    import bitsandbytes as bnb

    out = {}
    for n, p in model.named_parameters():
        if isinstance(p, bnb.nn.Params4bit):
            qs = p.quant_state
            out[n] = [p.data, qs.absmax, qs.code, qs.state2.absmax, qs.state2.code, qs.offset]
        else:
            out[n] = [M.full(p).detach()]
    return {n: [t.clone() for t in ts] for n, ts in out.items()}


def same(a: dict, b: dict) -> list[str]:
    """The names whose tensors differ (or that only one holds)."""
    return sorted(n for n in set(a) | set(b) if n not in a or n not in b or len(a[n]) != len(
        b[n]) or not all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a[n], b[n])))


def _opt_state(opt) -> dict:
    inner = getattr(opt, "inner", opt)
    names = {id(p): n for n, p in getattr(opt, "params", ())}
    return {names.get(id(p), str(i)): {k: v.clone() if torch.is_tensor(v) else v
                                       for k, v in st.items()}
            for i, (p, st) in enumerate(inner.state.items())}


def _same_opt(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(set(a[n]) == set(b[n]) and all(
        torch.equal(a[n][k], b[n][k]) if torch.is_tensor(a[n][k]) else a[n][k] == b[n][k]
        for k in a[n]) for n in a)


def _batch(rank: int, i: int):
    return M.batches(4, batch=4, seed=11)[i].chunk(2)[rank]


# -- resume through meshlab.checkpoint ------------------------------------------------------
def resume_case(rank, world, directory, layout):
    import meshlab as ml

    model = _model(0, layout=layout)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-2)
    for i in range(2):
        ml.step(model, opt, {"input_ids": _batch(rank, i)})
    path = os.path.join(directory, "dcp")
    ml.checkpoint.save(path, model, opt)
    saved, saved_opt = held(model), _opt_state(opt)
    quant_keys = sorted(k for k in _dcp_keys(path) if ".weight." in k and "lora" not in k)

    other = _model(1, layout=layout)        # other base bytes, scales, offsets, adapters
    opt2 = ml.optimizer(other, torch.optim.AdamW, lr=1e-2)
    differed = same(saved, held(other))
    ml.checkpoint.load(path, other, opt2)
    after_load, after_load_opt = same(saved, held(other)), _same_opt(saved_opt, _opt_state(opt2))
    loss = ml.step(model, opt, {"input_ids": _batch(rank, 2)})
    loss2 = ml.step(other, opt2, {"input_ids": _batch(rank, 2)})
    return dict(differed=differed, after_load=after_load, after_load_opt=after_load_opt,
                step=(loss, loss2), after_step=same(held(model), held(other)),
                moved=same(saved, held(model)), quant_keys=quant_keys)


def _dcp_keys(path: str) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return list(FileSystemReader(path).read_metadata().state_dict_metadata)


@pytest.mark.parametrize("layout", ["dp", "zero2", "zero2_bf16", "dp_fp16"])
def test_checkpoint_save_load_resumes_exactly(world2, tmp_path, layout):
    for r in world2.run(resume_case, directory=str(tmp_path), layout=layout):
        four = [n for n in r["differed"] if ".lora_" not in n and "proj" in n]
        assert len(four) == 7 * LAYERS["num_hidden_layers"], r["differed"]  # a real test
        assert r["after_load"] == [] and r["after_load_opt"], r
        assert r["step"][0] == r["step"][1] and r["after_step"] == [], r
        assert any(".lora_B." in n for n in r["moved"])          # the step moved adapters
        # each 4-bit weight's quant state under its own names, no bitsandbytes JSON blob
        w = "model.layers.0.self_attn.q_proj.base_layer.weight"
        assert {f"{w}.{k}" for k in ("absmax", "quant_map", "nested_absmax",
                                     "nested_quant_map", "nested_offset")} <= set(
            r["quant_keys"]), r["quant_keys"]
        assert not any("bitsandbytes__" in k for k in r["quant_keys"])


# -- resume through the Booster ---------------------------------------------------------------
def _booster(seed: int):
    from peft import LoraConfig

    import meshlab as ml
    from meshlab.booster import Booster
    from meshlab.booster.plugin import TorchDDPPlugin

    booster = Booster(plugin=TorchDDPPlugin())
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = booster.enable_lora(ml.init_weights(M.build("llama", **LAYERS), seed=seed),
                                lora_config=cfg, bnb_quantization_config=ml.Quantize())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, *_ = booster.boost(model, opt)
    return booster, model, opt


def _booster_step(booster, model, opt, ids):
    out = model(input_ids=ids, labels=ids)
    booster.backward(out.loss, opt)
    opt.step()
    opt.zero_grad()
    return float(out.loss.detach())


def booster_case(rank, world, directory, how):
    booster, model, opt = _booster(0)
    for i in range(2):
        _booster_step(booster, model, opt, _batch(rank, i))
    mpath, opath = os.path.join(directory, f"{how}-model"), os.path.join(directory, f"{how}-opt")
    kw = {"dcp": {}, "shard": dict(shard=True, size_per_shard=0.01),
          "safetensors": dict(use_safetensors=True)}[how]
    booster.save_model(model, mpath, **kw)
    booster.save_optimizer(opt, opath)
    saved, saved_opt = held(model), _opt_state(opt)

    booster2, other, opt2 = _booster(1)
    differed = same(saved, held(other))
    booster2.load_model(other, mpath)
    booster2.load_optimizer(opt2, opath)
    after = same(saved, held(other))
    same_opt = _same_opt(saved_opt, _opt_state(opt2))
    ids = _batch(rank, 2)
    step = (_booster_step(booster, model, opt, ids), _booster_step(booster2, other, opt2, ids))
    return dict(differed=len(differed), after=after, same_opt=same_opt, step=step,
                after_step=same(held(model), held(other)),
                files=sorted(os.listdir(mpath)))


@pytest.mark.parametrize("how", ["dcp", "shard", "safetensors"])
def test_booster_save_load_model_and_optimizer_resume_exactly(world2, tmp_path, how):
    for r in world2.run(booster_case, directory=str(tmp_path), how=how):
        assert r["differed"] > 7 * LAYERS["num_hidden_layers"], r
        assert r["after"] == [] and r["same_opt"], r
        assert r["step"][0] == r["step"][1] and r["after_step"] == [], r
    if how == "shard":           # several safetensors shards and their index
        assert "model.safetensors.index.json" in r["files"], r["files"]


# -- full-precision values given to parallelize ----------------------------------------------
def state_dict_case(rank, world):
    import bitsandbytes as bnb

    import meshlab as ml

    src = ml.init_weights(M.build("llama", **LAYERS), seed=5)
    sd = {k: v.clone() for k, v in src.state_dict().items()}
    model = ml.parallelize(M.build("llama", **LAYERS), _spec(), ml.Mesh(dp=2), seed=0,
                           state_dict=sd)
    bad, n = [], 0
    for name, p in model.named_parameters():
        if not isinstance(p, bnb.nn.Params4bit):
            continue
        key = name.replace(".base_layer.", ".")
        w, qs = bnb.functional.quantize_4bit(sd[key].contiguous(), blocksize=64,
                                             compress_statistics=True, quant_type="nf4")
        n += 1
        mine = p.quant_state
        if not (torch.equal(p.data, w) and torch.equal(mine.absmax, qs.absmax) and
                torch.equal(mine.state2.absmax, qs.state2.absmax) and
                torch.equal(mine.offset, qs.offset)):
            bad.append(name)
    seeded = _model(0)
    differs_from_seed = same(held(model), held(seeded))
    return n, bad, len(differs_from_seed)


def test_state_dict_values_are_quantized(world2):
    for n, bad, differs in world2.run(state_dict_case):
        assert n == 7 * LAYERS["num_hidden_layers"] and bad == [], bad
        assert differs >= n                 # not the seed's base


# -- HybridParallelPlugin(tp_size=1, pp_size=1, precision='fp32') ----------------------------
def hybrid_case(rank, world):
    from meshlab.booster import Booster
    from meshlab.booster.plugin import HybridParallelPlugin

    import meshlab as ml

    booster = Booster(plugin=HybridParallelPlugin(tp_size=1, pp_size=1, precision="fp32"))
    model = booster.enable_lora(M.build("llama", **LAYERS), lora_config=_config(),
                                bnb_quantization_config=ml.Quantize(compute_dtype="float32"))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model, opt, *_ = booster.boost(model, opt)
    ref = reference()
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.5)
    got, want = [], []
    for b in M.batches(3, batch=4):
        half = b.chunk(2)[rank]
        got.append(_booster_step(booster, model, opt, half))
        with torch.no_grad():                 # this rank's half, before the step
            want.append(float(ref(input_ids=half, labels=half).loss))
        loss = ref(input_ids=b, labels=b).loss      # the step: the whole batch
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    refp = dict(ref.named_parameters())
    adapters = {n: (M.full(p).detach().clone(), refp[n].detach().clone())
                for n, p in model.named_parameters() if p.requires_grad}
    base = held(model)
    ref_base = held(ref)
    four = [n for n in base if len(base[n]) > 1]
    return dict(got=got, want=want, adapters=adapters,
                base=same({n: base[n] for n in four}, {n: ref_base[n] for n in four}),
                four=len(four))


def test_hybrid_plugin_tp1_pp1_fp32_matches_bitsandbytes_and_peft(world2):
    for r in world2.run(hybrid_case):
        torch.testing.assert_close(r["got"], r["want"], atol=1e-6, rtol=1e-6)
        assert r["adapters"] and r["four"] == 7 * LAYERS["num_hidden_layers"]
        for n, (mine, theirs) in r["adapters"].items():
            torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-6,
                                       msg=lambda m, n=n: f"{n}: {m}")
        assert r["base"] == [], r["base"]
    assert any(mine.abs().max() > 0 for n, (mine, _) in r["adapters"].items()
               if ".lora_B." in n)


# -- refusals -----------------------------------------------------------------------------------
def _refused(fn) -> str:
    from meshlab.core.errors import MeshlabError

    try:
        fn()
    except MeshlabError as e:
        return f"{type(e).__name__}: {e}"
    return "ran"


def refusals_case(rank, world, directory):
    import torch.distributed as dist

    import meshlab as ml

    model = _model(0)
    before = held(model)
    out = {}
    out["merge"] = _refused(lambda: ml.merge_adapters(model))
    out["unmerge"] = _refused(lambda: ml.unmerge_adapters(model))
    from meshlab.checkpoint.adapters import merged_state

    out["merged_state"] = _refused(lambda: merged_state(model))

    from meshlab.booster import Booster
    from meshlab.booster.plugin import TorchDDPPlugin

    booster, bmodel, _ = _booster(0)
    one = os.path.join(directory, "model.pt")
    out["one_file"] = _refused(lambda: booster.save_model(bmodel, one))
    out["one_file_written"] = sorted(os.listdir(directory))

    # bitsandbytes' own state_dict keys (packed bytes and a JSON blob, no record of meshlab's)
    bnb_file = os.path.join(directory, "bnb.pt")
    if rank == 0:
        torch.save(bmodel.state_dict(), bnb_file)
    dist.barrier()
    b_before = held(bmodel)
    out["bnb_file"] = _refused(lambda: booster.load_model(bmodel, bnb_file, strict=False))

    # a full-precision export of the same architecture
    plain = ml.parallelize(M.build("llama", **LAYERS), ml.data_parallel("dp"), ml.Mesh(dp=2),
                           seed=3)
    fp = os.path.join(directory, "fp32")
    ml.checkpoint.save_pretrained(fp, plain)
    ml.checkpoint.save(os.path.join(directory, "fp32-dcp"), plain)
    out["fp_export"] = _refused(lambda: ml.checkpoint.load_pretrained(fp, model))
    out["fp_export_lax"] = _refused(lambda: ml.checkpoint.load_pretrained(fp, model,
                                                                          strict=False))
    out["fp_booster"] = _refused(lambda: booster.load_model(bmodel, fp, strict=False))
    out["fp_dcp_lax"] = _refused(lambda: ml.checkpoint.load(
        os.path.join(directory, "fp32-dcp"), model, strict=False))

    # quantized otherwise: an fp4 checkpoint into an nf4 model
    fp4 = _model(0, "fp4")
    ml.checkpoint.save(os.path.join(directory, "fp4"), fp4)
    ml.checkpoint.save_pretrained(os.path.join(directory, "fp4-hf"), fp4)
    out["fp4_dcp"] = _refused(lambda: ml.checkpoint.load(os.path.join(directory, "fp4"), model))
    out["fp4_hf"] = _refused(lambda: ml.checkpoint.load_pretrained(
        os.path.join(directory, "fp4-hf"), model, strict=False))
    unchanged = same(before, held(model)) + same(b_before, held(bmodel))

    # an evaluation (eval mode, no gradients) on the CPU leaves the base as quantized and
    # computes what the training-mode forward does; a weight that bitsandbytes' CPU
    # inference path repacked anyway (scales in bfloat16) is refused by a save
    big = dict(LAYERS, hidden_size=64, intermediate_size=128)   # blocks bitsandbytes repacks
    ev = ml.parallelize(M.build("llama", **big), _spec(), ml.Mesh(dp=2), seed=0)
    ids = _batch(rank, 0)
    ev_before = held(ev)
    with torch.no_grad():
        train_out = ev(input_ids=ids).logits
        ev.eval()
        eval_out = ev(input_ids=ids).logits
    out["eval_kept_base"] = same(ev_before, held(ev)) == [] and torch.equal(train_out, eval_out)
    layer = ev.model.layers[0].self_attn.k_proj
    layer.support_avx512bf16_for_cpu = True         # bitsandbytes' default, where it applies
    with torch.no_grad():
        ev(input_ids=ids)
    packed = getattr(layer.weight.quant_state, "packing_format_for_cpu", False)
    path = os.path.join(directory, "eval")
    out["cpu_packed"] = _refused(lambda: ml.checkpoint.save(path, ev)) if packed else "not packed"
    out["cpu_packed_written"] = os.path.exists(path) or os.path.exists(path + ".partial")
    dist.barrier()
    return out, unchanged


def test_what_cannot_be_exact_is_refused_by_name(world2, tmp_path):
    for out, unchanged in world2.run(refusals_case, directory=str(tmp_path)):
        assert unchanged == [], unchanged
        for call in ("merge_adapters", "unmerge_adapters", "merged_state"):
            key = {"merge_adapters": "merge", "unmerge_adapters": "unmerge"}.get(call, call)
            assert out[key].startswith("ConfigError") and call in out[key] and \
                "held in 4" in out[key] and "save_adapter" in out[key], out[key]
        assert "lossy" in out["merge"] and "restore their bytes" in out["unmerge"]
        assert out["one_file"].startswith("CheckpointError") and "use_safetensors=True" in \
            out["one_file"], out["one_file"]
        assert "model.pt" not in out["one_file_written"], out["one_file_written"]
        for key in ("bnb_file", "fp_export", "fp_export_lax", "fp_booster", "fp_dcp_lax"):
            assert out[key].startswith("Checkpoint") and "4-bit weight" in out[key] and \
                "parallelize(..., state_dict=...)" in out[key], (key, out[key])
        for key in ("fp4_dcp", "fp4_hf"):
            assert "quant_type" in out[key] and "'fp4'" in out[key] and "'nf4'" in out[key] \
                and "Quantize(" in out[key], (key, out[key])
        assert out["eval_kept_base"]
        if out["cpu_packed"] != "not packed":     # a CPU with AVX512-BF16
            assert "CPU inference layout" in out["cpu_packed"], out["cpu_packed"]
            assert not out["cpu_packed_written"]


# -- dropout under data parallelism ---------------------------------------------------------------
def dropout_case(rank, world):
    from peft import LoraConfig
    from peft.tuners.lora import LoraLayer

    import meshlab as ml

    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.25,
                     target_modules=["q_proj", "v_proj", "down_proj"])
    spec = ml.lora(cfg, quantize=ml.Quantize(compute_dtype="float32")) | ml.data_parallel("dp")
    model = ml.parallelize(M.build("llama", **LAYERS), spec, ml.Mesh(dp=2), seed=0)
    opt = ml.optimizer(model, torch.optim.SGD, lr=0.5)
    ref = reference()                          # the same base and adapters, dropout added
    for m in ref.modules():
        if isinstance(m, LoraLayer):
            m.lora_dropout["default"] = torch.nn.Dropout(0.25)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.5)
    losses, halves, whole = [], [], []
    for i, b in enumerate(M.batches(2, batch=4)):      # B is zero in the first step only
        states = []
        for r in range(2):                     # each rank's generator, seeded its own way
            torch.manual_seed(100 + 10 * i + r)
            states.append(torch.random.get_rng_state())
        torch.random.set_rng_state(states[rank])
        losses.append(ml.step(model, opt, {"input_ids": b.chunk(2)[rank]}))
        # the whole batch through one generator (the first rank's), without a step
        torch.random.set_rng_state(states[0])
        with torch.no_grad():
            whole.append(float(M.loss_fn("llama")(ref(input_ids=b),
                                                  {"input_ids": b, "labels": b})))
        # one process: each half with that rank's generator, the gradients averaged
        step = []
        for r in range(2):
            torch.random.set_rng_state(states[r])
            half = b.chunk(2)[r]
            out = M.loss_fn("llama")(ref(input_ids=half), {"input_ids": half, "labels": half})
            (out / 2).backward()
            step.append(float(out.detach()))
        ref_opt.step()
        ref_opt.zero_grad()
        halves.append(step)
    refp = dict(ref.named_parameters())
    adapters = {n: (M.full(p).detach().clone(), refp[n].detach().clone())
                for n, p in model.named_parameters() if p.requires_grad}
    return dict(losses=losses, halves=halves, adapters=adapters, whole=whole)


def test_dropout_draws_each_ranks_rows_from_its_own_generator(world2):
    """Under data parallelism a rank draws the dropout masks of its own rows from its own
    generator (as with LoRA on a full-precision base): the step equals one process that
    runs each rank's rows with that rank's generator and averages the gradients, not one
    that draws the whole batch's masks from one generator."""
    out = world2.run(dropout_case)
    for r in out:
        # the step's loss: the mean over the ranks of each one's rows under its generator
        torch.testing.assert_close(r["losses"], [sum(h) / 2 for h in r["halves"]],
                                   atol=1e-6, rtol=1e-6)
        for n, (mine, theirs) in r["adapters"].items():
            torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-6,
                                       msg=lambda m, n=n: f"{n}: {m}")
    # once B is not zero, the whole batch through one generator draws other masks
    second = out[0]
    assert abs(sum(second["halves"][1]) / 2 - second["whole"][1]) > 1e-4, second
