"""Colossal-AI's plugin tests, rewritten in meshlab's code, on 2 gloo processes.

* ``tests/test_booster/test_plugin/test_torch_ddp_plugin.py``: boost returns an
  ``OptimizerWrapper``; ``booster.backward``, ``clip_grad_by_norm(1.0)`` and ``step``
  train as one process does (tighter: weights equal one process in float32, where the
  original only runs); ``no_sync`` leaves each rank its own gradient and the next
  backward makes them equal.
* ``tests/test_booster/test_plugin/test_dp_plugin_base.py``: a ``DPPluginBase`` subclass's
  ``prepare_dataloader`` gives the ranks different samples.
* ``tests/test_booster/test_plugin/test_low_level_zero_plugin.py``: ZeRO-2 with
  ``max_norm=1.0``: ``get_grad_norm()`` is a float after the step (and equals one
  process's norm).
* The same file's BatchNorm models: under ``LowLevelZeroPlugin(stage=2, precision='fp16')``
  a BatchNorm trains (its fp16 weights beside float32 running statistics), with the whole
  batch's statistics, equal on both ranks.
* ``tests/test_booster/test_mixed_precision/test_fp16_torch.py``:
  ``FP16TorchMixedPrecision().configure(model, optimizer, criterion)`` then
  ``optimizer.backward``, ``clip_grad_by_norm``, ``step``.
* ``colossalai.launch(rank=, world_size=, host=, port=)`` on an existing group, and the
  plugin's groups (``dp_group``, ``tp_group``, ``stage_manager``).
* ``tests/test_booster/test_plugin/test_3d_plugin.py``, ``run_grad_acc_test``: a GPT-2 LM
  with its head tied to the embeddings under ``HybridParallelPlugin(pp_size=2,
  zero_stage=1)``, two batches accumulated per step (``booster.no_sync`` on the first,
  ``execute_pipeline`` on both), against the same model trained in one process on the same
  batches: weights to 1e-5 after two steps (the original compares to 1e-2, against a copy
  boosted the same way).
  Its second boost, of a copy each rank trained on its own batches: under each plugin
  (DDP, ZeRO-1/2, Gemini, a pipeline at pp=2, tensor parallelism at tp=2) rank 0 warns
  how many parameters differed and every rank holds rank 0's values whole (compared and
  broadcast before the model is split into stages or sliced), as torch's DDP takes them
  when it is built; one step then equals one process trained from rank 0's values (where
  Colossal-AI, under ZeRO or a pipeline, keeps each rank's own values and its shards mix
  them). A rank that cannot take the values, or whose buffers differ, makes every rank
  raise.
* ``examples/language/gpt/hybridparallelism/finetune.py`` with ``--plugin
  hybrid_parallel``: a GPT-2 sequence classifier (a pad id, rows padded at their end)
  under ``HybridParallelPlugin(pp_size=2, microbatch_size=1, enable_all_optimization=True,
  zero_stage=1)`` boosted without its dataloader, ``HybridAdam`` over the script's two
  parameter groups (no decay for biases and norms, every stage's parameters named in
  them), trained through ``execute_pipeline`` with the script's criterion
  (``outputs.loss``) and evaluated with ``return_outputs=True``
  (``outputs['outputs']['logits']`` on the last stage, argmax over the labels, the
  stage's ranks from ``plugin.pg_mesh.get_ranks_in_group(plugin.pp_group)``), against one
  process on the same batches: losses, pooled logits and weights to 1e-5 (fp32 where the
  script runs fp16: exactness).
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.timeout(600)


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def case_ddp(rank, world):
    import torch.distributed as dist

    from meshlab.booster import Booster
    from meshlab.booster.interface import ModelWrapper, OptimizerWrapper
    from meshlab.booster.plugin import TorchDDPPlugin

    booster = Booster(plugin=TorchDDPPlugin())
    model, ref = _net(), _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    criterion = lambda x: x.mean()  # noqa: E731
    model, optimizer, criterion, _, _ = booster.boost(model, optimizer, criterion)
    assert isinstance(optimizer, OptimizerWrapper) and isinstance(model, ModelWrapper)
    assert isinstance(model, nn.Sequential) and model.unwrap() is model
    torch.manual_seed(1)
    data = torch.randn(world * 2, 8)
    loss = criterion(model(data[rank * 2:(rank + 1) * 2]))
    booster.backward(loss, optimizer)
    norm = optimizer.clip_grad_by_norm(1.0)
    optimizer.step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref(data).mean().backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    ref_opt.step()
    assert abs(norm - float(ref_norm)) < 1e-6, (norm, float(ref_norm))
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-6, rtol=1e-6)
    dist.barrier()


class _Dummy(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.weight * x


def case_no_sync(rank, world):
    import torch.distributed as dist

    from meshlab.booster import Booster
    from meshlab.booster.plugin import TorchDDPPlugin

    plugin = TorchDDPPlugin()
    booster = Booster(plugin=plugin)
    model = _Dummy()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    dl = plugin.prepare_dataloader(torch.arange(0, 10).float(), batch_size=2)
    model, optimizer, _, dl, _ = booster.boost(model, optimizer, dataloader=dl)
    for i, batch in enumerate(dl):
        if i > 1:
            break
        with booster.no_sync(model) if i == 0 else nullcontext():
            booster.backward(model(batch).mean(), optimizer)
        g = model.weight.grad
        grads = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(grads, g)
        assert len({x.item() for x in grads}) == (world if i == 0 else 1)


def case_dp_plugin_base(rank, world):
    import torch.distributed as dist
    from torch.utils.data import TensorDataset

    from meshlab.booster.plugin.dp_plugin_base import DPPluginBase

    class Wrapper(DPPluginBase):
        pass

    dl = Wrapper().prepare_dataloader(TensorDataset(torch.arange(0, 10)), batch_size=2)
    batch = next(iter(dl))[0]
    other = batch.clone()
    dist.broadcast(other, src=1)
    if rank == 0:
        assert not torch.equal(batch, other)


def case_zero2_grad_norm(rank, world):
    from meshlab.booster import Booster
    from meshlab.booster.plugin import LowLevelZeroPlugin

    booster = Booster(plugin=LowLevelZeroPlugin(stage=2, precision="fp32", max_norm=1.0))
    model, ref = _net(), _net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer, *_ = booster.boost(model, optimizer)
    torch.manual_seed(2)
    data = torch.randn(world * 3, 8)
    booster.backward(model(data[rank * 3:(rank + 1) * 3]).mean(), optimizer)
    optimizer.step()
    norm = optimizer.get_grad_norm()
    assert isinstance(norm, float)
    ref(data).mean().backward()
    want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))
    assert abs(norm - want) < 1e-6 * max(1.0, want), (norm, want)


def case_fp16_configure(rank, world):
    from meshlab.booster.mixed_precision import FP16TorchMixedPrecision

    model = _net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    model, optimizer, criterion = FP16TorchMixedPrecision().configure(
        model, optimizer, lambda x: x.mean())
    # The dynamic loss scale starts at 2**16, where this model's fp16 backward overflows:
    # those steps are skipped (and the scale halved) until one fits, as torch's
    # GradScaler does.
    stepped = False
    for _ in range(20):
        loss = criterion(model(torch.randn(2, 8)))
        optimizer.backward(loss)
        optimizer.clip_grad_by_norm(1.0)
        stepped = optimizer.step()
        optimizer.zero_grad()
        if stepped:
            break
    assert stepped and optimizer.scaler.scale < 2.0 ** 16
    after = list(model.parameters())
    assert all(not torch.equal(a.detach(), b) for a, b in zip(after, before))


def case_launch_and_groups(rank, world, port):
    import torch.distributed as dist

    import meshlab.booster as colossalai
    from meshlab.booster.plugin import HybridParallelPlugin, TorchDDPPlugin

    colossalai.launch(rank=rank, world_size=world, host="localhost", port=port, verbose=False)
    assert dist.get_world_size() == world         # the existing group is used
    plugin = TorchDDPPlugin()
    assert plugin.stage_manager is None and plugin.tp_group is None
    assert dist.get_world_size(plugin.dp_group) == world
    hybrid = HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=2)
    sm = hybrid.stage_manager
    assert (sm.stage, sm.num_stages) == (rank, 2)
    assert sm.is_first_stage() == (rank == 0) and sm.is_last_stage() == (rank == 1)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter (a tensor-parallel or ZeRO DTensor gathered)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _stage_matches(model, origin, tol: float = 1e-5) -> None:
    """This pipeline rank's parameters equal the one-process model's, to 1e-5 (``tol``;
    0: bit for bit), tensor-parallel ones gathered whole."""
    want = dict(origin.named_parameters())
    got = dict(model.unwrap().named_parameters())
    assert got, "this stage holds no parameters"
    for n, p in got.items():
        torch.testing.assert_close(_full(p), want[n].detach(), atol=tol, rtol=tol,
                                   msg=lambda m, n=n: f"{n}: {m}")


def _boost_warned(booster, model, optimizer, **kw):
    """``booster.boost(model, optimizer, **kw)`` and the warnings ``meshlab.apply`` logged
    meanwhile (rank 0's: meshlab's logger passes only rank 0's records)."""
    from tests._logs import logged

    with logged() as warned:
        out = booster.boost(model, optimizer, **kw)
    return out, warned


def _took_rank_0s(rank, warned, count: str = "") -> None:
    """Rank 0 warned once that replicas differed and every rank holds its values (and
    how many differed: ``count``, e.g. '4 of 4'); the other ranks log nothing."""
    if rank != 0:
        assert warned == [], warned
        return
    assert len(warned) == 1 and "differed across ranks" in warned[0] and \
        "every rank now holds rank 0's values" in warned[0] and count in warned[0], warned


def case_pipeline_grad_accumulation(rank, world):
    import copy

    import transformers as T

    from meshlab.booster import Booster
    from meshlab.booster.nn.optimizer import HybridAdam
    from meshlab.booster.plugin import HybridParallelPlugin

    torch.manual_seed(0)
    cfg = T.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=128, n_positions=64,
                       attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0,
                       tie_word_embeddings=True, attn_implementation="eager")
    model = T.GPT2LMHeadModel(cfg)
    origin = copy.deepcopy(model)
    optimizer, origin_opt = HybridAdam(model.parameters()), HybridAdam(origin.parameters())
    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, zero_stage=1, num_microbatches=2,
                                  precision="fp32")
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    torch.manual_seed(1)
    batches = [torch.randint(0, 128, (4, 16)) for _ in range(4)]
    for step, ids in enumerate(batches):
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        (origin(**batch)[0] / 2).backward()
        ctx = booster.no_sync(model, optimizer) if step % 2 == 0 else nullcontext()
        with ctx:
            booster.execute_pipeline(iter([batch]), model,
                                     criterion=lambda out, inputs: out[0] / 2,
                                     optimizer=optimizer, return_loss=False)
        if step % 2 == 1:
            origin_opt.step()
            origin_opt.zero_grad()
            optimizer.step()
            optimizer.zero_grad()
    _stage_matches(model, origin)


