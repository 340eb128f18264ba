"""Colossal-AI's checkpoint-IO cases, rewritten in meshlab's code, on 2 gloo processes.

``tests/test_checkpoint_io/test_plugins_huggingface_compatibility.py``: a Llama boosted
under ``TorchDDPPlugin``, ``LowLevelZeroPlugin(stage=2, max_norm=1.0, initial_scale=32)``
and ``GeminiPlugin(precision='fp16', initial_scale=32)`` with ``HybridAdam`` takes one step,
``booster.save_model(model, path, shard=True, size_per_shard=32)`` (no safetensors asked
for), and ``from_pretrained`` of the class reads the directory back; boosted again, its
state dict equals the saved model's (``unwrap().state_dict()``; Gemini's
``state_dict(only_rank_0=False)``). Tighter than the original: exactly equal, where its
``check_state_dict_equal`` allows 1e-3, and the directory holds several shards of at most
``size_per_shard`` with their index (1 MB, for a Llama of about 4 MB).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests import _models as M

pytestmark = pytest.mark.timeout(600)


def _passes_on_every_rank(world, tmp_path_factory, case, **kw) -> None:
    """Run ``case`` on every rank of ``world`` with a shared directory of its own
    (``path``); each rank returns True once its assertions held."""
    path = str(tmp_path_factory.getbasetemp() / case.__name__)
    assert all(world.run(case, path=path, **kw))


WIDE = dict(hidden_size=256, intermediate_size=512)     # 2 blocks of about 2.6 MB


def _boosted(plugin, opt_cls, **opt_kw):
    """(booster, model, optimizer): the small Llama boosted under ``plugin``."""
    import meshlab as ml
    from meshlab.booster import Booster

    booster = Booster(plugin=plugin)
    model = ml.init_weights(M.build("llama"), seed=0)
    model, opt, *_ = booster.boost(model, opt_cls(model.parameters(), **opt_kw))
    return booster, model, opt


def _one_step(booster, model, opt, rank, world) -> None:
    """One step on this rank's share of a batch of 4."""
    ids = M.batches(1, batch=4)[0].chunk(world)[rank]
    booster.backward(model(input_ids=ids, labels=ids).loss, opt)
    opt.step()


def hf_compat_case(rank, world, plugin_type, path):
    import torch.distributed as dist

    import meshlab as ml
    from meshlab.booster import Booster
    from meshlab.booster.nn.optimizer import HybridAdam
    from meshlab.booster.plugin import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin

    plugin = {"ddp": lambda: TorchDDPPlugin(),
              "zero": lambda: LowLevelZeroPlugin(stage=2, max_norm=1.0, initial_scale=32),
              "gemini": lambda: GeminiPlugin(precision="fp16", initial_scale=32)}[plugin_type]()
    booster = Booster(plugin=plugin)
    model = ml.init_weights(M.build("llama", **WIDE), seed=0)
    cls = type(model)
    optimizer = HybridAdam(model.parameters(), lr=1e-3)
    criterion = lambda out: out.loss          # noqa: E731  (the zoo's loss for causal LMs)
    model, optimizer, criterion, _, _ = booster.boost(model, optimizer, criterion)
    ids = M.batches(1, batch=2)[0]
    loss = criterion(model(input_ids=ids, labels=ids))
    booster.backward(loss, optimizer)
    optimizer.step()

    where = os.path.join(path, plugin_type, "model")
    # use_async as test_hybrid_parallel_plugin_checkpoint_io.py passes it: the export is
    # complete when save_model returns
    # a fraction of a MB as test_gemini_checkpoint_io.py passes one (the model's size / 3)
    mb = 1.5 if plugin_type == "gemini" else 1
    booster.save_model(model, where, shard=True, size_per_shard=mb,
                       use_async=plugin_type == "zero")
    dist.barrier()
    files = sorted(os.listdir(where))
    largest = max(p.numel() * p.element_size() for p in model.unwrap().parameters())
    for f in (f for f in files if f.endswith(".safetensors")):
        assert os.path.getsize(os.path.join(where, f)) <= mb * 2 ** 20 + largest + 2 ** 16, f
    index = json.load(open(os.path.join(where, "model.safetensors.index.json")))
    new = cls.from_pretrained(where)
    new_optimizer = HybridAdam(new.parameters(), lr=1e-3)
    new, new_optimizer, criterion, _, _ = booster.boost(new, new_optimizer, criterion)
    if plugin_type == "gemini":
        a, b = model.state_dict(only_rank_0=False), new.state_dict(only_rank_0=False)
    else:
        a, b = model.unwrap().state_dict(), new.unwrap().state_dict()
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    for k in a:
        assert torch.equal(M.full(a[k]), M.full(b[k])), k
    dist.barrier()
    return files, sorted(set(index["weight_map"].values()))


