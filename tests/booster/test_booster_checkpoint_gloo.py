"""The Booster's checkpoint methods on 2 gloo ranks, where a load could go silently wrong:

* ``load_model`` of a base model's export (safetensors or DCP) into a model after
  ``enable_lora`` loads every base weight through peft's names (``.base_layer.``, both
  copies of a module to save), strict or not; the adapters keep their values;
* every save records its step, and a resume that mixes a model of one step with an
  optimizer or scheduler of another raises before anything of it is loaded, naming both
  steps; the optimizer's step count resumes with it.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests import REPO

pytestmark = pytest.mark.timeout(600)
ROOT = os.fspath(REPO)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _full(p):
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()


def _boosted(plugin, lora=None, seed=42):
    from examples import booster_loop as L
    from meshlab.booster import Booster

    L.colossalai.launch_from_torch(seed=seed, verbose=False)
    booster = Booster(plugin=plugin)
    model = L.make_model("ddp")
    if lora is not None:
        model = booster.enable_lora(model, lora_config=lora)
    opt = L.HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt, *_ = booster.boost(model, opt)
    return booster, model, opt


def lora_base_case(rank, world, path, safetensors, strict):
    import torch.distributed as dist
    from peft import LoraConfig

    from meshlab.booster import LowLevelZeroPlugin, TorchDDPPlugin

    b0, base, _ = _boosted(TorchDDPPlugin())
    b0.save_model(base, path, use_safetensors=safetensors)
    want = {n: _full(p) for n, p in base.named_parameters()}
    dist.barrier()
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                     modules_to_save=["lm_head"])
    booster, model, _ = _boosted(LowLevelZeroPlugin(stage=2, precision="fp32"), lora=cfg, seed=7)
    names = sorted(n for n, _ in model.named_parameters())      # one order on every rank
    params = dict(model.named_parameters())
    before = {n: _full(params[n]) for n in names}
    booster.load_model(model, path, strict=strict)
    loaded = 0
    for n in names:
        got = _full(params[n])
        if ".lora_" in n:
            assert torch.equal(got, before[n]), n             # the adapters keep theirs
            continue
        key = n.replace(".base_layer.", ".").replace(".original_module.", ".")
        key = key.replace(".modules_to_save.default.", ".")
        assert torch.equal(got, want[key]), f"{n} was not loaded from {key}"
        loaded += ".base_layer." in n or ".modules_to_save." in n
    return loaded


@pytest.mark.parametrize("safetensors", [True, False])
@pytest.mark.parametrize("strict", [False, True])
def test_a_base_model_loads_into_lora_through_peft_names(world2, tmp_path, safetensors, strict):
    pytest.importorskip("peft")
    out = world2.run(lora_base_case, path=str(tmp_path / "base"), safetensors=safetensors,
                     strict=strict)
    assert out[0] == 4 * 2 + 1          # q_proj and v_proj of 4 layers, lm_head's copy


def steps_case(rank, world, path):
    import torch.distributed as dist

    from meshlab.booster import TorchDDPPlugin
    from meshlab.checkpoint import CheckpointStepError

    def run():
        booster, model, opt = _boosted(TorchDDPPlugin())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
        return booster, model, opt, sched

    def train(booster, model, opt, sched, seed):
        b = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(seed))
        x = b.chunk(dist.get_world_size())[dist.get_rank()]
        booster.backward(model(input_ids=x, labels=x).loss, opt)
        opt.step()
        opt.zero_grad()
        sched.step()

    def save(booster, model, opt, sched, where):
        booster.save_model(model, f"{where}/model")
        booster.save_optimizer(opt, f"{where}/optimizer")
        booster.save_lr_scheduler(sched, f"{where}/lr_scheduler.json")

    first = run()
    for step in (1, 2):
        train(*first, seed=step)
        save(*first, f"{path}/step-{step}")
    booster, model, opt, sched = run()
    booster.load_model(model, f"{path}/step-2/model")
    before = {k: dict(v) for k, v in opt.state.items()}
    msgs = []
    for load in (lambda: booster.load_optimizer(opt, f"{path}/step-1/optimizer"),
                 lambda: booster.load_lr_scheduler(sched, f"{path}/step-1/lr_scheduler.json")):
        try:
            load()
        except CheckpointStepError as e:
            msgs.append(str(e))
        else:
            raise AssertionError("a resume mixed steps 2 and 1 without a word")
    assert opt.state.keys() == before.keys() and opt.steps == 0    # nothing was loaded
    booster.load_optimizer(opt, f"{path}/step-2/optimizer")
    booster.load_lr_scheduler(sched, f"{path}/step-2/lr_scheduler.json")
    resumed = opt.steps
    # the model last: a part loaded first is checked too
    b2, m2, o2, s2 = run()
    b2.load_optimizer(o2, f"{path}/step-1/optimizer")
    try:
        b2.load_model(m2, f"{path}/step-2/model")
    except CheckpointStepError as e:
        msgs.append(str(e))
    else:
        raise AssertionError("a model of step 2 joined an optimizer of step 1")
    # a step trains on from what was loaded: a later load starts a new resume
    train(booster, model, opt, sched, seed=3)
    booster.load_model(model, f"{path}/step-1/model")
    booster.load_optimizer(opt, f"{path}/step-1/optimizer")
    return msgs, resumed, opt.steps


def test_a_resume_that_mixes_steps_raises(world2, tmp_path):
    out = world2.run(steps_case, path=str(tmp_path))
    for msgs, resumed, after in out:
        assert resumed == 2 and after == 1
        assert "step-1/optimizer was saved at step 1, but the model" in msgs[0], msgs[0]
        assert "at step 2" in msgs[0]
        assert "lr_scheduler.json was saved at step 1, but the model" in msgs[1], msgs[1]
        assert "step-2/model was saved at step 2, but the optimizer" in msgs[2], msgs[2]
        assert "at step 1" in msgs[2]


def tied_case(rank, world, path, source, target):
    """A Llama whose head is tied to its embeddings, saved as a sharded directory under
    one plugin and loaded strictly under another: every weight the target holds (the
    head's copy a pipeline's last stage keeps under ZeRO among them) is the source's.
    A pipeline holds the tied weight by one name and the plugins without one by both:
    before, the load was refused ('lm_head.weight' missing, or unexpected)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from examples import booster_loop as L
    from meshlab.booster import Booster, HybridParallelPlugin, TorchDDPPlugin

    L.colossalai.launch_from_torch(seed=42, verbose=False)
    plugins = {"pp2": lambda: HybridParallelPlugin(tp_size=1, pp_size=2, precision="fp32",
                                                   num_microbatches=2),
               "pp2_zero2": lambda: HybridParallelPlugin(tp_size=1, pp_size=2, zero_stage=2,
                                                         precision="fp32", num_microbatches=2),
               "ddp": TorchDDPPlugin}
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    saved = {}
    for seed, name in ((0, source), (7, target)):
        torch.manual_seed(seed)
        booster = Booster(plugin=plugins[name]())
        model, *_ = booster.boost(LlamaForCausalLM(cfg))
        if name == source and seed == 0:
            booster.save_model(model, path)
            torch.manual_seed(0)
            ref = LlamaForCausalLM(cfg)
            saved = {n: p.detach().clone() for n, p in ref.named_parameters()}
            saved["lm_head.weight"] = saved["model.embed_tokens.weight"]
    booster.load_model(model, path)
    worst = max(float((_full(p) - saved[n]).abs().max()) for n, p in model.named_parameters())
    names = sorted(n for n, _ in model.named_parameters())
    return worst, "lm_head.weight" in names


@pytest.mark.parametrize("source,target", [("pp2", "ddp"), ("ddp", "pp2"),
                                           ("pp2", "pp2_zero2"), ("pp2_zero2", "ddp")])
def test_a_tied_heads_checkpoint_crosses_between_a_pipeline_and_none(world2, tmp_path,
                                                                      source, target):
    out = world2.run(tied_case, path=str(tmp_path / "ckpt"), source=source, target=target)
    assert all(worst == 0.0 for worst, _ in out), out
    if target == "pp2_zero2":       # the last stage's own copy of the head was loaded
        assert any(has_head for _, has_head in out), out