def case_pipeline_sequence_classifier(rank, world):
    import copy

    import transformers as T

    from meshlab.booster import Booster
    from meshlab.booster.nn.optimizer import HybridAdam
    from meshlab.booster.plugin import HybridParallelPlugin

    torch.manual_seed(0)
    cfg = T.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=128, n_positions=64,
                       attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0, num_labels=2,
                       pad_token_id=0, attn_implementation="eager")
    model = T.GPT2ForSequenceClassification(cfg)
    origin = copy.deepcopy(model)

    def grouped(m):                 # the script's groups: no decay for biases and norms
        no_decay = ["bias", "LayerNorm.weight", "ln_"]
        return [{"params": [p for n, p in m.named_parameters()
                            if not any(nd in n for nd in no_decay)], "weight_decay": 0.1},
                {"params": [p for n, p in m.named_parameters()
                            if any(nd in n for nd in no_decay)], "weight_decay": 0.0}]

    optimizer = HybridAdam(grouped(model), lr=1e-3, eps=1e-8)
    origin_opt = HybridAdam(grouped(origin), lr=1e-3, eps=1e-8)
    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=None,
                                  microbatch_size=1, enable_all_optimization=True,
                                  zero_stage=1, precision="fp32")
    booster = Booster(plugin=plugin)
    criterion = lambda x: x.loss                                       # noqa: E731

    def _criterion(outputs, inputs):
        return criterion(outputs)

    model, optimizer, _criterion, *_ = booster.boost(model, optimizer, criterion=_criterion)
    torch.manual_seed(1)
    batches = []
    for _ in range(3):
        ids = torch.randint(1, 128, (4, 16))
        ids[1, -5:] = 0                               # padded rows pool earlier tokens
        ids[3, -1:] = 0
        batches.append({"input_ids": ids, "attention_mask": (ids != 0).long(),
                        "labels": torch.randint(0, 2, (4,))})
    losses = []
    for batch in batches[:2]:
        want = origin(**batch).loss
        want.backward()
        origin_opt.step()
        origin_opt.zero_grad()
        out = booster.execute_pipeline(iter([batch]), model, _criterion, optimizer,
                                       return_loss=True)
        optimizer.step()
        optimizer.zero_grad()
        losses.append((float(out["loss"]), float(want)))
    last = plugin.stage_manager.is_last_stage()
    assert plugin.pg_mesh.get_ranks_in_group(plugin.pp_group) == [0, 1]
    out = booster.execute_pipeline(iter([batches[2]]), model, _criterion,
                                   return_loss=True, return_outputs=True)
    with torch.no_grad():
        ref = origin(**batches[2])
    for got, want in losses + [(float(out["loss"]), float(ref.loss))]:
        assert abs(got - want) <= 1e-5, losses
    if last:
        logits = out["outputs"]["logits"]
        torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=1e-5)
        assert torch.equal(torch.argmax(logits, axis=1), torch.argmax(ref.logits, axis=1))
    else:
        assert out["outputs"] is None
    _stage_matches(model, origin)


