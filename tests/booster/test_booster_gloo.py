"""The Booster facade on 4 real gloo processes against one process.

* ``examples/booster_loop.py`` — a Colossal-AI loop whose only meshlab lines are its
  imports — runs under each of the six plugins (the MoE one on a small Mixtral): every
  step's loss (averaged over the data ranks) and the final weights equal a single-process
  AdamW run on the global batches, with the same scheduler and clipping.
* The guide's minimal scaffold (``HybridParallelPlugin(tp_size=2, pp_size=2, zero_stage=1,
  precision='bf16', num_microbatches=8, enable_all_optimization=True)`` with
  ``HybridAdam``) trains and matches one process under bf16 autocast.
* Checkpoints cross plugins: model, optimizer and scheduler saved under one plugin load
  under another, and the resumed run equals the uninterrupted one.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests import REPO

pytestmark = pytest.mark.timeout(900)
ROOT = os.fspath(REPO)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _global_batches(model, plugin_name: str, steps: int, batch_size: int, seed: int = 42,
                    start: int = 0):
    """The batches every data rank read, concatenated in data-rank order (the single
    process's global batch of each step)."""
    import torch.distributed as dist

    from examples import booster_loop as L

    plugin = L.make_plugin(plugin_name)
    rt = model._meshlab
    dl = plugin.prepare_dataloader(L.TextDataset(L.SEQ), batch_size=batch_size, shuffle=True,
                                   seed=seed, drop_last=True)
    mine = [b["input_ids"] for i, b in zip(range(start + steps), dl)][start:]
    coord = rt.mesh.coordinate(dist.get_rank())
    index = 0
    for a in rt.roles.data:
        index = index * rt.mesh.axis_size(a) + coord[a]
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (index, mine))
    by_index = dict(parts)
    return [torch.cat([by_index[i][s] for i in sorted(by_index)]) for s in range(steps)]


def _reference(plugin_name: str, data, lr: float = 1e-3, clip=None, bf16: bool = False,
               schedule: bool = True):
    """One process: the same model, AdamW, scheduler and clipping (one max-norm, or one per
    step) on the global batches."""
    from examples import booster_loop as L

    torch.manual_seed(42)
    ref = L.make_model(plugin_name)
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    losses = []
    clips = clip if isinstance(clip, list) else [clip] * len(data)
    for b, c in zip(data, clips):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = ref(input_ids=b, labels=b).loss
        loss.backward()
        if c is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), c)
        opt.step()
        opt.zero_grad()
        if schedule:
            sched.step()
        losses.append(loss.item())
    return ref, losses


def _mean_loss(model, losses):
    """This rank's losses averaged over the data ranks (the pipeline's are already)."""
    import torch.distributed as dist

    from meshlab.transforms.pipeline._runtime import PipelinePart

    rt = model._meshlab
    if rt.part(PipelinePart) is not None or rt.dp_group is None:
        return losses
    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t, group=rt.dp_group)
    return (t / rt.dp_size).tolist()


def _assert_weights(model, ref, atol, rtol):
    from torch.distributed.tensor import DTensor

    refp = dict(ref.named_parameters())
    n = 0
    for name, p in model.named_parameters():
        w = p.full_tensor() if isinstance(p, DTensor) else p
        torch.testing.assert_close(w.detach().float(), refp[name].detach().float(), atol=atol,
                                   rtol=rtol, msg=lambda m, name=name: f"weight {name}: {m}")
        n += 1
    assert n > 0
    return n


def _assert_updates(model, ref, start: dict, frac: float = 0.15, slack: float = 0.0) -> None:
    """Each weight's update is the one process's within ``frac`` of its norm (for bf16 and
    fp16, whose last-bit differences Adam's normalized step amplifies elementwise), plus
    ``slack``: one element's whole disagreement (2 x lr x steps), which in a small tensor
    (a 64-element norm weight) is more than ``frac`` of the norm by itself, so whether the
    check passed turned on one gradient's sign on one CPU's bf16 kernels."""
    from torch.distributed.tensor import DTensor

    refp = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        w = p.full_tensor() if isinstance(p, DTensor) else p
        moved = (refp[n].detach() - start[n]).norm()
        off = (w.detach().float() - refp[n].detach().float()).norm()
        assert moved > 0 and off <= frac * moved + slack, (n, float(off), float(moved))


