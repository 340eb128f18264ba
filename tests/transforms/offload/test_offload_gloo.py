"""``offload`` on real gloo ranks, against the same run without it.

* Fractions 0, 0.5 and 1 of each kind (optimizer state, gradients, parameters) under
  ZeRO-1 and ZeRO-3 on 2 ranks (parameters under data_parallel too), and a selection on 4: losses and updated weights are
  bitwise those of the run without offload when the CPU AdamW runs its reference (the
  same arithmetic as ``torch.optim.AdamW``'s single-tensor path), and within float32
  rounding with its C++ loop (weights of size ~0.02-1 within 1e-5 absolute after three
  steps at lr 1e-2: Adam's normalization amplifies a last-bit difference where a
  gradient's second moment is near eps).
* Memory: what each rank holds on the host and on the device, measured from the tensors
  after a step, is within 10% of ``plan.memory()``.
* Checkpoints saved at one fraction resume at another, bitwise (ZeRO-3, and ZeRO-1 with
  parameters on the host or not).
* ZeRO-1 with parameters on the host runs its slices over FSDP2 units (the parameters
  resting where FSDP2 keeps them), and the plan counts its traffic as it runs; beside
  hybrid sharding and tensor parallelism it trains as one process (``meshlab.verify``).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests import _models as M

pytestmark = pytest.mark.timeout(900)
LR = 1e-2
STEPS = 3
CHUNK = 3000
VOCAB = 96          # divisible by 4: every rank's shard the size plan.memory() counts


def _offload(kind: str, f: float):
    import meshlab as ml

    c = CHUNK       # small chunks: the step's pipeline runs over several
    return {"none": ml.parallel.Identity(),
            "optimizer": ml.offload(optimizer=f, chunk_elements=c),
            "grads": ml.offload(grads=f, optimizer=f, chunk_elements=c),
            "params": ml.offload(params=f, grads=f, optimizer=f, chunk_elements=c)}[kind]


def _train(world, stage, extra, data, *, accumulate: int = 1):
    """(model, optimizer, losses) after ``data`` with zero_shard(stage) | extra."""
    import meshlab as ml

    spec = ml.zero_shard(stage, "dp") | extra
    model = ml.parallelize(M.build("llama", vocab_size=VOCAB), spec, ml.Mesh(dp=world), seed=0)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=LR, foreach=False)
    rank, n = torch.distributed.get_rank(), world
    losses = []
    for b in data:
        x = b.chunk(n)[rank]
        for i, mb in enumerate(x.chunk(accumulate)):
            model._meshlab.set_gradient_sync(model, i == accumulate - 1)
            loss = M.loss_fn("llama")(model(input_ids=mb), {"input_ids": mb, "labels": mb})
            (loss / accumulate).backward()
        losses.append(float(loss))
        opt.step()
        if b is not data[-1]:
            opt.zero_grad()
    return model, opt, losses


def _weights(model) -> dict:
    return {n: M.full(p).detach().float().clone() for n, p in model.named_parameters()}


def _memory(model, opt) -> dict:
    """Measured and planned (host, device) bytes of this rank."""
    from meshlab.transforms.offload._install import OffloadPart

    part = model._meshlab.part(OffloadPart)
    got = part.measure(opt)
    est = model._meshlab.plan.memory()
    return {"measured": (sum(got["host"].values()), sum(got["device"].values())),
            "planned": (est.host, est.total)}


def matrix_case(rank, world, cases, native=False, accumulate=1):
    """Every (stage, kind, fraction) of ``cases`` against the run without offload."""
    import contextlib

    from meshlab.ops import _build
    from meshlab.transforms.offload._install import OffloadPart

    data = M.batches(STEPS, batch=4, vocab=VOCAB)
    out = {}
    ctx = contextlib.nullcontext() if native else _build.force_reference()
    with ctx:
        base = {}
        for stage, kind, f in cases:
            if stage not in base:
                m, _, losses = _train(world, stage, _offload("none", 0), data,
                                      accumulate=accumulate)
                base[stage] = (losses, _weights(m))
            model, opt, losses = _train(world, stage, _offload(kind, f), data,
                                        accumulate=accumulate)
            want_losses, want = base[stage]
            got = _weights(model)
            worst = max(float((got[n] - want[n]).abs().max()) for n in want)
            part = model._meshlab.part(OffloadPart)
            out[(stage, kind, f)] = dict(
                losses=losses, want_losses=want_losses, worst=worst,
                copied=dict(part.copied) if part else None,
                resident=sum(e.resident for e in part.entries) if part else 0,
                bitwise=all(torch.equal(got[n], want[n]) for n in want),
                memory=_memory(model, opt) if f > 0 else None)
    return out


CASES_2 = [(1, "optimizer", 0.0), (1, "optimizer", 0.5), (1, "optimizer", 1.0),
           (3, "optimizer", 0.0), (3, "optimizer", 0.5), (3, "optimizer", 1.0),
           (3, "grads", 0.5), (3, "grads", 1.0), (3, "params", 0.5), (3, "params", 1.0),
           # data_parallel and ZeRO-1: FSDP2 over a size-1 shard dimension keeps the whole
           # parameters (ZeRO-1 steps its slices of the gradients FSDP2 averaged)
           (0, "params", 0.5), (0, "params", 1.0), (1, "params", 0.5), (1, "params", 1.0)]


def _check(results, *, bitwise: bool, tol: float = 0.0):
    for key, r in results.items():
        if bitwise:
            assert r["bitwise"], f"{key}: weights differ from the run without offload " \
                                 f"(worst absolute {r['worst']:.2e})"
            assert r["losses"] == r["want_losses"], key
        else:
            assert r["worst"] <= tol, f"{key}: worst absolute difference {r['worst']:.2e}"
            assert max(abs(a - b) for a, b in zip(r["losses"], r["want_losses"])) <= 1e-5, key
        stage, kind, f = key
        if f > 0 and (stage in (0, 3) or kind == "params"):   # the host copies ran
            # (ZeRO-1's slices of the optimizer state live there)
            if kind == "params":      # the sets nest: all of them stay where FSDP2 keeps them
                assert r["resident"] > 0 and r["copied"]["h2d_bytes"] == 0, (key, r)
            else:
                assert r["copied"]["d2h_bytes"] > 0 and r["copied"]["h2d_bytes"] > 0, (key, r)
        if r["memory"] is not None:
            (mh, md), (ph, pd) = r["memory"]["measured"], r["memory"]["planned"]
            assert ph > 0 and mh > 0, f"{key}: nothing on the host ({r['memory']})"
            assert abs(mh - ph) <= 0.1 * ph, f"{key}: host bytes {mh} vs plan {ph}"
            assert abs(md - pd) <= 0.1 * pd, f"{key}: device bytes {md} vs plan {pd}"


def test_fractions_match_no_offload_bitwise_on_2_ranks(world2):
    for results in world2.run(matrix_case, cases=CASES_2):
        _check(results, bitwise=True)


def float64_case(rank, world):
    torch.set_default_dtype(torch.float64)
    try:
        return matrix_case(rank, world, cases=[(3, "optimizer", 1.0), (3, "grads", 1.0),
                                               (0, "params", 1.0)])
    finally:
        torch.set_default_dtype(torch.float32)


def test_a_float64_model_keeps_float64_masters(world2):
    """The host masters of a float64 model are float64 (they were float32, whatever the
    model: its weights ended 1e-7 off one process where ZeRO-1's own slices matched to
    1e-16), and the plan counts them so."""
    for results in world2.run(float64_case):
        _check(results, bitwise=True)


def test_native_cpu_adam_within_float32_rounding(world2):
    cases = [(1, "optimizer", 1.0), (3, "grads", 1.0), (3, "params", 0.5)]
    for results in world2.run(matrix_case, cases=cases, native=True):
        _check(results, bitwise=False, tol=1e-5)


def test_gradient_accumulation_with_offloaded_gradients(world2):
    cases = [(3, "grads", 1.0), (1, "optimizer", 0.5), (0, "params", 1.0)]
    for results in world2.run(matrix_case, cases=cases, accumulate=2):
        _check(results, bitwise=True)


def test_fractions_on_4_ranks(world4):
    # ZeRO-1's reduce-scatter over 4 ranks sums in an order that depends on the bucket
    # layout, which offload changes (host slices are bucketed apart): float32 rounding.
    cases = [(1, "optimizer", 0.5), (3, "optimizer", 1.0), (3, "params", 0.5)]
    for results in world4.run(matrix_case, cases=cases):
        _check(results, bitwise=False, tol=1e-5)


def zero1_beside_case(rank, world, which):
    """ZeRO-1 with its parameters on the host beside hybrid sharding or tensor
    parallelism, against one process (``meshlab.verify``, AdamW with eps=1 so an update is
    about lr times its gradient, float32)."""
    import meshlab as ml

    off = ml.offload(params=1.0, grads=1.0, optimizer=1.0)
    spec, mesh = {
        "hybrid": (ml.data_parallel("rep") | ml.zero_shard(1, "dp") | off,
                   dict(rep=2, dp=2)),
        "tp": (ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES)) | ml.zero_shard(1, "dp")
               | off, dict(dp=2, tp=2)),
    }[which]
    data = [{"input_ids": b} for b in M.batches(2, batch=8, seq=8)]
    report = ml.verify(M.build("llama"), spec, ml.Mesh(**mesh), data,
                       optimizer=torch.optim.AdamW, lr=0.1, optimizer_options=dict(eps=1.0),
                       dtype=torch.float32, atol=1e-5, rtol=1e-4)
    return report.ok, str(report)


@pytest.mark.parametrize("which", ["hybrid", "tp"])
def test_zero1_host_parameters_beside_hybrid_sharding_and_tp(world4, which):
    for ok, text in world4.run(zero1_beside_case, which=which):
        assert ok, text


# -- checkpoints across fractions ---------------------------------------------------------
def resume_case(rank, world, directory, save_kind, save_f, load_kind, load_f, stage=3):
    import meshlab as ml
    from meshlab.ops import _build

    data = M.batches(STEPS, batch=4, vocab=VOCAB)
    with _build.force_reference():
        full_model, _, full_losses = _train(world, stage, _offload("none", 0), data)
        model, opt, _ = _train(world, stage, _offload(save_kind, save_f), data[:2])
        path = os.path.join(directory, f"{stage}-{save_kind}-{save_f}-{load_kind}-{load_f}")
        ml.checkpoint.save(path, model, opt)
        model2, opt2, _ = _train(world, stage, _offload(load_kind, load_f), [])
        ml.checkpoint.load(path, model2, opt2)
        x = data[2].chunk(world)[rank]
        loss = M.loss_fn("llama")(model2(input_ids=x), {"input_ids": x, "labels": x})
        loss.backward()
        opt2.step()
    got, want = _weights(model2), _weights(full_model)
    return float(loss) == full_losses[2] and all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("stage,save,load", [(3, ("optimizer", 0.5), ("optimizer", 1.0)),
                                             (3, ("params", 1.0), ("none", 0.0)),
                                             (3, ("none", 0.0), ("grads", 0.5)),
                                             (1, ("params", 1.0), ("none", 0.0)),
                                             (1, ("none", 0.0), ("params", 0.5))])
def test_checkpoint_resumes_across_fractions(world2, tmp_path, stage, save, load):
    assert all(world2.run(resume_case, directory=str(tmp_path), save_kind=save[0],
                          save_f=save[1], load_kind=load[0], load_f=load[1], stage=stage))


# -- ZeRO-1 over FSDP2 units: what runs is what the plan counts -------------------------
def zero1_units_case(rank, world):
    """``zero_shard(1) | offload(params=...)``: every block an FSDP2 unit whose parameters
    are whole on each rank (a size-1 shard dimension), those offload names resting on the
    host; the slices take their part of the gradients FSDP2 averaged, with no
    reduce-scatter of their own (each collective counted as it runs)."""
    import meshlab as ml
    from meshlab.transforms.zero import _zero1
    from meshlab.transforms.zero._install import Zero1OnUnits

    model = ml.parallelize(M.build("llama", vocab_size=VOCAB),
                           ml.zero_shard(1, "dp") | _offload("params", 0.5),
                           ml.Mesh(dp=world), seed=0)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=LR)
    part = model._meshlab.part(Zero1OnUnits)
    x = M.batches(1, batch=4, vocab=VOCAB)[0].chunk(world)[rank]
    M.loss_fn("llama")(model(input_ids=x), {"input_ids": x, "labels": x}).backward()
    calls = []
    real = _zero1.reduce_scatter_into
    _zero1.reduce_scatter_into = lambda *a, **k: calls.append(a) or real(*a, **k)
    try:
        opt.step()
    finally:
        _zero1.reduce_scatter_into = real
    whole = all(M.full(p).shape == p.to_local().shape for p in model.parameters())
    return dict(part=part is not None, roots=len(part.roots) if part else 0, whole=whole,
                reduce_scatters=len(calls), sliced=len(part.buffers.shards))


def test_zero1_over_units_slices_what_fsdp2_averaged(world2):
    for r in world2.run(zero1_units_case):
        assert r == dict(part=True, roots=1, whole=True, reduce_scatters=0,
                         sliced=r["sliced"]) and r["sliced"] >= 2, r


def test_zero1_over_units_plans_its_traffic():
    """The plan: one all-reduce of each unit's gradient (FSDP2's), the slices' all-gather,
    no reduce-scatter; runnable on a fake mesh."""
    import meshlab as ml

    mesh = ml.Mesh(dp=2, fake=True)
    p = ml.plan(M.build("llama"), ml.zero_shard(1, "dp") | ml.offload(
        params=1.0, grads=1.0, optimizer=1.0), mesh)
    assert p.runnable and p.memory().host > 0
    c = p.comm()
    assert c.count("reduce_scatter", "dp") == 0 and c.count("all_gather", "dp") >= 1
    assert c.count("all_reduce", "dp") == len(p.model.blocks) + 3


def host_memory_case(rank, world):
    """A host too small for the moments is refused before any host tensor is made."""
    import meshlab as ml
    from meshlab.transforms.offload import _install

    model = ml.parallelize(M.build("llama", vocab_size=VOCAB),
                           ml.zero_shard(3, "dp") | ml.offload(optimizer=1.0),
                           ml.Mesh(dp=world), seed=0)
    real = _install.os.sysconf
    _install.os.sysconf = lambda name: 1        # one byte free
    try:
        ml.optimizer(model, torch.optim.AdamW, lr=LR)
    except ml.ConfigError as e:
        part = model._meshlab.part(_install.OffloadPart)
        return "host has" in str(e) and part.entries == []
    finally:
        _install.os.sysconf = real
    return False


def test_host_too_small_is_refused_before_allocating(world2):
    assert all(world2.run(host_memory_case))


def bf16_case(rank, world):
    """A model built in bf16: the C++ loop writes each updated weight's bf16 copy on the
    host; 2 bytes per element cross back, and the device weight is its master rounded."""
    import meshlab as ml
    from meshlab.transforms.offload._install import OffloadPart

    model = ml.parallelize(M.build("llama", vocab_size=VOCAB).to(torch.bfloat16),
                           ml.zero_shard(3, "dp") | ml.offload(optimizer=1.0,
                                                               chunk_elements=CHUNK),
                           ml.Mesh(dp=world), seed=0)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=LR)
    part = model._meshlab.part(OffloadPart)
    b = M.batches(1, batch=4, vocab=VOCAB)[0].chunk(world)[rank]
    M.loss_fn("llama")(model(input_ids=b), {"input_ids": b, "labels": b}).backward()
    before = part.copied["h2d_bytes"]
    opt.step()
    return dict(sent=part.copied["h2d_bytes"] - before,
                elements=sum(e.master.numel() for e in part.entries),
                out=sorted({str(e.out_dtype) for e in part.entries}),
                rounded=all(torch.equal(e.device_local, e.master.to(torch.bfloat16))
                            for e in part.entries))


def test_bf16_weights_return_as_bf16(world2):
    for r in world2.run(bf16_case):
        assert r["out"] == ["torch.bfloat16"], r
        assert r["sent"] == 2 * r["elements"] > 0, r
        assert r["rounded"], r