def case_replicas_take_rank_0s_values_under_ddp(rank, world):
    """A model built from another seed on each rank: the plugins Colossal-AI runs through
    torch's DDP (``TorchDDPPlugin``; ``HybridParallelPlugin`` without ZeRO or a pipeline)
    take rank 0's values, as DDP does when it is built, and train as one process from
    them (``test_3d_plugin``'s second boost of replicas that each rank trained alone)."""
    from meshlab.booster import Booster
    from meshlab.booster.plugin import HybridParallelPlugin, TorchDDPPlugin

    torch.manual_seed(0)
    first = _net()
    for plugin in (TorchDDPPlugin(), HybridParallelPlugin(tp_size=1, pp_size=1,
                                                          precision="fp32")):
        torch.manual_seed(rank)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        model, optimizer, *_ = Booster(plugin=plugin).boost(model, optimizer)
        for p, q in zip(model.parameters(), first.parameters()):
            assert torch.equal(p.detach(), q.detach()), type(plugin).__name__
        _one_step_matches(model, optimizer, rank, world, type(plugin).__name__)


def _one_step_matches(model, optimizer, rank, world, name: str) -> None:
    """One SGD step (lr 0.5) on the ranks' halves of a batch equals one process trained
    from rank 0's values (``_net()``) on all of it."""
    ref = _net()
    torch.manual_seed(1)
    data = torch.randn(world * 2, 8)
    model(data[rank * 2:(rank + 1) * 2]).mean().backward()
    optimizer.step()
    ref(data).mean().backward()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p), q.detach(), atol=1e-6, rtol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