CLIP = {"zero2": 1.0}


def loop_case(rank, world, plugin_name):
    from examples import booster_loop as L

    steps, bs = 3, 2
    if plugin_name == "fsdp_hybrid":        # two "nodes" of two ranks: rep=2 x dp=2
        os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        model, losses = L.train(plugin_name, steps=steps, batch_size=bs)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    data = _global_batches(model, plugin_name, steps, bs)
    ref, want = _reference(plugin_name, data, clip=CLIP.get(plugin_name))
    got = _mean_loss(model, losses)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-5)
    held = _assert_weights(model, ref, atol=2e-5, rtol=1e-4)
    mesh = model._meshlab.mesh
    w = next((p for p in model.parameters() if hasattr(p, "placements")), None)
    return {"losses": got, "params": held, "spec": repr(model._meshlab.plan.transforms),
            "mesh": {a: mesh.axis_size(a) for a in mesh.axis_names},
            "placements": None if w is None else str(w.placements)}


@pytest.fixture(scope="module")
def world():
    from tests._world import World

    w = World(4)
    yield w
    w.close()


@pytest.mark.parametrize("plugin_name", ["ddp", "fsdp", "fsdp_hybrid", "zero2", "gemini",
                                         "gemini_hybrid", "gemini_tp", "hybrid",
                                         "hybrid_offload", "hybrid_sp",
                                         "moe", "moe_sp", "moe_offload"])
def test_loop_matches_one_process(world, plugin_name):
    out = world.run(loop_case, plugin_name=plugin_name)
    assert all(o["losses"] == out[0]["losses"] for o in out)
    if plugin_name in ("gemini_tp", "hybrid_offload"):     # offload beside tp (and pp)
        assert "offload(" in out[0]["spec"] and "shard(" in out[0]["spec"], out[0]["spec"]
        assert out[0]["mesh"]["tp"] == 2, out[0]["mesh"]
    if plugin_name in ("hybrid_sp", "moe_sp"):             # a sequence mode beside pp / ep
        mode = "all_to_all" if plugin_name == "hybrid_sp" else "ring"
        assert f"sequence('sp', mode='{mode}')" in out[0]["spec"], out[0]["spec"]
        assert out[0]["mesh"]["sp"] == 2, out[0]["mesh"]
    if plugin_name == "moe_offload":
        assert "offload(" in out[0]["spec"] and "expert_route(" in out[0]["spec"]
    if plugin_name in ("fsdp_hybrid", "gemini_hybrid"):   # FSDP2 on (rep, dp)
        assert out[0]["mesh"] == {"rep": 2, "dp": 2}, out[0]["mesh"]
        assert out[0]["placements"] == "(Replicate(), Shard(dim=0))", out[0]["placements"]


# -- the guide's scaffold ------------------------------------------------------------------
GUIDE_SCAFFOLD = '''\
import colossalai
from colossalai.booster import Booster
from colossalai.booster.plugin import HybridParallelPlugin
from colossalai.nn.optimizer import HybridAdam

colossalai.launch_from_torch()
plugin = HybridParallelPlugin(tp_size=2, pp_size=2, zero_stage=1, precision="bf16",
                              num_microbatches=8, enable_all_optimization=True)
booster = Booster(plugin=plugin)
model, optimizer, *_ = booster.boost(model, HybridAdam(model.parameters(), lr=1e-4))
'''
IMPORTS = {"import colossalai": "from meshlab import booster as colossalai",
           "from colossalai.booster import": "from meshlab.booster import",
           "from colossalai.booster.plugin import": "from meshlab.booster.plugin import",
           "from colossalai.nn.optimizer import": "from meshlab.booster.optimizer import"}


