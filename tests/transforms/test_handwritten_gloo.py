"""Hand-written transformers (no Hugging Face) trained with tensor parallelism on real
gloo processes, against the same model on one process.

Without a policy marking tensor-parallel regions a model runs in DTensor mode: its own
forward on DTensor parameters, sharding propagated by DTensor. The cases: (a) TP from a
specs dict, (b) TP + sequence parallelism written in the model with ``constrain`` on the
residual stream, (c) an attention core run per head group by ``shard_map``, (d) specs a
local-shard path could not run (only ``q`` split; ``up`` split and ``down`` whole), which
DTensor redistributes; (e) with ZeRO-1, FSDP2 and activation checkpointing; then the
examples of ``docs/policies.md``, in both modes. Each
trains 3 AdamW steps with ``ml.optimizer`` and a plain ``loss.backward(); opt.step();
opt.zero_grad()`` loop and compares every step's loss, the first step's gradients and
the final weights at the tolerances of ``test_parallel_gloo.py`` (1e-10 in float64).
Then the refusals: unknown axes, specs over the TP axis on the local-shard path, and
specs the local-shard path cannot run, refused by ``plan`` exactly as by
``parallelize``. Last, one rank of a 64-rank job on torch's fake process group.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from tests import _models as M
from tests import REPO

pytestmark = pytest.mark.timeout(900)

TOLS = (1e-5, 1e-3, 1e-6, 1e-4, 1e-4, 1e-3)      # loss, grads, weights: (atol, rtol)
DOC = os.path.join(os.fspath(REPO), "docs",
                   "policies.md")


def _hand_spec(which: str):
    import meshlab as ml
    from meshlab import P

    specs = {"tp": M.HAND_SPECS, "mixed": M.HAND_MIXED}[which]
    return ml.shard({k: P(*v) for k, v in specs.items()}, ml.Rules(**M.HAND_RULES))


def _collectives(cd) -> dict:
    return {str(k).split(".")[-1]: v for k, v in cd.get_comm_counts().items() if v}


def _reference(build, data, loss_fn, lr):
    import meshlab as ml

    ref = ml.init_weights(build(), seed=0)
    opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    losses, grads = [], None
    for i, b in enumerate(data):
        loss = loss_fn(ref(b), b)
        loss.backward()
        if i == 0:
            grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return ref, losses, grads


def _parity(build, spec, mesh, data, loss_fn, lr=1e-3, tols=TOLS, count=True) -> dict:
    """Train ``build()`` on one process and parallelized by ``spec``; compare (``count``:
    the collectives of the first forward, by CommDebugMode, which dynamo does not trace
    through)."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    import meshlab as ml
    from meshlab.transforms.shard._layout import tp_layout

    a_l, r_l, a_g, r_g, a_w, r_w = tols
    ref, ref_losses, ref_grads = _reference(build, data, loss_fn, lr)
    model = ml.parallelize(build(), spec, mesh, seed=0)
    rt = model._meshlab
    opt = ml.optimizer(model, torch.optim.AdamW, lr=lr)
    dp_rank = dist.get_rank(rt.dp_group) if rt.dp_group is not None else 0
    losses, comms = [], None
    for i, b in enumerate(data):
        local = b.chunk(rt.dp_size)[dp_rank]
        with CommDebugMode() if count else contextlib.nullcontext() as cd:
            logits = model(local)
        comms = comms or (_collectives(cd) if count else {})
        assert type(logits) is torch.Tensor and logits.shape[:2] == local.shape
        loss = loss_fn(logits, local)
        loss.backward()
        if i == 0 and opt.zero1 is None:    # ZeRO-1 keeps gradients in its flat slices
            getattr(opt, "_sync_grads", lambda: None)()
            for n, p in model.named_parameters():
                torch.testing.assert_close(M.full(p.grad), ref_grads[n], atol=a_g, rtol=r_g,
                                           msg=lambda m, n=n: f"grad of {n}: {m}")
        opt.step()
        opt.zero_grad()
        t = torch.tensor([loss.item()], dtype=torch.float64)
        if rt.dp_group is not None:
            dist.all_reduce(t, group=rt.dp_group)
        losses.append(float(t) / rt.dp_size)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=a_l, rtol=r_l)
    M.assert_weights_match(model, ref, atol=a_w, rtol=r_w)
    layout, tp_sums = tp_layout(rt.plan, 0)
    return {"losses": losses, "comms": comms, "dtensor": layout.dtensor, "tp_sums": tp_sums,
            "placements": {n: str(getattr(p, "placements", None))
                           for n, p in model.named_parameters()}}