def case_replicas_take_rank_0s_values_under_zero(rank, world):
    """The same under the plugins that shard the optimizer state, gradients or parameters
    (``LowLevelZeroPlugin``, ``HybridParallelPlugin`` with ZeRO, ``GeminiPlugin``), where
    Colossal-AI keeps each rank's own values and its shards mix them: ``boost`` warns how
    many differed, every rank holds rank 0's values whole, and one step on the ranks'
    halves of a batch equals one process trained from rank 0's values on all of it."""
    from meshlab.booster import Booster, GeminiPlugin, LowLevelZeroPlugin
    from meshlab.booster.plugin import HybridParallelPlugin

    torch.manual_seed(0)
    first = _net()
    for plugin in (LowLevelZeroPlugin(stage=1, precision="fp32"),
                   LowLevelZeroPlugin(stage=2, precision="fp32"),
                   HybridParallelPlugin(tp_size=1, pp_size=1, zero_stage=1, precision="fp32"),
                   HybridParallelPlugin(tp_size=1, pp_size=1, zero_stage=2, precision="fp32"),
                   GeminiPlugin(precision="fp32")):
        name = type(plugin).__name__
        torch.manual_seed(rank)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        (model, optimizer, *_), warned = _boost_warned(Booster(plugin=plugin), model,
                                                       optimizer)
        _took_rank_0s(rank, warned, "4 of 4")
        for p, q in zip(model.parameters(), first.parameters()):
            assert torch.equal(_full(p), q.detach()), name
        _one_step_matches(model, optimizer, rank, world, name)


