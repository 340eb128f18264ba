"""An exception on one rank inside a collective section reaches every rank (2 gloo
processes).

The usual skip-the-bad-batch loop catches an exception its forward raised on one rank and
goes on. The other ranks used to wait for it in the next collective for good: the expert
dispatch's all-to-all, the backward's gradient reduction (offload, LoRA, plain data
parallelism), the next pipeline stage's receive. Now the rank that failed raises its own
error, every other rank ``PeerError`` naming it, at the same point and well within the
control timeout (``MESHLAB_CONTROL_TIMEOUT``, 30 s here), and the loop goes on in step:
the next batch trains on every rank and the replicas stay equal. The inference engine's
decode loop does the same across its steps (``meshlab.inference._agree``).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests import _models as M

pytestmark = pytest.mark.timeout(600)

CONTROL_TIMEOUT = "30"        # seconds; the harness's data groups wait 90


def _model(layout: str):
    import meshlab as ml
    from peft import LoraConfig

    # read when parallelize builds the control group
    os.environ["MESHLAB_CONTROL_TIMEOUT"] = CONTROL_TIMEOUT
    lora = ml.lora(LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                              target_modules=["q_proj", "v_proj", "down_proj"]))
    family, spec, mesh = {
        "expert_route": ("mixtral", ml.expert_route("ep"), dict(ep=2)),
        "offload": ("llama", ml.zero_shard(1, "dp") | ml.offload(optimizer=0.5), dict(dp=2)),
        "lora": ("llama", lora | ml.data_parallel("dp"), dict(dp=2)),
        "dp": ("llama", ml.data_parallel("dp"), dict(dp=2)),
        "pipeline": ("llama", ml.pipeline("pp", schedule="1f1b", microbatches=2), dict(pp=2)),
    }[layout]
    layers = dict(num_hidden_layers=4) if layout == "pipeline" else {}
    return ml.parallelize(M.build(family, **layers), spec, ml.Mesh(**mesh), seed=0)


def _arm(model, rank: int, bad: int):
    """A forward hook on this rank's first decoder layer that raises on rank ``bad`` while
    ``armed[0]`` (a bad batch, say); returns the switch."""
    armed = [False]
    layer = next(m for m in model.model.layers if hasattr(m, "self_attn"))

    def hook(_m, _args, _out):
        if armed[0] and rank == bad:
            raise ValueError(f"a bad batch on rank {bad}")

    layer.register_forward_hook(hook)
    return armed


def skip_loop_case(rank, world, layout, api, bad):
    import meshlab as ml
    from meshlab.train._content import check_replicas

    model = _model(layout)
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-3)
    armed = _arm(model, rank, bad)
    seed = rank if layout in ("expert_route", "offload", "lora", "dp") else 0
    outcomes = []
    for i, x in enumerate(M.batches(3, batch=4, seed=seed + 1)):
        armed[0] = i == 1
        t0 = time.monotonic()
        try:                                # the usual skip-the-bad-batch loop
            if api == "step":
                ml.step(model, opt, {"input_ids": x})
            else:
                model(input_ids=x, labels=x).loss.backward()
                opt.step()
            outcomes.append((None, "", time.monotonic() - t0))
        except (ValueError, ml.MeshlabError) as e:
            outcomes.append((type(e).__name__, str(e), time.monotonic() - t0))
        opt.zero_grad()
    check_replicas(model, model._meshlab.ctrl_group, "after the loop")   # still equal
    return outcomes


@pytest.mark.parametrize("layout,api,bad", [
    ("expert_route", "step", 1), ("expert_route", "loop", 0),
    ("offload", "step", 1), ("offload", "loop", 1),
    ("lora", "step", 0), ("lora", "loop", 1),
    ("dp", "loop", 1),
    ("pipeline", "step", 0), ("pipeline", "step", 1),
])
def test_a_forward_exception_on_one_rank_reaches_every_rank(world2, layout, api, bad):
    out = world2.run(skip_loop_case, layout=layout, api=api, bad=bad, timeout=150)
    for rank, outcomes in enumerate(out):
        assert [k for k, _, _ in outcomes[::2]] == [None, None], outcomes   # steps 0, 2
        kind, msg, secs = outcomes[1]
        if rank == bad:
            assert kind == "ValueError" and f"a bad batch on rank {bad}" in msg, outcomes
        else:
            assert kind == "PeerError", outcomes
            assert f"rank {bad}" in msg and "ValueError: a bad batch" in msg, msg
        assert secs < float(CONTROL_TIMEOUT), secs


# -- the inference engine's decode loop ------------------------------------------------------
def engine_case(rank, world, layout, bad):
    """Rank ``bad`` fails one decode step (tensor parallelism: after the step's
    collectives; a pipeline: inside its stage). Every engine stops at the next step."""
    import meshlab as ml
    from meshlab.inference import InferenceConfig, InferenceEngine

    os.environ["MESHLAB_CONTROL_TIMEOUT"] = CONTROL_TIMEOUT
    spec, mesh = {"tp": (M.spec("tp"), dict(dp=1, tp=2)),
                  "pp": (ml.pipeline("pp", schedule="1f1b", microbatches=2), dict(pp=2))}[layout]
    model = ml.parallelize(M.build("llama", num_hidden_layers=4), spec, ml.Mesh(**mesh),
                           seed=0).eval()
    engine = InferenceEngine(model, inference_config=InferenceConfig(
        dtype=torch.float32, max_batch_size=2, max_input_len=16, max_output_len=8,
        block_size=4, ignore_eos=True))
    armed = _arm(model, rank, bad) if layout == "pp" else [False]
    if layout == "tp" and rank == bad:
        choose = engine._choose

        def failing(*a, **kw):
            if armed[0]:
                raise ValueError(f"a bad batch on rank {bad}")
            return choose(*a, **kw)
        engine._choose = failing
    for p in ([1, 2, 3], [4, 5]):
        engine.add_request(p, 8)
    outcomes = []
    for i in range(5):
        armed[0] = i == 2
        t0 = time.monotonic()
        try:
            engine.step()
            outcomes.append((None, "", time.monotonic() - t0))
        except (ValueError, ml.MeshlabError) as e:
            outcomes.append((type(e).__name__, str(e), time.monotonic() - t0))
    return outcomes


@pytest.mark.parametrize("layout,bad", [("tp", 1), ("pp", 0), ("pp", 1)])
def test_a_decode_step_that_fails_on_one_rank_stops_every_engine(world2, layout, bad):
    out = world2.run(engine_case, layout=layout, bad=bad, timeout=150)
    for rank, outcomes in enumerate(out):
        kinds = [k for k, _, _ in outcomes]
        if rank == bad:
            assert kinds[:3] == [None, None, "ValueError"], outcomes
        else:
            assert kinds[:3] == [None, None, None], outcomes
        # from the next step on, every engine refuses, naming the failure
        assert kinds[3:] and all(k == "PeerError" for k in kinds[3:]), outcomes
        assert "ValueError: a bad batch" in outcomes[3][1], outcomes[3][1]
        assert all(secs < float(CONTROL_TIMEOUT) for _, _, secs in outcomes), outcomes