def test_scaffold_is_the_guides_with_the_imports_changed():
    import textwrap

    with open(os.path.join(ROOT, "examples", "booster_scaffold.py")) as f:
        text = f.read()
    block = text.split("# -- scaffold:begin\n")[1].split("    # -- scaffold:end")[0]
    block = textwrap.dedent(block)
    want = GUIDE_SCAFFOLD
    for old, new in IMPORTS.items():
        want = want.replace(old, new, 1)
    norm = lambda s: " ".join(s.split())      # noqa: E731 (line wrapping aside)
    assert norm(block) == norm(want)


def scaffold_case(rank, world):
    from transformers import LlamaForCausalLM

    from examples import booster_scaffold as S

    model, losses, seen = S.run(steps=3)
    torch.manual_seed(1024)
    ref = LlamaForCausalLM(model.config)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, weight_decay=0.0)
    want = []
    for b in seen:                       # dp = 1: this rank's batch is the global batch
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ref(input_ids=b, labels=b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), atol=2e-2, rtol=0)
    # bf16 gradients differ in their last bits, and Adam's normalized step turns a tiny
    # gradient's sign into a whole step: compare each weight's update with the one
    # process's (relative norm), and every element within a few steps of lr.
    held = _assert_weights(model, ref, atol=1e-3, rtol=0)
    _assert_updates(model, ref, start, slack=2 * 1e-4 * 3)          # lr 1e-4, 3 steps
    spec = repr(model._meshlab.plan.transforms)
    return {"losses": losses, "want": want, "params": held, "spec": spec}


def test_guide_scaffold_trains_like_one_process(world):
    out = world.run(scaffold_case)
    spec = out[0]["spec"]
    for piece in ("shard(", "zero_shard(stage=1", "pipeline('pp'", "microbatches=8",
                  "fuse('rms_norm', 'rotary', 'attention', 'mlp', absent='leave')",
                  "compute='bfloat16'"):
        assert piece in spec, (piece, spec)
    assert sum(o["params"] for o in out) > 0


# -- checkpoints across plugins --------------------------------------------------------------
def resume_case(rank, world, src, dst, path):
    import torch.distributed as dist

    from examples import booster_loop as L

    first, _ = L.train(src, steps=2, save=path)
    early = _global_batches(first, src, 2, 2)
    model, losses = L.train(dst, steps=1, resume=path, start=2)
    late = _global_batches(model, dst, 1, 2, start=2)
    ref, want = _reference(dst, early + late, clip=[CLIP.get(src)] * 2 + [CLIP.get(dst)])
    got = _mean_loss(model, losses)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want[2:]), atol=1e-5, rtol=1e-5)
    held = _assert_weights(model, ref, atol=2e-5, rtol=1e-4)
    dist.barrier()
    return held


@pytest.mark.parametrize("src,dst", [("zero2", "hybrid"), ("hybrid", "gemini"),
                                     ("fsdp", "ddp")])
def test_checkpoints_load_under_another_plugin(world, tmp_path_factory, src, dst):
    path = str(tmp_path_factory.mktemp("ckpt"))
    out = world.run(resume_case, src=src, dst=dst, path=path)
    assert sum(out) > 0
    assert os.path.isfile(os.path.join(path, "lr_scheduler.json"))
    if src == "hybrid":            # its model went out as a Hugging Face export
        assert os.path.isfile(os.path.join(path, "model", "model.safetensors"))
        assert os.path.isfile(os.path.join(path, "model", "config.json"))


# -- the rest of the Booster surface -----------------------------------------------------------
def _boosted(plugin, mixed=None, lr=1e-3, lora=None, name="ddp"):
    from examples import booster_loop as L
    from meshlab.booster import Booster

    L.colossalai.launch_from_torch(seed=42, verbose=False)
    booster = Booster(plugin=plugin, mixed_precision=mixed)
    model = L.make_model(name)
    if lora is not None:
        model = booster.enable_lora(model, lora_config=lora)
    opt = L.HybridAdam([p for p in model.parameters() if p.requires_grad] if lora is None
                       else model.parameters(), lr=lr, weight_decay=0.01)
    model, opt, *_ = booster.boost(model, opt)
    return booster, model, opt


