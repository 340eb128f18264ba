"""What the plan predicts before anything runs: activations and the peak, step time, the
machine profiles, and the layout search (fake meshes, meta models; real-run agreement is
in test_activations_gloo.py and benchmarks/results/plan_accuracy_h200.json)."""

from __future__ import annotations

import time

import pytest
import torch

import meshlab as ml
from meshlab.policies import presets

from tests import _models as M


def _llama(**kw):
    return presets.build("llama3-8b", device="meta", dtype=torch.bfloat16, **kw)


SMALL = dict(num_hidden_layers=4, hidden_size=512, intermediate_size=1024,
             num_attention_heads=8, num_key_value_heads=4, vocab_size=4096)


def test_remat_orders_the_saved_activations():
    m = _llama(**SMALL)
    saved = {pol: ml.plan(m, ml.remat(pol), ml.Mesh(dp=1, fake=True))
             .memory(batch=2, seq=256).activations.saved for pol in ("none", "selective", "full")}
    assert saved["none"] > saved["selective"] > saved["full"] > 0, saved
    # full keeps each block's input: batch x seq x hidden x 2 bytes per block, plus the loss
    per_block = 2 * 256 * 512 * 2
    assert saved["full"] >= 4 * per_block


def test_remat_every_other_block_sits_between_none_and_full():
    """remat('full', every=2) keeps half the blocks whole: saved activations and step time
    between no checkpointing and checkpointing all of them; every is refused off 'full'."""
    m = _llama(**SMALL)
    plans = {k: ml.plan(m, t, ml.Mesh(dp=1, fake=True)) for k, t in
             (("none", None), ("half", ml.remat("full", every=2)), ("full", ml.remat("full")))}
    saved = {k: p.memory(batch=2, seq=256).activations.saved for k, p in plans.items()}
    step = {k: p.time(batch=2, seq=256).step for k, p in plans.items()}
    assert saved["none"] > saved["half"] > saved["full"], saved
    assert step["none"] < step["half"] < step["full"], step
    with pytest.raises(ml.ConfigError, match="every applies to remat\\('full'\\) only"):
        ml.remat("selective", every=2)
    with pytest.raises(ml.ConfigError, match="every must be an int >= 1"):
        ml.remat("full", every=0)


def test_remat_count_checkpoints_that_many_blocks_spread_evenly():
    """remat('full', count=k): k blocks checkpointed at even positions; the estimates move
    one block at a time between none and full; a count the model has no room for, or
    beside every or off 'full', is refused."""
    m = _llama(**SMALL)                        # 4 blocks
    plans = {k: ml.plan(m, None if k is None else ml.remat("full", count=k),
                        ml.Mesh(dp=1, fake=True)) for k in (None, 1, 2, 3, 4)}
    saved = [plans[k].memory(batch=2, seq=256).activations.saved for k in (None, 1, 2, 3, 4)]
    step = [plans[k].time(batch=2, seq=256).step for k in (None, 1, 2, 3, 4)]
    assert all(a > b for a, b in zip(saved, saved[1:])), saved
    assert all(a < b for a, b in zip(step, step[1:])), step
    half = ml.plan(m, ml.remat("full", every=2), ml.Mesh(dp=1, fake=True))
    assert half.memory(batch=2, seq=256).activations.saved == saved[2]
    blocks = [f"b{i}" for i in range(32)]
    assert ml.remat("full", count=16).checkpointed(blocks) == blocks[::2]
    picked = ml.remat("full", count=19).checkpointed(blocks)
    assert len(set(picked)) == 19 and picked[0] == "b0"
    gaps = {blocks.index(b) - blocks.index(a) for a, b in zip(picked, picked[1:])}
    assert gaps <= {1, 2}, gaps
    with pytest.raises(ml.ConfigError, match="has 4 repeated blocks; give a count <= 4"):
        ml.plan(m, ml.remat("full", count=5), ml.Mesh(dp=1, fake=True))
    with pytest.raises(ml.ConfigError, match="count applies to remat\\('full'\\) alone"):
        ml.remat("full", every=2, count=3)
    with pytest.raises(ml.ConfigError, match="count applies"):
        ml.remat("selective", count=3)
    with pytest.raises(ml.ConfigError, match="count must be an int >= 0"):
        ml.remat("full", count=-1)