@pytest.mark.parametrize("plugin_type", ["ddp", "zero", "gemini"])
def test_a_sharded_save_loads_with_from_pretrained(world2, tmp_path_factory, plugin_type):
    path = str(tmp_path_factory.getbasetemp() / "hf_compat")
    files, shards = world2.run(hf_compat_case, plugin_type=plugin_type, path=path)[0]
    assert len(shards) > 1 and set(shards) <= set(files), (files, shards)
    assert "config.json" in files and not any(f.endswith(".bin") for f in files), files


def gemini_frac_case(rank, world):
    """``tests/test_checkpoint_io/test_gemini_checkpoint_io.py``'s optimizer placement
    ``{"placement_policy": "static", "shard_param_frac": 0.0, "offload_optim_frac": 0.5}``
    (ZeRO-2 with half the optimizer offloaded) plans zero_shard(2), and its
    ``shard_param_frac=0.5`` zero_shard(3, reshard=0.5) (the first half of the blocks freed
    after their forward, the rest kept gathered to their backward, as FSDP2 reports); both
    train as ``shard_param_frac=1.0`` (zero_shard(3)) does, to float32 rounding."""
    import meshlab as ml
    from meshlab.booster import Booster
    from meshlab.booster.nn.optimizer import HybridAdam
    from meshlab.booster.plugin import GeminiPlugin

    def train(**placement):
        booster = Booster(plugin=GeminiPlugin(precision="fp32", **placement))
        model = ml.init_weights(M.build("llama"), seed=0)
        optimizer = HybridAdam(model.parameters(), lr=1e-3)
        model, optimizer, *_ = booster.boost(model, optimizer)
        for ids in M.batches(2, batch=4):
            mine = ids.chunk(world)[rank]
            booster.backward(model(input_ids=mine, labels=mine).loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
        rooms = [repr(t) for t in model.unwrap()._meshlab.plan.rooms]
        freed = [getattr(b._get_fsdp_state()._fsdp_param_group, "post_forward_mesh_info",
                         None) is not None for b in model.unwrap().model.layers]
        return {n: M.full(p).detach().clone() for n, p in model.unwrap().named_parameters()}, \
            (rooms, freed)

    zero2, (rooms, freed) = train(placement_policy="static", shard_param_frac=0.0,
                                  offload_optim_frac=0.5)
    assert any("zero_shard(stage=2" in r for r in rooms) and not any(freed), (rooms, freed)
    half, (rooms, freed) = train(placement_policy="static", shard_param_frac=0.5,
                                 offload_optim_frac=0.5)
    assert any("zero_shard(stage=3, axis='dp', reshard=0.5" in r for r in rooms), rooms
    assert freed == [True] * (len(freed) // 2) + [False] * (len(freed) - len(freed) // 2), \
        freed
    whole, (rooms, freed) = train(placement_policy="static", offload_optim_frac=0.5)
    assert any("zero_shard(stage=3" in r for r in rooms) and all(freed), (rooms, freed)
    for n in whole:
        for got in (zero2, half):
            torch.testing.assert_close(got[n], whole[n], atol=1e-6, rtol=1e-5,
                                       msg=lambda m, n=n: f"{n}: {m}")
    return True


def test_gemini_shard_param_frac(world2):
    assert all(world2.run(gemini_frac_case))


def lazy_pretrained_case(rank, world, path):
    """``tests/test_checkpoint_io/test_gemini_checkpoint_io.py``'s
    ``exam_lazy_from_pretrained``: a Llama loaded with ``from_pretrained`` inside
    ``LazyInitContext`` and boosted by ``GeminiPlugin`` holds the directory's weights (here
    exactly, in the checkpoint's dtype; Colossal-AI's compares in half precision), and its
    one-file save is those weights. Built there, it holds no memory before boost."""
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    import meshlab as ml
    from meshlab.booster import Booster
    from meshlab.booster.lazy import LazyInitContext
    from meshlab.booster.plugin import GeminiPlugin

    if rank == 0:
        ml.init_weights(M.build("llama"), seed=3).save_pretrained(path)
    dist.barrier()
    want = LlamaForCausalLM.from_pretrained(path).state_dict()
    with LazyInitContext():
        model = LlamaForCausalLM.from_pretrained(path)
    assert all(p.is_meta for p in model.parameters())
    booster = Booster(plugin=GeminiPlugin(precision="fp32"))
    model, *_ = booster.boost(model)
    got = model.state_dict(only_rank_0=False)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(M.full(got[k]).cpu(), want[k]), k
    booster.save_model(model, os.path.join(path, "model.pt"), shard=False)
    dist.barrier()
    saved = torch.load(os.path.join(path, "model.pt"), weights_only=True)
    assert all(torch.equal(saved[k], want[k]) for k in want)
    with pytest.raises(ml.ConfigError, match="dtype= and config= only"), LazyInitContext():
        LlamaForCausalLM.from_pretrained(path, attn_implementation="eager")
    dist.barrier()
    return True


def test_lazy_from_pretrained_boosts_with_the_directorys_weights(world2, tmp_path_factory):
    _passes_on_every_rank(world2, tmp_path_factory, lazy_pretrained_case)


def one_file_case(rank, world, plugin_type, suffix, path):
    """``tests/test_checkpoint_io/test_torch_ddp_checkpoint_io.py`` and
    ``test_low_level_zero_checkpoint_io.py`` with ``shard=False``: ``save_model`` of a path
    ``model.pt`` / ``model.safetensors`` writes one file (``torch.load`` or safetensors reads
    it, with the trained weights: tighter than the originals, which only load it back), and
    ``load_model`` of it into a fresh boosted model gives the same weights exactly."""
    import torch.distributed as dist

    from meshlab.booster.plugin import LowLevelZeroPlugin, TorchDDPPlugin

    def boosted():
        plugin = TorchDDPPlugin() if plugin_type == "ddp" else LowLevelZeroPlugin(stage=2)
        return _boosted(plugin, torch.optim.SGD, lr=0.1)

    booster, model, opt = boosted()
    _one_step(booster, model, opt, rank, world)
    where = os.path.join(path, f"{plugin_type}-model{suffix}")
    booster.save_model(model, where)
    want = {n: M.full(p).detach().clone() for n, p in model.unwrap().named_parameters()}
    if suffix == ".safetensors":
        from safetensors.torch import load_file

        saved = load_file(where)
    else:
        saved = torch.load(where, weights_only=True)
    assert os.path.isfile(where) and not os.path.exists(where + ".meshlab-export")
    for n, w in want.items():
        assert torch.equal(saved[n], w), n
    booster2, fresh, _ = boosted()
    booster2.load_model(fresh, where)
    for n, p in fresh.unwrap().named_parameters():
        assert torch.equal(M.full(p), want[n]), n
    dist.barrier()
    return True


@pytest.mark.parametrize("plugin_type,suffix", [("ddp", ".pt"), ("zero", ".safetensors"),
                                                ("zero", ".pt")])
def test_a_file_path_saves_one_file(world2, tmp_path_factory, plugin_type, suffix):
    _passes_on_every_rank(world2, tmp_path_factory, one_file_case, plugin_type=plugin_type,
                          suffix=suffix)


def gemini_optimizer_case(rank, world, path):
    """``tests/test_checkpoint_io/test_gemini_checkpoint_io.py``'s optimizer half:
    ``optimizer.state_dict(only_rank_0=False)`` of a Gemini-boosted optimizer holds every
    state tensor whole on every rank (``only_rank_0=True``: rank 0 only), and a new boosted
    optimizer that loads what ``save_optimizer`` wrote gives the same dict exactly."""
    import torch.distributed as dist

    from meshlab.booster.nn.optimizer import HybridAdam
    from meshlab.booster.plugin import GeminiPlugin

    def boosted():
        return _boosted(GeminiPlugin(precision="fp32"), HybridAdam, lr=1e-3)

    booster, model, opt = boosted()
    _one_step(booster, model, opt, rank, world)
    full = opt.state_dict(only_rank_0=False)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    whole = [st["exp_avg"].shape for st in full["state"].values()]
    assert sorted(map(tuple, whole)) == sorted(shapes.values()), (whole, shapes)
    assert all(not hasattr(v, "placements") for st in full["state"].values()
               for v in st.values())
    mine = opt.state_dict(only_rank_0=True)
    assert (mine == {}) == (rank != 0)
    where = os.path.join(path, "gemini-optimizer")
    booster.save_optimizer(opt, where)
    booster2, _, opt2 = boosted()
    booster2.load_optimizer(opt2, where)
    back = opt2.state_dict(only_rank_0=False)
    assert full["state"].keys() == back["state"].keys()
    for k, st in full["state"].items():
        for n, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(back["state"][k][n])), (k, n)
    dist.barrier()
    return True


def test_gemini_optimizer_state_dict_gathers_whole_tensors(world2, tmp_path_factory):
    _passes_on_every_rank(world2, tmp_path_factory, gemini_optimizer_case)


def scheduler_case(rank, world, path):
    """A Colossal-AI warm-up scheduler passed to ``boost`` (as every Colossal-AI example
    passes one) drives the rebuilt optimizer through and past its warm-up (the cosine or
    multi-step scheduler inside it follows the rebuilt optimizer too), and one resumed with
    ``save_lr_scheduler``/``load_lr_scheduler`` goes on exactly as the saved one: the
    milestones JSON wrote with string keys are steps again."""
    import math

    import torch.distributed as dist

    from meshlab.booster import Booster
    from meshlab.booster.nn.lr_scheduler import CosineAnnealingWarmupLR, MultiStepWarmupLR
    from meshlab.booster.plugin import TorchDDPPlugin

    def boosted(make):
        torch.manual_seed(0)
        booster = Booster(plugin=TorchDDPPlugin())
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=make(opt))
        return booster, model, opt, sched

    def step(model, opt, sched):
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        return opt.param_groups[0]["lr"]

    cos = [(t + 1) / 2 for t in range(2)] + [(1 + math.cos(math.pi * k / 6)) / 2
                                              for k in range(6)]
    cases = {"multistep": (lambda o: MultiStepWarmupLR(o, total_steps=8, warmup_steps=1,
                                                       milestones=[3, 5], gamma=0.5),
                           [1.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.25]),
             "cosine": (lambda o: CosineAnnealingWarmupLR(o, total_steps=8, warmup_steps=2),
                        cos)}
    for name, (make, want) in cases.items():
        booster, model, opt, sched = boosted(make)
        got = [opt.param_groups[0]["lr"]] + [step(model, opt, sched) for _ in range(2)]
        where = os.path.join(path, f"{name}.json")
        booster.save_lr_scheduler(sched, where)
        dist.barrier()
        booster2, model2, opt2, sched2 = boosted(make)
        booster2.load_lr_scheduler(sched2, where)
        opt2.param_groups[0]["lr"] = opt.param_groups[0]["lr"]    # load_optimizer's part
        for _ in range(5):
            got.append(step(model, opt, sched))
            assert step(model2, opt2, sched2) == got[-1], (name, len(got))
        assert all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)
                   for a, b in zip(got, want)), (name, got, want)
    dist.barrier()
    return True