def hand_case(rank, world, specs="tp", sp=False, core="plain", tp=2, lr=1e-3,
              dtype="float32", tols=TOLS, extra=None):
    import meshlab as ml

    torch.set_default_dtype(getattr(torch, dtype))
    try:
        data = M.batches(3, batch=4, seq=8, vocab=M.HAND["vocab"])
        spec = _hand_spec(specs)
        if extra is not None:
            spec = spec | {"zero1": ml.zero_shard(1, "dp"), "zero3": ml.zero_shard(3, "dp"),
                           "remat": ml.remat("full"),
                           "compile": ml.compile_blocks(backend="aot_eager")}[extra]
        return _parity(lambda: M.build_hand(sp=sp, core=core), spec,
                       ml.Mesh(dp=world // tp, tp=tp), data, M.hand_loss, lr, tols,
                       count=extra != "compile")
    finally:
        torch.set_default_dtype(torch.float32)


def test_tp_from_specs_matches_one_process(world4):
    out = world4.run(hand_case)
    assert all(o["losses"] == out[0]["losses"] for o in out)
    # DTensor mode: no gradient sum of meshlab's over tp (DTensor's autograd does it)
    assert out[0]["dtensor"] and out[0]["tp_sums"] == []
    pl = out[0]["placements"]
    assert pl["blocks.0.attn.q.weight"] == "(Shard(dim=0),)"
    assert pl["blocks.0.attn.o.weight"] == "(Shard(dim=1),)"
    assert pl["blocks.0.attn_norm.weight"] == "(Replicate(),)"      # a DTensor too
    # the forward communicates as Megatron's: the vocab-parallel embedding, each
    # attention and each MLP summed over tp (1 + 2 per block), the vocab-sharded logits
    # gathered for the loss; the embedding's sum is meshlab's own (c10d), the rest DTensor's
    assert out[0]["comms"] == {"allreduce_": 1, "all_reduce": 4, "all_gather_into_tensor": 1}, \
        out[0]["comms"]


def test_tp_with_sequence_parallel_constrain_matches_one_process(world4):
    out = world4.run(hand_case, sp=True)
    comms = out[0]["comms"]
    # the sequence is split between blocks: gathered into attention, scattered out of it
    assert comms.get("all_gather_into_tensor", 0) > 1, comms


def test_shard_mapped_attention_core_matches_one_process(world4):
    world4.run(hand_case, core="shard_map")


def test_a_replicated_parameter_in_a_shard_mapped_core_gets_the_whole_gradient(world4):
    """A learnable temperature passed to the attention core as P() meets this rank's heads
    only: its gradient is summed over tp (JAX's transpose of the broadcast), so every rank
    holds one process's gradient and the replicas stay equal."""
    out = world4.run(hand_case, core="shard_map_temperature", dtype="float64",
                     tols=(1e-10, 1e-10) * 3)
    assert all(o["losses"] == out[0]["losses"] for o in out)


def test_disagreeing_specs_run_in_dtensor_mode(world4):
    """Only q split, up split with down whole: DTensor redistributes, the run is exact."""
    world4.run(hand_case, specs="mixed")


def test_float64_is_exact(world4):
    out = world4.run(hand_case, sp=True, dtype="float64", lr=1e-2, tols=(1e-10,) * 6)
    assert all(o["losses"] == out[0]["losses"] for o in out)


@pytest.mark.parametrize("extra", ["zero1", "zero3", "remat", "compile"])
def test_composes_with_zero_remat_and_compile(world4, extra):
    """ZeRO-1 / FSDP2 over dp on the DTensor parameters, blocks recomputed in the
    backward (they re-enter the model's layout), and compile_blocks() (dynamo's graphs
    and their backward: aot_eager), with SP written in the model."""
    world4.run(hand_case, sp=True, extra=extra)


def test_remat_of_blocks_around_a_shard_mapped_core(world4):
    """remat('full') recomputes each block in the backward, its shard_map attention core
    and the core's learnable temperature (P(), gradient summed over tp) included: the
    recomputed core re-enters its region, so float64 training equals one process."""
    out = world4.run(hand_case, core="shard_map_temperature", extra="remat",
                     dtype="float64", tols=(1e-10, 1e-10) * 3)
    assert all(o["losses"] == out[0]["losses"] for o in out)


def test_tp_only_world(world2):
    world2.run(hand_case, sp=True, core="shard_map")


# -- docs/policies.md: its examples, in both modes --------------------------------------
def _doc(upto: int | None = None) -> dict:
    """Run the python blocks of docs/policies.md (all, or the first ``upto``)."""
    ns: dict = {"__name__": "policies_doc"}
    for code in re.findall(r"```python\n(.*?)```", open(DOC).read(), re.S)[:upto]:
        exec(compile(code, DOC, "exec"), ns)
    return ns


def _doc_build(ns, cls):
    def build():
        with torch.device("meta"):
            return ns[cls]()
    return build


def doc_case(rank, world):
    import meshlab as ml

    ns = _doc()                                  # the training block: the policy, with SP
    assert ns["losses"][-1] < ns["losses"][0], ns["losses"]
    data = M.batches(3, batch=4, seq=16, vocab=96)
    mesh = ml.Mesh(dp=2, tp=2)
    local = _parity(_doc_build(ns, "TinyLM"), ml.shard(ns["POLICY"], ns["RULES_SP"]), mesh,
                    data, ns["loss_fn"])
    dtensor = _parity(_doc_build(ns, "TinyLMSP"), ml.shard(ns["SPECS"], ns["RULES_SP"]),
                      mesh, data, ns["loss_fn"])
    return local, dtensor


def test_doc_examples_plan_without_processes():
    import torch.distributed as dist

    assert not dist.is_initialized()
    ns = _doc(-1)                                # every block but the training one
    assert ns["plan"].runnable


def test_doc_examples_train_in_both_modes(world4):
    local, dtensor = world4.run(doc_case)[0]
    # the policy sums the sequence-parallel norms' gradients over tp; DTensor mode needs none
    assert not local["dtensor"] and "blocks.0.attn_norm.weight" in local["tp_sums"]
    assert dtensor["dtensor"] and dtensor["tp_sums"] == []


# -- refusals ---------------------------------------------------------------------------
class _Probe(torch.nn.Module):
    """One linear, then ``constrain`` to ``spec``."""

    def __init__(self, spec):
        super().__init__()
        self.spec, self.lin = spec, torch.nn.Linear(4, 4)

    def forward(self, x):
        import meshlab as ml

        return ml.constrain(self.lin(x), self.spec)


def _refusal(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:       # noqa: BLE001 - the type is part of what is compared
        return type(e).__name__, str(e)
    raise AssertionError("accepted")


def constrain_errors_case(rank, world):
    import meshlab as ml
    from meshlab import P
    from meshlab.core.context import current_layout

    mesh = ml.Mesh(dp=2, tp=2)
    out = {}
    for name in ("not_an_axis", "tpp"):
        with torch.device("meta"):
            probe = _Probe(P("batch", name))
        model = ml.parallelize(probe, ml.shard({"lin.weight": P("tp", None)},
                                               ml.Rules(batch="dp")), mesh, seed=0)
        out[name] = _refusal(lambda: model(torch.ones(2, 4)))
        # the forward raised inside the model: its layout and mode are gone
        assert current_layout() is None and torch._C._len_torch_function_stack() == 0
    with mesh:                                        # a plain tensor, with a mesh active
        out["plain"] = _refusal(lambda: ml.constrain(torch.ones(2, 4), P("dq", None)))
    # and inside the model, a spec that holds is a no-op; one that moves, moves
    with torch.device("meta"):
        probe = _Probe(P("batch", "tp"))
    model = ml.parallelize(probe, ml.shard({"lin.weight": P("tp", None)},
                                           ml.Rules(batch="dp")), mesh, seed=0)
    y = model(torch.ones(2, 4))
    assert type(y) is torch.Tensor and y.shape == (2, 4)
    return out


def test_unknown_axis_in_constrain_raises(world4):
    out = world4.run(constrain_errors_case)
    assert all(o == out[0] for o in out)                 # the same error on every rank
    kind, msg = out[0]["not_an_axis"]
    assert kind == "SpecError" and "'not_an_axis'" in msg and "('dp', 'tp')" in msg
    kind, msg = out[0]["tpp"]
    assert kind == "SpecError" and "did you mean 'tp'?" in msg
    kind, msg = out[0]["plain"]
    assert kind == "SpecError" and "'dq'" in msg and "did you mean 'dp'?" in msg


def _mixed_policies(ns):
    return {"q only": ns["POLICY"].without("blocks.*.attn.k", "blocks.*.attn.v"),
            "up without down": ns["POLICY"].without("blocks.*.mlp.down")}


def test_local_path_refuses_disagreeing_specs_at_plan_time():
    import meshlab as ml

    ns = _doc(-1)
    mesh = ml.Mesh(dp=2, tp=2, fake=True)
    with torch.device("meta"):
        model = ns["TinyLM"]()
    pol = _mixed_policies(ns)
    with pytest.raises(ml.ConfigError) as e:
        ml.plan(model, ml.shard(pol["q only"], ns["RULES"]), mesh)
    msg = str(e.value)
    assert msg.startswith("blocks.0.attn.k: replicated") and "blocks.0.attn.q" in msg
    assert "P('tp', None)" in msg and "DTensor mode" in msg
    with pytest.raises(ml.ConfigError) as e:
        ml.plan(model, ml.shard(pol["up without down"], ns["RULES"]), mesh)
    msg = str(e.value)
    assert msg.startswith("blocks.0.mlp.down: replicated") and "blocks.0.mlp.up" in msg
    assert "input features" in msg and "P(None, 'tp')" in msg
    wrong = ns["POLICY"] + ml.policies.Policy(
        "tinylm", modules=(ml.policies.ModuleRule("blocks.*.attn.o", "colwise", axis="heads"),))
    with pytest.raises(ml.ConfigError, match=r"blocks\.0\.attn\.q: split over 'tp' .* no "
                                             r"row-parallel module in blocks\.0 joins"):
        ml.plan(model, ml.shard(wrong, ns["RULES"]), mesh)
    # DTensor mode runs what the local-shard path refuses (test_disagreeing_specs_...)
    assert ml.plan(model, ml.shard({"blocks.*.attn.q.weight": ml.P("heads", None)},
                                   ns["RULES"]), mesh).runnable


def mixed_policy_case(rank, world):
    import meshlab as ml

    ns = _doc(-1)
    out = {}
    for name, pol in _mixed_policies(ns).items():
        with torch.device("meta"):
            model = ns["TinyLM"]()
        out[name] = _refusal(lambda: ml.parallelize(model, ml.shard(pol, ns["RULES"]),
                                                    ml.Mesh(dp=2, tp=2)))
    return out


def test_parallelize_refuses_the_same_disagreeing_specs(world4):
    import meshlab as ml

    ns = _doc(-1)
    got = world4.run(mixed_policy_case)
    for name, pol in _mixed_policies(ns).items():
        with torch.device("meta"):
            model = ns["TinyLM"]()
        planned = _refusal(lambda: ml.plan(model, ml.shard(pol, ns["RULES"]),
                                           ml.Mesh(dp=2, tp=2, fake=True)))
        assert all(g[name] == planned for g in got), (got, planned)


def test_sequence_parallel_without_regions_points_at_the_docs():
    import meshlab as ml
    from meshlab import P

    ns = _doc(-1)
    with torch.device("meta"):
        model = ns["TinyLM"]()
    spec = ml.shard(ns["SPECS"], ns["RULES_SP"],
                    activations={"blocks.*": P("batch", "seq", "embed")})
    with pytest.raises(ml.ConfigError) as e:
        ml.plan(model, spec, ml.Mesh(dp=2, tp=2, fake=True))
    msg = str(e.value)
    assert "docs/policies.md" in msg and "ml.constrain(h, P('batch', 'tp', None))" in msg
    assert "blocks.0" in msg


def local_path_constrain_case(rank, world):
    """On the local-shard path, constrain over data axes is a checked no-op and over the
    TP axis a ConfigError (activations there are local tensors)."""
    import meshlab as ml
    from meshlab import P
    from meshlab.policies import ModuleRule as R, Policy

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = M.HandMLP(4, 8)
            self.spec = P("batch", None)

        def forward(self, x):
            return ml.constrain(self.mlp(x), self.spec)

    pol = Policy("net", modules=(R("mlp.up", "colwise", axis="mlp"),
                                 R("mlp.down", "rowwise", axis="mlp")), regions=("mlp",))
    with torch.device("meta"):
        net = Net()
    model = ml.parallelize(net, ml.shard(pol, ml.Rules(batch="dp", mlp="tp", embed=None)),
                           ml.Mesh(dp=2, tp=2), seed=0)
    x = torch.ones(2, 4)
    assert model(x).shape == (2, 4)
    model.spec = P(None, "tp")
    return _refusal(lambda: model(x))


def test_local_path_constrain_over_tp_raises(world4):
    out = world4.run(local_path_constrain_case)
    kind, msg = out[0]
    assert kind == "ConfigError" and "policy marks its tensor-parallel regions" in msg
    assert all(o == out[0] for o in out)


# -- a 64-rank job on torch's fake process group: layout decisions only ------------------
FAKE = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import meshlab as ml
    from meshlab.core.placement import local_shape
    from tests import _models as M
    from tests.transforms.test_handwritten_gloo import _hand_spec

    rank = int(sys.argv[1])
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=64)
    mesh = ml.Mesh(dp=16, tp=4)
    build = lambda: M.build_hand(sp=True, core="shard_map")
    plan = ml.plan(build(), _hand_spec("tp"), mesh)
    model = ml.parallelize(build(), _hand_spec("tp"), mesh)
    coord = mesh.coordinate(rank)
    out = {n: [list(p.to_local().shape), list(local_shape(plan[n].shape, plan[n].mesh_spec,
                                                          plan.mesh_shape, coord))]
           for n, p in model.named_parameters()}
    opt = ml.optimizer(model, torch.optim.AdamW, lr=1e-3)
    ids = torch.randint(0, 96, (2, 8))
    logits = model(ids)
    M.hand_loss(logits, ids).backward()
    opt.step()
    print("RESULT " + json.dumps({"shapes": out, "logits": list(logits.shape)}))
""")


def test_fake_process_group_64_ranks():
    """One rank of dp=16 x tp=4 in DTensor mode: local shapes equal the plan's, and a
    forward, backward and step run (collectives return no data there)."""
    root = os.fspath(REPO)
    r = subprocess.run([sys.executable, "-c", FAKE, "13"], capture_output=True, text=True,
                       timeout=240, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[7:])
    assert all(got == planned for got, planned in out["shapes"].values()), out["shapes"]
    assert out["shapes"]["blocks.0.attn.q.weight"][0] == [8, 32]
    assert out["logits"] == [2, 8, 96]