def test_remat_offload_takes_its_blocks_activations_off_the_device_at_no_work():
    """remat('full', count=k, offload=m): each offloaded block's saved activations leave
    the device's estimate as a checkpointed block's do, and its work stays that of a block
    kept whole (the copies run beside the compute)."""
    m = _llama(**SMALL)                        # 4 blocks
    plan = lambda c, o: ml.plan(m, ml.remat("full", count=c, offload=o),  # noqa: E731
                                ml.Mesh(dp=1, fake=True))
    saved = {co: plan(*co).memory(batch=2, seq=256).activations.saved
             for co in ((1, 0), (1, 1), (2, 0), (1, 2), (3, 0))}
    step = {co: plan(*co).time(batch=2, seq=256).step for co in ((1, 0), (1, 2), (3, 0))}
    assert saved[(1, 1)] == saved[(2, 0)] and saved[(1, 2)] == saved[(3, 0)]
    assert saved[(1, 0)] > saved[(1, 1)] > saved[(1, 2)]
    assert step[(1, 2)] == step[(1, 0)] < step[(3, 0)]


def test_remat_count_trains_like_the_model_and_wraps_that_many_blocks(one_process):
    """On one process, remat('full', count=3) of a 4-block Llama wraps three blocks'
    forwards and gives the unwrapped model's losses and weights over two AdamW steps."""
    def run(spec):
        model = ml.init_weights(presets.build("tiny-llama", num_hidden_layers=4), seed=0)
        model = ml.parallelize(model, spec, ml.Mesh(dp=1), seed=0) if spec else model
        wrapped = sum("forward" in vars(b) for b in model.model.layers)   # an instance forward
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        losses = []
        for _ in range(2):
            loss = ml.losses.causal_lm_loss(model(input_ids=ids), {"input_ids": ids})
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        return wrapped, losses, {k: v.detach().clone() for k, v in model.state_dict().items()}

    n0, ref, w0 = run(None)
    n3, got, w3 = run(ml.remat("full", count=3))
    assert (n0, n3) == (0, 3)
    assert got == ref
    for k in w0:
        torch.testing.assert_close(w3[k], w0[k], rtol=0, atol=0)


def test_cuda_graphs_take_the_blocks_host_cost_out_of_the_step():
    """compile_blocks(mode='reduce-overhead'): the blocks' host work is one replay per
    block and direction (host_fused each), their device work unchanged; a host-bound step
    gets shorter, a device-bound one does not."""
    m = _llama(**SMALL)
    mesh = ml.Mesh(dp=1, fake=True)
    eager = ml.plan(m, ml.fuse() | ml.compile_blocks(), mesh)
    graphs = ml.plan(m, ml.fuse() | ml.compile_blocks(mode="reduce-overhead"), mesh)
    h200 = ml.machine("h200")
    for batch, seq in ((1, 64), (64, 2048)):
        a, b = (dict(p.time(batch=batch, seq=seq).kinds) for p in (eager, graphs))
        for kind in ("matmul", "attention", "memory", "launch"):
            assert b[kind] == pytest.approx(a[kind]), kind
        assert b["host"] < a["host"]
        assert b["host"] >= 2 * 4 * h200.host_fused
    small = [p.time(batch=1, seq=64).step for p in (eager, graphs)]
    big = [p.time(batch=64, seq=2048).step for p in (eager, graphs)]
    assert small[1] < 0.5 * small[0], small
    assert big[1] == pytest.approx(big[0], rel=0.05), big


def test_activations_scale_with_the_batch_and_split_under_tp():
    m = _llama(**SMALL)
    one = ml.plan(m, None, ml.Mesh(dp=1, fake=True))
    a1, a2 = (one.memory(batch=b, seq=256).activations.saved for b in (1, 2))
    assert 1.9 < a2 / a1 <= 2.0
    tp = ml.plan(m, ml.shard(ml.policies.auto), ml.Mesh(tp=4, fake=True))
    est = tp.memory(batch=1, seq=256).activations
    inside = [r for r in est.saved_rows if r.in_block and "/4 tp" in r.note]
    assert inside and est.saved < a1          # the regions split, the residual stream not
    assert any(r.module.endswith("input_layernorm") and "tp" not in r.note
               for r in est.saved_rows)


