"""A Llama built in bfloat16 (the GPU default) routes every op under ``fuse()`` as the
float32-built one does, each to its native kernel, and trains as the same bfloat16 model
unfused does: the mean loss of steps 15-20 within 0.5% of that run's on the same data.
(Against the float32 run the comparison measures bfloat16 weights, not the fused ops: at
this learning rate they learn about 7% slower whatever runs them, and at 1e-2 runs a
seed apart differ by up to 30%, fused or not.)"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_process")]

STEPS = 20


def _run(dtype, fused=True):
    import transformers

    import meshlab as ml
    from meshlab.ops import _build

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    if fused:
        model = ml.parallelize(model, ml.fuse(), ml.Mesh(dp=1))
        opt = ml.optimizer(model, torch.optim.AdamW, lr=3e-3)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    assert next(model.parameters()).dtype == dtype
    g = torch.Generator().manual_seed(1)
    starts = torch.randint(0, 64, (STEPS, 4, 1), generator=g)
    _build.LAST_PATH.clear()
    losses = []
    for s in range(STEPS):          # counting sequences from random starts: learnable
        ids = (starts[s] + torch.arange(32)) % 64
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v for k, v in _build.LAST_PATH.items()}


def test_a_bf16_built_llama_routes_every_op_and_trains_as_fp32():
    from meshlab.ops import _build

    if _build.native_disabled_reason() or _build._compiler_missing():
        pytest.skip("the C++ kernels are off or cannot be built here")
    _, fp32_paths = _run(torch.float32)
    got, paths = _run(torch.bfloat16)
    ref, _ = _run(torch.bfloat16, fused=False)
    assert fp32_paths.keys() == paths.keys()
    assert {"rms_norm", "rotary", "swiglu", "attention"} <= {op for op, _ in paths}
    not_native = {k: p.reason for k, p in paths.items() if not p.native}
    assert not not_native, not_native
    assert ref[-1] < 0.7 * ref[0] and got[-1] < 0.7 * got[0], (ref, got)   # it learns
    mean = lambda xs: sum(xs[14:]) / len(xs[14:])    # noqa: E731
    assert abs(mean(got) - mean(ref)) <= 0.005 * mean(ref), (mean(got), mean(ref))


def test_a_llama_built_under_a_bf16_default_dtype_routes_every_op():
    """A model built after ``torch.set_default_dtype(torch.bfloat16)`` (Colossal-AI's llama
    benchmark builds it so): the probes of the norm, rotary, MLP and residual routes compute
    in float32 all the same, so they test the ops' math, not bf16's rounding (they had
    refused the norm at 1.9e-3 and rotary at 2.4e-3, and the MLP probe had raised a dtype
    error); the fused model's logits are the unfused model's to bf16 rounding."""
    import copy

    import transformers

    import meshlab as ml

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        torch.manual_seed(0)
        plain = transformers.LlamaForCausalLM(cfg)
        assert next(plain.parameters()).dtype == torch.bfloat16
        model = ml.parallelize(copy.deepcopy(plain), ml.fuse(), ml.Mesh(dp=1))
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            got, want = model(input_ids=ids).logits, plain(input_ids=ids).logits
    finally:
        torch.set_default_dtype(old)
    assert model.model.norm.forward.__func__ is not type(model.model.norm).forward
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < 2e-2, err
