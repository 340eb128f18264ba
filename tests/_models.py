"""Tiny Hugging Face models and the transform matrix shared by the distributed tests."""

from __future__ import annotations

import torch

TINY = {
    "llama": dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=97),
    "mistral": dict(model_type="mistral", hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=97),
    "qwen2": dict(model_type="qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=97),
    "qwen3": dict(model_type="qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=97),
    "gpt2": dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, vocab_size=97,
                 n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "bert": dict(model_type="bert", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, vocab_size=97, max_position_embeddings=64,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
}


def build(family: str, **overrides):
    """The model on the meta device (parallelize and init_weights materialize it)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

    kw = {**TINY[family], **overrides}
    mt = kw.pop("model_type")
    cfg = AutoConfig.for_model(mt, **kw)
    cfg._attn_implementation = "eager"
    cls = AutoModelForMaskedLM if family == "bert" else AutoModelForCausalLM
    with torch.device("meta"):
        return cls.from_config(cfg)


def loss_fn(family: str):
    import meshlab as ml

    return ml.losses.masked_lm_loss if family == "bert" else ml.losses.causal_lm_loss


TP_RULES = dict(batch="dp", heads="tp", kv_heads="tp", mlp="tp", vocab="tp", embed=None)


def spec(name: str):
    """The transforms of the parity matrix, by name."""
    import meshlab as ml

    rules = ml.Rules(**TP_RULES)
    sp = rules | ml.Rules(seq="tp")
    return {
        "dp": ml.data_parallel("dp"),
        "zero1": ml.zero_shard(1, "dp"),
        "zero2": ml.zero_shard(2, "dp"),
        "zero3": ml.zero_shard(3, "dp"),
        "tp": ml.shard(ml.policies.auto, rules),
        "tp_sp": ml.shard(ml.policies.auto, sp),
        "tp_zero3": ml.shard(ml.policies.auto, rules) | ml.zero_shard(3, "dp"),
        "tp_zero1": ml.shard(ml.policies.auto, rules) | ml.zero_shard(1, "dp"),
        # JAX-style 2-D sharding: embed over dp (FSDP), heads/MLP/vocab over tp (TP)
        "tp_fsdp_2d": ml.shard(ml.policies.auto, ml.Rules(**{**TP_RULES, "embed": "dp"})),
    }[name]


def mesh_for(name: str, world: int):
    """Data-parallel specs use every rank on ``dp``; TP specs split the world dp x tp."""
    import meshlab as ml

    if name.startswith("tp"):
        return ml.Mesh(dp=world // 2, tp=2)
    return ml.Mesh(dp=world)


def batches(steps: int = 3, batch: int = 4, seq: int = 8, vocab: int = 97, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(steps)]


def full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def reference(family: str, data, lr: float = 1e-3, seed: int = 0, **overrides):
    """The single-process model trained with AdamW on the global batches ``data``:
    returns (model, the loss of every step, the gradients of the first step)."""
    import meshlab as ml

    ref = ml.init_weights(build(family, **overrides), seed=seed)
    opt = torch.optim.AdamW(ref.parameters(), lr=lr)
    losses, grads = [], None
    for i, b in enumerate(data):
        loss = loss_fn(family)(ref(input_ids=b), {"input_ids": b, "labels": b})
        loss.backward()
        if i == 0:
            grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return ref, losses, grads


def assert_weights_match(model, ref, atol: float = 1e-4, rtol: float = 1e-3) -> dict:
    """Every parameter this rank holds equals the reference's (gathered); returns them."""
    refp = dict(ref.named_parameters())
    out = {}
    for n, p in model.named_parameters():
        w = full(p).detach()
        torch.testing.assert_close(w, refp[n].detach(), atol=atol, rtol=rtol,
                                   msg=lambda m, n=n: f"weight {n}: {m}")
        out[n] = w
    return out
