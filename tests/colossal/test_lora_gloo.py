"""Colossal-AI's LoRA test, rewritten in meshlab's code, on 2 gloo processes.

The cases of ``tests/test_lora/test_lora.py`` (its ``check_fwd_bwd``, which saves and
reloads the adapter before the step), for ``quantize=False`` and ``quantize=True`` (QLoRA:
the Linear layers but the head in 4 bits, Colossal-AI's defaults: nf4, double
quantization, bf16 products) under ``TorchDDPPlugin()`` and ``LowLevelZeroPlugin``:

* checkpoint: ``save_lora_as_pretrained`` writes an adapter under 1 MB; a fresh model with
  ``enable_lora(pretrained_dir=...)`` boosts into the same parameters (the 4-bit base's
  bytes and scales too);
* forward and backward: one step (``booster.backward``, ``clip_grad_by_norm(1.0)``,
  ``step``) moves every adapter's B and leaves every frozen parameter as it was; A holds
  a zero gradient in the first step (B starts at zero), so with AdamW's weight decay off
  it stays (the original's decay moves A by 1e-5 of itself, which a bf16 adapter beside a
  4-bit base with bf16 products rounds away).

Differences from the original: meshlab's ``enable_lora`` marks the model and ``boost``
injects the adapters, so the parameters are compared by meshlab's names (peft's, without
``PeftModel``'s ``base_model.model.`` prefix) rather than by position; the optimizer is
built over the model it steps (the original builds it over another one); ZeRO runs both
as the original runs it (``LowLevelZeroPlugin()``: stage 1, fp16, a loss scale from
2**32 whose first steps overflow and are skipped, so the step is repeated until one is
taken) and in float32 at stage 2; GeminiPlugin's refusal of a quantized base is checked
(Colossal-AI's GeminiPlugin takes no quantization configuration), and tensor
parallelism's. Parity in 16 bits against one process is
``tests/transforms/lora/test_qlora_gloo.py::test_qlora_in_sixteen_bits_matches_autocast``.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests import _models as M

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.timeout(900)


def _model():
    import meshlab as ml

    return ml.init_weights(M.build("llama"), seed=0)     # the same weights on every rank


def _plugin(name: str):
    from meshlab.booster.plugin import LowLevelZeroPlugin, TorchDDPPlugin

    return {"ddp": lambda: TorchDDPPlugin(),
            "zero2": lambda: LowLevelZeroPlugin(stage=2, precision="fp32"),
            "zero": lambda: LowLevelZeroPlugin()}[name]()


def _held(model) -> dict:
    """Every parameter's value (a 4-bit weight's bytes and scales), by name."""
    import bitsandbytes as bnb

    out = {}
    for n, p in model.named_parameters():
        out[n] = [M.full(p).detach().clone()]
        if isinstance(p, bnb.nn.Params4bit):
            out[n] += [p.quant_state.absmax.clone(), p.quant_state.state2.absmax.clone()]
    return out


def fwd_bwd_case(rank, world, plugin, quantize, directory):
    import torch.distributed as dist
    from peft import LoraConfig

    from meshlab.booster import Booster

    cfg = LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=32, lora_dropout=0.1)
    booster = Booster(plugin=_plugin(plugin))
    model_save = booster.enable_lora(_model(), lora_config=cfg, quantize=quantize)
    opt = torch.optim.AdamW(model_save.parameters(), lr=1e-3, weight_decay=0.0)
    model_save, opt, *_ = booster.boost(model_save, opt)
    path = os.path.join(directory, f"{plugin}-{quantize}")
    booster.save_lora_as_pretrained(model_save, path)
    dist.barrier()
    size = os.path.getsize(os.path.join(path, "adapter_model.bin")) / 2 ** 20

    booster2 = Booster(plugin=_plugin(plugin))
    model_load = booster2.enable_lora(_model(), pretrained_dir=path, lora_config=cfg,
                                      quantize=quantize)
    opt2 = torch.optim.AdamW(model_load.parameters(), lr=1e-3, weight_decay=0.0)
    model_load, opt2, *_ = booster2.boost(model_load, opt2)
    saved, loaded = _held(model_save), _held(model_load)
    same_after_load = set(saved) == set(loaded) and all(
        torch.equal(x, y) for n in saved for x, y in zip(saved[n], loaded[n]))

    before = _held(model_load)
    ids = M.batches(1, batch=2, seed=7 + rank)[0]
    # under fp16 a step whose gradients overflow is skipped and the scale backed off
    # (LowLevelZeroPlugin starts at 2**32, past fp16's range): step until one is taken
    scaler, skipped = opt2.scaler, 0
    for _ in range(80):
        out = model_load(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids))
        booster2.backward(out.loss, opt2)
        opt2.clip_grad_by_norm(1.0)
        opt2.step()
        opt2.zero_grad()
        if scaler is None or scaler.skipped == skipped:
            break
        skipped = scaler.skipped
    after = _held(model_load)
    moved, kept, trainable = [], [], []
    dtypes = {str(p.dtype) for n, p in model_load.named_parameters() if ".lora_" in n}
    planned = {e.dtype for e in model_load._meshlab.plan.params if ".lora_" in e.fqn}
    for n, p in model_load.named_parameters():
        changed = not all(torch.equal(x, y) for x, y in zip(before[n], after[n]))
        if p.requires_grad:
            trainable.append(n)
            if changed:
                moved.append(n)
        elif not changed:
            kept.append(n)
    four_bit = sum(1 for n in after if len(after[n]) > 1)
    frozen = sum(1 for p in model_load.parameters() if not p.requires_grad)
    return dict(size=size, same_after_load=same_after_load, trainable=trainable, moved=moved,
                skipped=skipped, scaled=scaler is not None,
                dtypes=dtypes, planned=planned,
                kept=len(kept), frozen=frozen, four_bit=four_bit)


@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("plugin", ["ddp", "zero2", "zero"])
def test_lora_checkpoint_and_step(world2, tmp_path, plugin, quantize):
    for r in world2.run(fwd_bwd_case, plugin=plugin, quantize=quantize,
                        directory=str(tmp_path)):
        assert r["size"] < 1, r                                # the adapter alone
        # fp16's first steps overflow at Colossal-AI's initial scale and are skipped
        assert r["scaled"] == (plugin == "zero") and (r["skipped"] > 0) == r["scaled"], r
        assert r["same_after_load"], r
        # peft's defaults for Llama: q_proj and v_proj of both blocks, A and B each
        assert len(r["trainable"]) == 2 * 2 * 2 and all(".lora_" in n for n in r["trainable"])
        assert r["moved"] == [n for n in r["trainable"] if ".lora_B." in n], r
        # peft makes the adapters beside a 4-bit base in its compute dtype, as planned
        dt = "bfloat16" if quantize else "float32"
        assert r["dtypes"] == {f"torch.{dt}"} and r["planned"] == {dt}, r
        assert r["kept"] == r["frozen"] > 0, r
        # q/k/v/o and gate/up/down of both blocks in 4 bits; the head in full precision
        assert r["four_bit"] == (7 * 2 if quantize else 0), r


def test_quantize_refusals_name_the_fix():
    """No process group: GeminiPlugin refuses at enable_lora, tensor parallelism when its
    plan is made (before any collective); LowLevelZeroPlugin's default fp16 plans."""
    from peft import LoraConfig

    import meshlab as ml
    from meshlab.booster import Booster, UnsupportedArgument
    from meshlab.booster.plugin import GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin

    cfg = LoraConfig(r=8, lora_alpha=32)
    with pytest.raises(UnsupportedArgument, match="LowLevelZeroPlugin") as e:
        Booster(plugin=GeminiPlugin()).enable_lora(_model(), lora_config=cfg, quantize=True)
    assert e.value.argument == "quantize"
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32"))
    model = booster.enable_lora(M.build("llama"), lora_config=cfg, quantize=True)
    with pytest.raises(ml.ConfigError, match=r"split the 4-bit base.*drop quantize"):
        booster.plan(model, world_size=2)
    # the plugin's default fp16 (Colossal-AI's test runs it) plans the 4-bit base
    booster = Booster(plugin=LowLevelZeroPlugin())
    model = booster.enable_lora(M.build("llama"), lora_config=cfg, quantize=True)
    plan = booster.plan(model, world_size=2)
    assert {e.dtype for e in plan.params if "keep_whole" in e.tags} == {"nf4"}
    p = Booster(plugin=LowLevelZeroPlugin(precision="fp32")).enable_lora(
        M.build("llama"), lora_config=cfg, bnb_quantization_config=ml.Quantize("fp4"))
    plan = Booster(plugin=LowLevelZeroPlugin(precision="fp32")).plan(p, world_size=2)
    assert {e.dtype for e in plan.params if "keep_whole" in e.tags} == {"fp4"}