def test_pipeline_holds_its_microbatches_in_flight():
    m = _llama(**{**SMALL, "num_hidden_layers": 8})
    base = ml.plan(m, None, ml.Mesh(dp=1, fake=True)).memory(batch=8, seq=128).activations
    pp = ml.plan(m, ml.pipeline("pp", microbatches=8), ml.Mesh(pp=4, fake=True))
    from meshlab.transforms.pipeline import Pipeline
    from meshlab.transforms.pipeline._schedule import in_flight

    flight = in_flight(pp, pp.get(Pipeline))
    assert flight[0] == {0: 4} and flight[3] == {3: 1}       # 1F1B: p - rank
    got = pp.memory(batch=8, seq=128).activations
    block = sum(r.total for r in base.saved_rows if r.in_block) / 8       # one block
    # rank 0: 2 blocks x 4 microbatches of 1/8 of the batch
    mine = sum(r.total for r in got.saved_rows if r.in_block)
    assert mine == pytest.approx(block * 2 * 4 / 8, rel=1e-6)


def test_zero2_peaks_above_zero3():
    m = _llama(**SMALL)
    peak = {s: ml.plan(m, ml.zero_shard(s), ml.Mesh(dp=8, fake=True))
            .memory(batch=1, seq=256) for s in (2, 3)}
    assert peak[2].total == peak[3].total            # the same between steps
    assert peak[2].peak > peak[3].peak               # ZeRO-2 keeps every unit gathered
    names = {r.module for r in peak[3].transients}
    assert "(gathered parameters)" in names


def test_zero3_reshard_share_sits_between_zero2_and_zero3():
    """zero_shard(3, reshard=0.5): the last half of the blocks stay gathered from their
    forward to their backward (counted as held, as ZeRO-2's are), the first half are freed
    and gathered again for the backward (one all-gather more each, as ZeRO-3's)."""
    m = _llama(**SMALL)
    mesh = ml.Mesh(dp=8, fake=True)
    plans = {k: ml.plan(m, z, mesh) for k, z in (
        ("2", ml.zero_shard(2)), ("3", ml.zero_shard(3)), ("half", ml.zero_shard(3, reshard=0.5)),
        ("none", ml.zero_shard(3, reshard=0.0)))}

    def held(k):
        rows = plans[k].memory(batch=1, seq=256).transients
        return next(r.bytes for r in rows if r.module == "(gathered parameters)")

    def gathers(k):
        return plans[k].comm().count("all_gather")

    assert held("3") < held("half") < held("2")
    assert gathers("2") < gathers("half") < gathers("3")
    blocks = len(plans["3"].model.blocks)
    assert gathers("3") - gathers("half") == blocks - round(0.5 * blocks)
    # reshard counts blocks: the root (embeddings, norm, head) is freed at stage 3 still
    assert held("none") == held("2") and gathers("none") == gathers("2") + 1
    assert repr(ml.zero_shard(3, reshard=0.5)) == "zero_shard(stage=3, axis='dp', reshard=0.5)"
    with pytest.raises(ml.ConfigError, match="only stage 3"):
        ml.zero_shard(2, reshard=0.5)
    with pytest.raises(ml.ConfigError, match="from 0.0 to 1.0"):
        ml.zero_shard(3, reshard=1.5)


def test_peak_and_fits():
    m = _llama()
    p = ml.plan(m, ml.remat("full"), ml.Mesh(dp=1, fake=True))
    mem = p.memory(batch=2, seq=4096)
    assert mem.peak >= mem.total - mem.grads + mem.activations.saved
    assert mem.fits("h200")
    assert mem.fits(ml.machine("h200")) == (mem.peak <= ml.machine("h200").memory)
    assert not mem.fits(10 * 2 ** 30)
    text = str(mem)
    assert "activations saved" in text and "peak" in text
    with pytest.raises(ml.ConfigError, match="both"):
        p.memory(batch=2)


def test_a_plan_from_json_refuses_to_count_activations():
    p = ml.plan(_llama(**SMALL), None, ml.Mesh(dp=1, fake=True))
    back = ml.Plan.from_json(p.to_json())
    assert back == p
    with pytest.raises(ml.PlanError, match="no model to profile"):
        back.memory(batch=1, seq=16)
    assert back.memory().total == p.memory().total