def case_a_rank_that_cannot_take_rank_0s_values_fails_every_rank(rank, world):
    """Rank 1's replica differs and cannot be written (built under inference mode): it
    raises a ``ConfigError`` naming the parameter, and every other rank a ``PeerError``
    naming it, instead of going on to shard a model rank 1 does not hold."""
    import meshlab as ml
    from meshlab.booster import Booster, LowLevelZeroPlugin

    torch.manual_seed(rank)
    with torch.inference_mode() if rank == 1 else nullcontext():
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    want = ml.ConfigError if rank == 1 else ml.PeerError
    with pytest.raises(want, match="0.weight" if rank == 1 else "rank 1"):
        Booster(plugin=LowLevelZeroPlugin(stage=1, precision="fp32")).boost(
            model, torch.optim.SGD(model.parameters(), lr=0.5))


def case_replicas_with_other_buffers_fail_every_rank(rank, world):
    """Rank 1's replica holds a buffer the others lack: the ranks would broadcast different
    lists of tensors, so every rank raises ``RankMismatchError`` naming the buffers before
    any value is compared."""
    import meshlab as ml
    from meshlab.booster import Booster, LowLevelZeroPlugin

    model = _net()
    if rank == 1:
        model[0].register_buffer("steps", torch.zeros(3))
    with pytest.raises(ml.RankMismatchError, match="buffer shapes"):
        Booster(plugin=LowLevelZeroPlugin(stage=1, precision="fp32")).boost(
            model, torch.optim.SGD(model.parameters(), lr=0.5))


def _gpt2_lm(seed: int):
    """A small GPT-2 LM, its head tied to the embeddings, from ``seed``."""
    import transformers as T

    torch.manual_seed(seed)
    cfg = T.GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=128, n_positions=64,
                       attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0,
                       tie_word_embeddings=True, attn_implementation="eager")
    return T.GPT2LMHeadModel(cfg)


def _one_step_from_rank_0s(rank, plugin, pipeline: bool) -> None:
    """A GPT-2 LM built from another seed on each rank, boosted under ``plugin`` (every
    rank reads the same batch: data parallelism of 1): rank 0 warns, every rank's part
    (its stage, its tensor-parallel slices) holds rank 0's values bit for bit, and one
    step equals one process trained from rank 0's model."""
    from meshlab.booster import Booster
    from meshlab.booster.nn.optimizer import HybridAdam

    origin = _gpt2_lm(0)
    origin_opt = HybridAdam(origin.parameters())
    model = _gpt2_lm(rank)
    booster = Booster(plugin=plugin)
    (model, optimizer, *_), warned = _boost_warned(booster, model,
                                                   HybridAdam(model.parameters()))
    _took_rank_0s(rank, warned)
    _stage_matches(model, origin, tol=0)
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (4, 16))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    origin(**batch)[0].backward()
    origin_opt.step()
    if pipeline:
        booster.execute_pipeline(iter([batch]), model, criterion=lambda out, inputs: out[0],
                                 optimizer=optimizer, return_loss=False)
    else:
        booster.backward(model(**batch)[0], optimizer)
    optimizer.step()
    _stage_matches(model, origin)