def _local(batch):
    import torch.distributed as dist

    return batch.chunk(dist.get_world_size())[dist.get_rank()]


def accumulate_case(rank, world):
    """Two microbatches per step under booster.no_sync equal one process's global batch."""
    from meshlab.booster import TorchDDPPlugin

    booster, model, opt = _boosted(TorchDDPPlugin())
    data = [torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(s))
            for s in range(2)]
    sent = []
    for b in data:
        mb0, mb1 = _local(b).chunk(2)
        with booster.no_sync(model):
            booster.backward(model(input_ids=mb0, labels=mb0).loss / 2, opt)
        grads_local = [p.grad.clone() for p in model.parameters()][:1]
        booster.backward(model(input_ids=mb1, labels=mb1).loss / 2, opt)
        sent.append(not torch.equal(grads_local[0], next(model.parameters()).grad))
        opt.step()
        opt.zero_grad()
    ref, _ = _reference("ddp", data, schedule=False)
    _assert_weights(model, ref, atol=2e-5, rtol=1e-4)
    return sent


def test_no_sync_accumulates_like_one_process(world):
    assert all(all(s) for s in world.run(accumulate_case))


def lora_case(rank, world, path):
    """enable_lora under ZeRO-2 trains the adapters as single-process peft does; the
    adapter written by save_lora_as_pretrained (peft's adapter_model.bin by default, as
    Colossal-AI writes it; safetensors with use_safetensors=True) loads with PeftModel and
    back into the boosted model."""
    import torch.distributed as dist
    from peft import LoraConfig, PeftModel, get_peft_model

    from examples import booster_loop as L
    from meshlab.booster import LowLevelZeroPlugin

    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    booster, model, opt = _boosted(LowLevelZeroPlugin(stage=2, precision="fp32"), lora=cfg,
                                   lr=1e-2)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    torch.manual_seed(42)
    ref = get_peft_model(L.make_model("ddp"), cfg)
    with torch.no_grad():                      # the adapters' A as the sharded model drew it
        own = dict(ref.base_model.model.named_parameters())
        for n, p in model.named_parameters():
            own[n].copy_(p.full_tensor() if hasattr(p, "full_tensor") else p)
    ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2,
                             weight_decay=0.01)
    for s in range(2):
        b = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(s))
        x = _local(b)
        booster.backward(model(input_ids=x, labels=x).loss, opt)
        opt.step()
        opt.zero_grad()
        ref(input_ids=b, labels=b).loss.backward()
        ropt.step()
        ropt.zero_grad()
    own = dict(ref.base_model.model.named_parameters())
    for n in sorted(trainable):               # the same order on every rank (collectives)
        p = dict(model.named_parameters())[n]
        torch.testing.assert_close(p.full_tensor() if hasattr(p, "full_tensor") else p,
                                   own[n], atol=2e-5, rtol=1e-4)
    booster.save_lora_as_pretrained(model, path)     # Colossal-AI's default: peft's .bin
    booster.save_lora_as_pretrained(model, path + "_safe", use_safetensors=True)
    dist.barrier()
    import os

    assert os.path.isfile(os.path.join(path, "adapter_model.bin"))
    assert os.path.isfile(os.path.join(path + "_safe", "adapter_model.safetensors"))
    torch.manual_seed(0)
    back = PeftModel.from_pretrained(L.make_model("ddp"), path)
    x = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        base = dict(ref.base_model.model.named_parameters())
        for n, p in back.base_model.model.named_parameters():
            if "lora_" not in n:
                p.copy_(base[n])
        torch.testing.assert_close(back(input_ids=x).logits, ref(input_ids=x).logits,
                                   atol=1e-5, rtol=1e-4)
    import meshlab as ml

    for where in (path, path + "_safe"):      # both files load back into the boosted model
        saved = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                 for n, p in model.named_parameters() if "lora_" in n}
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.zero_()
        ml.load_adapter(where, model)
        for n, p in model.named_parameters():
            if "lora_" in n:
                assert torch.equal(p.full_tensor() if hasattr(p, "full_tensor") else p,
                                   saved[n]), (where, n)
    return len(trainable)