def test_step_time_parts():
    m = _llama(**SMALL)
    one = ml.plan(m, None, ml.Mesh(dp=1, fake=True)).time(batch=4, seq=512)
    assert one.comm == 0 and one.step == pytest.approx(one.compute)
    full = ml.plan(m, ml.remat("full"), ml.Mesh(dp=1, fake=True)).time(batch=4, seq=512)
    assert full.compute > one.compute               # the recomputed forward
    dp = ml.plan(m, ml.data_parallel("dp"), ml.Mesh(dp=8, fake=True)).time(batch=4, seq=512)
    assert dp.comm > 0 and dp.exposed < dp.comm     # buckets overlap the backward
    pp = ml.plan(m, ml.pipeline("pp", microbatches=4), ml.Mesh(pp=2, fake=True))
    st = pp.time(batch=4, seq=512)
    from meshlab.estimate.pipeline import bubble, costed

    # the schedule replayed at the stages' profiled costs: the last stage also runs the
    # head and loss, so its rank (the busiest) idles less than the formula's 1/5 and the
    # ranks' mean more
    replay = costed(pp, batch=4, seq=512)
    assert st.bubble == pytest.approx(replay["busiest"]) and st.bubble < 1 / 5
    assert bubble(pp, batch=4, seq=512) == pytest.approx(replay["mean"])
    assert replay["mean"] > bubble(pp) == pytest.approx(1 / 5)
    assert st.compute < one.compute                 # half the blocks
    big = ml.plan(m, None, ml.Mesh(dp=1, fake=True))
    h200, a100 = (big.time(batch=32, seq=2048, gpu=g) for g in ("h200", "a100"))
    assert a100.step > h200.step                    # device-bound here: the slower card
    assert one.step == pytest.approx(one.compute)   # host-bound: the dispatch sets the pace
    assert "tokens/s" in repr(one)


def test_attention_at_a_shorter_kv_length_costs_more_per_flop():
    m = _llama(**SMALL)
    p = ml.plan(m, None, ml.Mesh(dp=1, fake=True))
    from meshlab.estimate.profile import profile
    from meshlab.estimate.time import work_kinds

    short, long_ = (profile(m, p, b, s).work[("block", "fwd")] for b, s in ((4, 256), (2, 512)))
    assert short.attn * 2 == long_.attn                       # half the kv length, same tokens
    assert short.attn_kv == long_.attn_kv == short.attn // 256  # FLOPs over the kv length
    assert short.attn_narrow == short.attn                    # head dim 64: the narrow rate
    knee = ml.machine("h200").replace(attention_knee_narrow=512.0)
    assert work_kinds(long_, knee)["attention"] == pytest.approx(
        long_.attn / knee.attention_narrow * (1 + 512 / 512))
    per_flop = [work_kinds(w, knee)["attention"] / w.attn for w in (short, long_)]
    assert per_flop[0] == pytest.approx(per_flop[1] * 1.5)    # (1 + 2) / (1 + 1)


def test_machine_profiles():
    h = ml.machine("h200")
    assert ml.machine("H200") is h and h.memory > 139 * 2 ** 30
    assert ml.Machine.from_json(h.to_json()) == h
    with pytest.raises(ml.ConfigError, match="h200"):
        ml.machine("tpu-v9")
    with pytest.raises(ml.ConfigError, match="unknown fields"):
        ml.Machine.from_json({**h.to_json(), "flops": 1})
    from meshlab.estimate.machine import parse_memory

    assert parse_memory("141GB") == 141 * 10 ** 9 and parse_memory("80GiB") == 80 * 2 ** 30
    with pytest.raises(ml.ConfigError, match="141GB"):
        parse_memory("lots")


def test_calibrate_on_this_cpu(tmp_path):
    m = ml.calibrate("cpu", quick=True, progress=lambda s: None)
    assert m.matmul > 1e9 and m.hbm > 1e8 and 0 < m.launch < 1e-3 and m.host_op > 0
    from meshlab.cli import main

    out = tmp_path / "m.json"
    assert main(["calibrate", "--device", "cpu", "--quick", "--out", str(out)]) == 0
    p = ml.plan(_llama(**SMALL), None, ml.Mesh(dp=1, fake=True))
    assert p.time(batch=1, seq=64, gpu=str(out)).step > 0


