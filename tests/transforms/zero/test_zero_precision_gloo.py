"""ZeRO-2/3 (FSDP2) in 16 bits beside the parameters FSDP2 leaves whole, on 4 gloo ranks.

GPT-2's ``c_attn`` packs q|k|v into one Conv1D; tensor parallelism splits its bias on dim 0
as strides of the three parts (``_StridedShard``), which FSDP2's dim-0 sharding cannot
split again, so FSDP2 leaves that bias whole (``ignored_params``) and the backward
averages its gradient over the data axes (``GradSync``). FSDP2's mixed precision casts
the parameters it manages to the compute dtype for the forward; the whole ones are cast
the same way (``zero._install.cast_whole``): each stays a float32 parameter, its module
reads it in the compute dtype, and its gradient comes back through the cast in float32,
then is averaged in the policy's reduction dtype like the rest.

The other parameters FSDP2 leaves whole are those a 2-D spec keeps whole on the data
axis (FSDP by spec, ``P('dp', 'tp')``): Qwen2's q/k/v biases, split over the heads only.

GPT-2 under ``shard | zero_shard(2 or 3) | precision(p)`` and Qwen2 under a 2-D spec
(``embed`` over dp, heads over tp) on ``Mesh(dp=2, tp=2)`` train three steps (SGD, lr 0.1)
against one process on the whole batch under ``torch.autocast`` of that dtype, at that
dtype's tolerance (``tests/transforms/test_table_parity.py``'s ``_BF16`` and ``_FP16``, per
tensor: ``|layout - reference| <= atol + rtol * max|reference|``): every step's loss and
every final weight. The biases left whole start at zero, so their values are their
updates: they are held to the dtype's relative tolerance alone (measured without the
reduction over dp: 60% to 160% off; with it under 1%). One more forward and
backward then shows the module computing in the 16-bit dtype, nothing of the cast left
on it, and the whole bias's gradient in float32. Before, the plan refused these layouts
(``ConfigError``: the biases would stay float32 beside the 16-bit weights they are
computed with).
"""

from __future__ import annotations

import pytest
import torch

from tests import _models as M
from tests.transforms.test_table_parity import _BF16, _FP16

pytestmark = pytest.mark.timeout(600)

STEPS, LR = 3, 0.1
_DTYPES = {"bf16": (torch.bfloat16, _BF16), "fp16": (torch.float16, _FP16)}
# (family, the spec's name, the parameters FSDP2 leaves whole)
LAYOUTS = {
    "gpt2-tp-zero2": ("gpt2", "tp_zero2", [f"transformer.h.{i}.attn.c_attn.bias"
                                           for i in range(2)]),
    "gpt2-tp-zero3": ("gpt2", "tp_zero3", [f"transformer.h.{i}.attn.c_attn.bias"
                                           for i in range(2)]),
    "qwen2-fsdp-2d": ("qwen2", "tp_fsdp_2d", [f"model.layers.{i}.self_attn.{x}_proj.bias"
                                              for i in range(2) for x in "qkv"]),
}


def _spec(name: str, prec: str):
    import meshlab as ml

    tp = ml.shard(ml.policies.auto, ml.Rules(**M.TP_RULES))
    spec = {"tp_zero2": tp | ml.zero_shard(2, "dp"), "tp_zero3": tp | ml.zero_shard(3, "dp"),
            "tp_fsdp_2d": M.spec("tp_fsdp_2d")}[name]
    return spec | ml.precision(prec)


def _reference(family, data, dtype):
    """One process on the whole batches under autocast to ``dtype``."""
    import meshlab as ml

    ref = ml.init_weights(M.build(family), seed=0)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    losses = []
    for b in data:
        with torch.autocast("cpu", dtype=dtype):
            loss = M.loss_fn(family)(ref(input_ids=b), {"input_ids": b})
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return ref, losses


def _close(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float, what: str):
    bound = atol + rtol * want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= bound, f"{what}: {err:.3g} off, beyond {bound:.3g}"
    return err / max(want.abs().max().item(), 1e-30)


def _cast_in_forward(model, family, whole: str, b, dtype) -> str:
    """One more forward and backward (no step): the module holding ``whole`` computes in
    ``dtype``, nothing of the cast stays on it, and the whole bias's gradient is
    float32."""
    from torch.distributed.tensor import DTensor

    owner, name = whole.rsplit(".", 1)
    mod = dict(model.named_modules())[owner]
    seen = []
    h = mod.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    loss = M.loss_fn(family)(model(input_ids=b), {"input_ids": b})
    h.remove()
    loss.backward()
    bias = dict(model.named_parameters())[whole]
    assert seen == [dtype], seen
    assert name not in mod.__dict__
    assert isinstance(bias.grad, DTensor) and bias.grad.dtype == torch.float32
    model.zero_grad(set_to_none=True)
    return str(seen[0])


def whole_param_case(rank, world, layout, prec):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    import meshlab as ml
    from meshlab.transforms.zero import fsdp_ignored

    family, spec, whole = LAYOUTS[layout]
    dtype, (atol, rtol) = _DTYPES[prec]
    data = M.batches(STEPS + 1, batch=4, seq=8)
    ref, ref_losses = _reference(family, data[:STEPS], dtype)
    model = ml.parallelize(M.build(family), _spec(spec, prec), ml.Mesh(dp=2, tp=2), seed=0)
    assert fsdp_ignored(model._meshlab.plan) == set(whole)
    params = dict(model.named_parameters())
    for n in whole:         # FSDP2 left it whole: no shard of it over dp
        p = params[n]
        assert isinstance(p, DTensor), n
        dims = p.device_mesh.mesh_dim_names
        assert "dp" not in dims or p.placements[dims.index("dp")] == Replicate(), \
            (n, dims, p.placements)
    opt = ml.optimizer(model, torch.optim.SGD, lr=LR)
    dp_rank = dist.get_rank(model._meshlab.dp_group)
    lf = M.loss_fn(family)
    losses = [ml.step(model, opt, {"input_ids": b.chunk(2)[dp_rank]}, lf)
              for b in data[:STEPS]]
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        _close(torch.tensor(a), torch.tensor(b), atol, rtol, f"step {i}'s loss")
    refp = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        w = M.full(p).detach()
        assert w.dtype == torch.float32, n          # master weights stay float32
        _close(w, refp[n].detach(), 0.0 if n in whole else atol, rtol, n)
    moved = [M.full(params[n]).abs().max().item() for n in whole]
    assert min(moved) > 1e-5, moved                 # the steps moved the whole biases
    cast = _cast_in_forward(model, family, whole[0], data[STEPS].chunk(2)[dp_rank], dtype)
    return {"losses": losses, "cast": cast}


@pytest.mark.parametrize("prec", ["bf16", "fp16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parameters_left_whole_train_as_one_process_under_autocast(world4, layout, prec):
    out = world4.run(whole_param_case, layout=layout, prec=prec)
    assert all(o["losses"] == out[0]["losses"] for o in out)
    assert {o["cast"] for o in out} == {str(_DTYPES[prec][0])}