def test_enable_lora_and_save_lora_as_pretrained(world, tmp_path):
    pytest.importorskip("peft")
    assert min(world.run(lora_case, path=str(tmp_path / "adapter"))) > 0


def precision_case(rank, world, plugin):
    """fp16 (dynamic loss scale) and bf16 through the Booster train as one process does
    under the same autocast, within the dtype's rounding; the loss scale moves alike on
    every rank."""
    import torch.distributed as dist

    from meshlab.booster import HybridParallelPlugin, LowLevelZeroPlugin, TorchDDPPlugin

    kind, dtype = {"zero_fp16": (LowLevelZeroPlugin(stage=1, precision="fp16",
                                                    initial_scale=2 ** 10), torch.float16),
                   "ddp_bf16": (TorchDDPPlugin(), torch.bfloat16),
                   "pp_fp16": (HybridParallelPlugin(tp_size=1, pp_size=2, precision="fp16",
                                                    num_microbatches=2,
                                                    initial_scale=2 ** 10), torch.float16)
                   }[plugin]
    booster, model, opt = _boosted(kind, mixed="bf16" if plugin == "ddp_bf16" else None)
    data = [torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(s))
            for s in range(3)]
    pp = dist.get_world_size() // model._meshlab.dp_size
    losses = []
    for b in data:
        if plugin == "pp_fp16":
            x = b.chunk(model._meshlab.dp_size)[model._meshlab.mesh.coordinate(rank)["dp"]]
            loss = booster.execute_pipeline(iter([{"input_ids": x, "labels": x}]), model,
                                            lambda o, i: o.loss, opt)["loss"]
        else:
            x = _local(b)
            loss = model(input_ids=x, labels=x).loss
            booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    from examples import booster_loop as L

    torch.manual_seed(42)
    ref = L.make_model("ddp")
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    want = []
    for b in data:
        with torch.autocast("cpu", dtype=dtype):
            loss = ref(input_ids=b, labels=b).loss
        loss.backward()
        ropt.step()
        ropt.zero_grad()
        want.append(loss.item())
    got = _mean_loss(model, losses)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=2e-2, rtol=0)
    _assert_updates(model, ref, start)       # elementwise, a few lr-sized steps apart at most
    scaler = getattr(opt, "scaler", None)
    return (pp, None if scaler is None else (scaler.scale, scaler.skipped))


@pytest.mark.parametrize("plugin", ["zero_fp16", "ddp_bf16", "pp_fp16"])
def test_mixed_precision_through_the_booster(world, plugin):
    out = world.run(precision_case, plugin=plugin)
    assert all(o == out[0] for o in out)
    if plugin.endswith("fp16"):
        scale, skipped = out[0][1]
        assert skipped == 0 and scale == 2 ** 10       # no overflow at this scale


def buffers_case(rank, world):
    """broadcast_buffers (TorchDDPPlugin's default) makes every rank's buffers rank 0's
    before each forward, as DDP does."""
    import torch.distributed as dist

    from meshlab.booster import TorchDDPPlugin

    out = []
    for on in (True, False):
        _, model, _ = _boosted(TorchDDPPlugin(broadcast_buffers=on))
        name, buf = next((n, b) for n, b in model.named_buffers() if b.is_floating_point())
        with torch.no_grad():
            buf.add_(float(dist.get_rank()))
        x = torch.randint(0, 256, (1, 8))
        model(input_ids=x)
        flat = torch.stack([b.detach().sum() for b in [buf]])
        every = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(every, flat)
        out.append(all(torch.equal(e, every[0]) for e in every))
    return out


def test_broadcast_buffers(world):
    assert all(o == [True, False] for o in world.run(buffers_case))