def test_advise_70b_on_64():
    a = ml.advise(_llama(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                         num_attention_heads=64), gpus=64, batch=64, seq=4096)
    assert a.best and all(b.fits for b in a.best)
    speeds = [b.tokens_per_s for b in a.best]
    assert speeds == sorted(speeds, reverse=True)
    assert len(a.tried) > len(a.best)            # some layouts do not fit
    assert "tokens/s" in str(a) and "<table" in a._repr_html_()
    # the title counts every layout that fits, not only the ones shown
    fit = sum(t.fits for t in a.tried)
    assert f"{fit} of {len(a.tried)} layouts fit" in a.title
    assert f"the fastest {len(a.best)} shown" in a.title


def test_advise_405b_on_16384_ranks_within_a_minute():
    m = presets.build("llama3-405b", device="meta", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    a = ml.advise(m, gpus=16384, batch=2048, seq=8192)
    took = time.perf_counter() - t0
    print(f"405B on 16,384 ranks: {len(a.tried)} layouts in {took:.1f} s; best {a.best[0].row()}")
    assert a.best and took < 60


def test_cli_plan_prints_the_peak_and_the_step(capsys):
    from meshlab.cli import main

    rc = main(["plan", "--model", "llama3-8b", "--mesh", "dp=8", "--zero", "3", "--remat",
               "full", "--batch", "1", "--seq", "2048"])
    out = capsys.readouterr().out
    assert rc == 0 and "activations saved" in out and "fits h200" in out
    assert "predicted step on h200" in out
    rc = main(["plan", "--model", "llama3-8b", "--mesh", "dp=1", "--batch", "16", "--seq",
               "8192", "--memory", "80GiB"])
    assert rc == 0 and "does NOT fit" in capsys.readouterr().out
    assert main(["plan", "--model", "llama3-8b", "--advise"]) == 2
    assert "--gpus" in capsys.readouterr().err


def test_saved_counter_matches_the_profile_on_one_process():
    from meshlab.estimate.profile import SavedCounter

    for family in ("llama", "gpt2"):
        plan = ml.plan(M.build(family), None, ml.Mesh(dp=1, fake=True))
        want = plan.memory(batch=2, seq=16).activations.saved
        from transformers import AutoConfig, AutoModelForCausalLM

        kw = dict(M.TINY[family])
        cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
        cfg._attn_implementation = "eager"
        model = AutoModelForCausalLM.from_config(cfg)
        ids = torch.randint(0, 97, (2, 16))
        with SavedCounter(model) as sc:
            loss = ml.losses.causal_lm_loss(model(input_ids=ids), {"input_ids": ids})
        got = sc.saved(exclude=[loss])
        assert abs(want / got - 1) < 0.02, (family, got, want)


@pytest.mark.slow
def test_advise_shares_rows_across_remat_policies_without_changing_them(monkeypatch):
    """advise computes each mesh's memory rows and gradient reductions once, for every
    remat policy and for both memory and time: every layout it returns is the one it
    returns when each plan computes its own."""
    import contextlib

    from meshlab.planning import rows

    def layouts(a):
        return [(t.mesh, t.zero, t.remat, t.microbatches, t.peak, t.fits, t.step, t.spec)
                for t in a.tried]

    m = _llama(**SMALL)
    shared = layouts(ml.advise(m, gpus=8, batch=8, seq=256))

    class Apart:
        def same(self, plan, like):
            pass

    monkeypatch.setattr(rows, "shared_rows", lambda: contextlib.nullcontext(Apart()))
    alone = layouts(ml.advise(m, gpus=8, batch=8, seq=256))
    assert shared == alone and {t[2] for t in shared} == {"none", "selective", "full"}
    assert len({t[0] for t in shared}) > 1


def test_advise_searches_sequence_parallelism_for_long_sequences():
    a = ml.advise(_llama(), gpus=16, batch=4, seq=32768)
    sps = {dict(t.mesh).get("sp", 1) for t in a.tried}
    assert sps >= {1, 2, 4}, sps
    assert all("sequence" in t.spec for t in a.tried if dict(t.mesh).get("sp", 1) > 1)
    short = ml.advise(_llama(**SMALL), gpus=16, batch=16, seq=2048)
    assert all("sp" not in dict(t.mesh) for t in short.tried)
