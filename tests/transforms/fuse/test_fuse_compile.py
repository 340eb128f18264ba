"""torch.compile of a fuse()d Llama: a tiny one (2 layers, hidden 64, sequence 32) trains a
few AdamW steps on the CPU compiled with inductor, to the eager fused model's losses.

Inductor, not aot_eager: the code inductor generates asserts the sizes and strides of every
custom op's outputs against what the op's fake kernel said, which is where a fake that
disagrees with the real kernel on one layout fails (rotary's input gradient arrives as the
transpose of attention's contiguous dq); aot_eager runs the same graphs without checking.
The FX graph and AOT autograd caches are off so that the graph is compiled against the fake
kernels as they are now, not reloaded from an earlier compile (the kernel-level code cache
stays on and only saves C++ compiler time).
"""

from __future__ import annotations

import copy

import pytest
import torch

OPS = ("rms_norm", "rotary", "attention", "mlp", "loss")
STEPS, BATCH, SEQ = 4, 2, 32


def _fused_llama():
    import meshlab as ml
    from meshlab.policies import presets
    from meshlab.transforms.fuse import fuse_model

    # tiny-llama is hidden 64, 2 layers, 4 heads over 2 kv heads, a vocabulary of 256.
    model = ml.init_weights(presets.build("tiny-llama"), seed=0)
    report = fuse_model(model, OPS)
    assert set(report.counts()) == set(OPS) | {"residual_add"}, report.counts()
    return model


def _train(model, loss_of) -> list[float]:
    """Losses of ``STEPS`` AdamW steps on one batch (which the model learns, so they fall)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=g)
    ids[0, :3] = -100                       # ignored labels pass through the fused loss
    batch = {"input_ids": ids.clamp_min(0), "labels": ids}
    losses = []
    for _ in range(STEPS):
        loss = loss_of(batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _recording_inductor(seen: set[str]):
    """inductor, after writing down the meshlab:: ops of each graph dynamo hands it."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        # Subgraphs too: an autograd.Function (swiglu_mlp) traces as one higher-order op
        # whose forward is a submodule's graph.
        seen.update(str(n.target) for m in gm.modules() if hasattr(m, "graph")
                    for n in m.graph.nodes
                    if n.op == "call_function" and str(n.target).startswith("meshlab."))
        return compile_fx(gm, example_inputs)

    return backend


@pytest.mark.timeout(300)
def test_compiled_fused_llama_trains_like_eager():
    from meshlab.transforms.fuse import causal_lm_loss

    torch._dynamo.reset()
    eager_model = _fused_llama()
    compiled_model = copy.deepcopy(eager_model)
    eager = _train(eager_model, lambda b: causal_lm_loss(eager_model, b))

    seen: set[str] = set()
    step = torch.compile(lambda b: causal_lm_loss(compiled_model, b),
                         backend=_recording_inductor(seen), fullgraph=True)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = _train(compiled_model, step)
    torch._dynamo.reset()

    # Every routed op is in the compiled graph, not run eagerly beside it.
    assert {"meshlab.rms_norm", "meshlab.rotary", "meshlab.attention", "meshlab.swiglu",
            "meshlab.linear_cross_entropy"} <= seen, seen
    assert compiled[-1] < compiled[0], compiled                       # it trains
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-4, atol=0)