def test_a_warmup_scheduler_drives_the_boosted_optimizer_and_resumes(world2, tmp_path_factory):
    _passes_on_every_rank(world2, tmp_path_factory, scheduler_case)


def empty_prefix_case(rank, world, path):
    """``tests/test_checkpoint_io/test_gemini_checkpoint_io.py`` passes ``prefix=""`` to
    ``save_model``: Colossal-AI prefixes file names only with a non-empty prefix, so the
    empty one is no prefix; the files and what loads back are those of ``prefix=None``."""
    import torch.distributed as dist

    import meshlab as ml
    from meshlab.booster import Booster, UnsupportedArgument
    from meshlab.booster.plugin import TorchDDPPlugin

    booster = Booster(plugin=TorchDDPPlugin())
    model = ml.init_weights(M.build("llama"), seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt, *_ = booster.boost(model, opt)
    _one_step(booster, model, opt, rank, world)
    where = os.path.join(path, "model")
    booster.save_model(model, where, True, True, "", 1, use_safetensors=True)
    booster.save_optimizer(opt, os.path.join(path, "optim"), prefix="")
    dist.barrier()
    files = os.listdir(where)
    assert "config.json" in files and any(f.startswith("model") and
                                           f.endswith(".safetensors") for f in files), files
    new = ml.init_weights(M.build("llama"), seed=1)
    new_opt = torch.optim.SGD(new.parameters(), lr=0.1, momentum=0.9)
    new, new_opt, *_ = booster.boost(new, new_opt)
    booster.load_model(new, where)
    booster.load_optimizer(new_opt, os.path.join(path, "optim"), prefix="")
    want = model.unwrap().state_dict()
    for k, v in new.unwrap().state_dict().items():
        assert torch.equal(_whole(v), _whole(want[k])), k
    try:
        booster.save_model(model, where, True, True, "run1", 1, use_safetensors=True)
    except UnsupportedArgument as e:
        assert "prefix='run1'" in str(e), e
    else:
        raise AssertionError("a non-empty prefix was accepted")
    dist.barrier()
    return True


def _whole(v):
    return v.full_tensor() if hasattr(v, "full_tensor") else v


def test_an_empty_prefix_is_no_prefix(world2, tmp_path_factory):
    _passes_on_every_rank(world2, tmp_path_factory, empty_prefix_case)