def dropped_key_case(rank, world):
    """A pipelined model's stages read input_ids, attention_mask and position_ids (and
    the loss labels): a padding mask trains, a key the stages would drop is refused on
    every rank (by the pipeline room, so ml.step refuses it too)."""
    import meshlab as ml
    from meshlab.booster import HybridParallelPlugin

    booster, model, opt = _boosted(HybridParallelPlugin(tp_size=1, pp_size=2, precision="fp32",
                                                        num_microbatches=2))
    x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    ones = {"input_ids": x, "labels": x, "attention_mask": torch.ones_like(x)}
    booster.execute_pipeline(iter([ones]), model, lambda o, i: o.loss, opt)
    padded = {**ones, "attention_mask": torch.ones_like(x).index_fill_(1, torch.tensor([15]), 0)}
    booster.execute_pipeline(iter([padded]), model, lambda o, i: o.loss, opt)
    try:
        booster.execute_pipeline(iter([{**ones, "token_type_ids": torch.zeros_like(x)}]),
                                 model, lambda o, i: o.loss, opt)
    except ml.ConfigError as e:
        return str(e)
    raise AssertionError("a batch key the stages do not read was dropped silently")


def test_pipeline_refuses_keys_it_would_drop(world):
    assert all("batch key(s) ['token_type_ids'] would be dropped" in m
               for m in world.run(dropped_key_case))


def groups_case(rank, world):
    """Optimizers with a first param group of frozen parameters only (its own rate and
    weight decay), boosted with a scheduler built before ``boost``: LambdaLR over three
    groups, OneCycleLR (which keeps ``max_lr`` and its momentum cycle in the groups) over
    two. Returns, for each, the largest weight difference from one process on the global
    batches, and the boosted and single-process rates at the end."""
    from torch import nn
    from torch.optim import lr_scheduler as L

    from meshlab.booster import Booster, TorchDDPPlugin

    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(4, 8, 4, generator=g, dtype=torch.float64), \
        torch.randn(4, 8, 2, generator=g, dtype=torch.float64)

    def build():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 2)).double()
        m[0].requires_grad_(False)                    # frozen, as embeddings often are
        return m

    cases = {
        "lambda": (lambda m: [{"params": m[0].parameters(), "lr": 0.5, "weight_decay": 0.3},
                              {"params": m[2].parameters(), "lr": 0.05},
                              {"params": m[4].parameters(), "lr": 0.01}],
                   lambda o: L.LambdaLR(o, lambda e: 1.0 / (1 + e))),
        "onecycle": (lambda m: [{"params": m[0].parameters(), "lr": 0.5, "weight_decay": 0.3},
                                {"params": [*m[2].parameters(), *m[4].parameters()]}],
                     lambda o: L.OneCycleLR(o, max_lr=0.2, total_steps=4))}
    out = {}
    for name, (groups, sched) in cases.items():
        finals, rates = [], []
        for boosted in (False, True):
            m = build()
            opt = torch.optim.SGD(groups(m), lr=0.1, momentum=0.9)
            s = sched(opt)
            n, r = (world, rank) if boosted else (1, 0)
            if boosted:
                m, opt, _, _, s = Booster(plugin=TorchDDPPlugin()).boost(m, opt,
                                                                         lr_scheduler=s)
            for x, y in zip(xs, ys):
                ((m(x.chunk(n)[r]) - y.chunk(n)[r]) ** 2).mean().backward()
                opt.step()
                opt.zero_grad()
                s.step()
            finals.append({k.removeprefix("module."): v.detach().clone()
                           for k, v in m.state_dict().items()})
            rates.append([gr["lr"] for gr in opt.param_groups])
        out[name] = (max(float((finals[1][k] - v).abs().max()) for k, v in finals[0].items()),
                     rates[1], rates[0][1:])
    return out


def test_a_frozen_first_group_and_a_scheduler_boost_as_built(world):
    """Before, ``boost`` rebuilt the optimizer from its first group's options, the frozen
    group's (rate 0.5, weight decay 0.3, weights 0.42 off one process); the scheduler's
    rates moved by position onto the next group, and OneCycleLR failed with KeyError
    'max_lr'. The rebuilt groups now take the options of the groups they were built from,
    and the scheduler's per-group state follows them."""
    for out in world.run(groups_case):
        for name, (worst, got, want) in out.items():
            assert worst < 1e-12, (name, worst)
            assert got == pytest.approx(want, rel=1e-12), (name, got, want)