def case_replicas_take_rank_0s_values_under_a_pipeline(rank, world):
    """pp=2 with ZeRO-1: the ranks compare and take whole tensors before the model is
    split into stages, so the last stage (rank 1) holds rank 0's values of the blocks and
    tied head rank 0 drops."""
    from meshlab.booster.plugin import HybridParallelPlugin

    _one_step_from_rank_0s(rank, HybridParallelPlugin(tp_size=1, pp_size=2, zero_stage=1,
                                                      num_microbatches=2, precision="fp32"),
                           pipeline=True)


def case_replicas_take_rank_0s_values_under_tensor_parallelism(rank, world):
    """tp=2 with ZeRO-1: the ranks compare and take whole tensors before they are sliced,
    so each rank's slice is the slice of rank 0's tensor."""
    from meshlab.booster.plugin import HybridParallelPlugin

    _one_step_from_rank_0s(rank, HybridParallelPlugin(tp_size=2, pp_size=1, zero_stage=1,
                                                      precision="fp32"), pipeline=False)


def case_batch_norm_under_zero2_fp16(rank, world):
    """A BatchNorm under ``LowLevelZeroPlugin(stage=2, precision='fp16')`` (Colossal-AI's
    own zoo boosts its BatchNorm models so): FSDP2 casts its weights to fp16 beside the
    float32 running statistics, which torch's batch_norm refused; it trains, its
    statistics the whole batch's (the running means equal one process's under autocast
    to fp16 rounding, and equal on both ranks)."""
    import torch.distributed as dist

    from meshlab.booster import Booster
    from meshlab.booster.plugin import LowLevelZeroPlugin

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))

    booster = Booster(plugin=LowLevelZeroPlugin(stage=2, precision="fp16",
                                                initial_scale=2 ** 8))
    model, ref = net(), net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer, *_ = booster.boost(model, optimizer)
    torch.manual_seed(1)
    data = torch.randn(world * 4, 8)
    loss = model(data[rank * 4:(rank + 1) * 4]).float().square().mean()
    booster.backward(loss, optimizer)
    optimizer.step()
    with torch.autocast("cpu", dtype=torch.float16):
        ref(data)
    mean = model[1].running_mean
    got = [torch.empty_like(mean) for _ in range(world)]
    dist.all_gather(got, mean)
    assert torch.equal(got[0], got[1])
    torch.testing.assert_close(mean, ref[1].running_mean, atol=2e-3, rtol=2e-3)
    assert not torch.equal(mean, torch.zeros_like(mean))


@pytest.mark.parametrize("case", [case_ddp, case_no_sync, case_dp_plugin_base,
                                  case_zero2_grad_norm, case_fp16_configure,
                                  case_pipeline_grad_accumulation,
                                  case_pipeline_sequence_classifier,
                                  case_replicas_take_rank_0s_values_under_ddp,
                                  case_replicas_take_rank_0s_values_under_zero,
                                  case_replicas_take_rank_0s_values_under_a_pipeline,
                                  case_replicas_take_rank_0s_values_under_tensor_parallelism,
                                  case_a_rank_that_cannot_take_rank_0s_values_fails_every_rank,
                                  case_replicas_with_other_buffers_fail_every_rank,
                                  case_batch_norm_under_zero2_fp16])
def test_colossal_plugin_cases(world2, case):
    world2.run(case)


def test_launch_uses_the_launched_group(world2):
    world2.run(case_launch_and_groups, port=29500)
