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
    # mixture of experts: transformers' common experts layout (ExpertsInterface)
    "mixtral": dict(model_type="mixtral", hidden_size=32, intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=97, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(model_type="qwen2_moe", hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=97, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, shared_expert_intermediate_size=32,
                      decoder_sparse_step=1, mlp_only_layers=[]),
    "deepseek_v3": dict(model_type="deepseek_v3", hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                        vocab_size=97, n_routed_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1,
                        n_group=2, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
    "qwen3_moe": dict(model_type="qwen3_moe", hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=97, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, decoder_sparse_step=1, mlp_only_layers=[],
                      head_dim=8),
    "olmoe": dict(model_type="olmoe", hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=97, num_experts=4,
                  num_experts_per_tok=2, eos_token_id=None, pad_token_id=None),
    "granitemoe": dict(model_type="granitemoe", hidden_size=32, intermediate_size=32,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=97, num_local_experts=4, num_experts_per_tok=2),
    "phimoe": dict(model_type="phimoe", hidden_size=32, intermediate_size=32,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   vocab_size=97, num_local_experts=4, num_experts_per_tok=2),
    "glm4_moe": dict(model_type="glm4_moe", hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     vocab_size=97, n_routed_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=16, first_k_dense_replace=0, n_shared_experts=1,
                     n_group=1, topk_group=1, head_dim=8),
    "gpt_oss": dict(model_type="gpt_oss", hidden_size=32, intermediate_size=32,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    vocab_size=97, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
                    layer_types=["full_attention"] * 2),
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


TP_RULES = dict(batch=("dp", None), heads="tp", kv_heads="tp", mlp="tp", vocab="tp", embed=None)


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
    """Every parameter this rank holds equals the reference's (both gathered: the reference
    may be a parallelized model too); returns them."""
    refp = dict(ref.named_parameters())
    out = {}
    for n, p in model.named_parameters():
        w = full(p).detach()
        torch.testing.assert_close(w, full(refp[n]).detach(), atol=atol, rtol=rtol,
                                   msg=lambda m, n=n: f"weight {n}: {m}")
        out[n] = w
    return out


# -- a hand-written transformer: no Hugging Face, no policy ------------------------------
HAND = dict(vocab=96, dim=32, n_heads=4, hidden=64, n_layers=2, max_len=16)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def causal_attention(q, k, v):
    """(B, H, S, hd) -> (B, H, S, hd) in plain ops, which DTensor propagates through."""
    S = q.shape[-2]
    att = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    mask = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    return att.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def sdpa_attention(q, k, v):
    """The same on local blocks, through torch's fused kernel (no DTensor rule on CPU)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


class HandAttention(torch.nn.Module):
    def __init__(self, dim: int, n_heads: int, core: str = "plain"):
        super().__init__()
        import meshlab as ml
        from meshlab import P

        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim, bias=False)
                                          for _ in range(4))
        self.core = causal_attention
        heads = P("batch", "heads", None, None)
        if core == "shard_map":     # the core over heads, each rank on its own
            self.core = ml.shard_map(sdpa_attention, in_specs=(heads,) * 3, out_specs=heads)
        if core == "shard_map_temperature":   # and a learnable temperature, replicated
            self.temperature = torch.nn.Parameter(torch.empty(()))
            self.core = ml.shard_map(lambda q, k, v, t: sdpa_attention(q * t, k, v),
                                     in_specs=(heads,) * 3 + (P(),), out_specs=heads)

    def reset_parameters(self):
        if getattr(self, "temperature", None) is not None:
            torch.nn.init.constant_(self.temperature, 1.5)

    def forward(self, x):
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)
        extra = (self.temperature,) if getattr(self, "temperature", None) is not None else ()
        y = self.core(q, k, v, *extra).transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim)
        return self.o(y)


class HandMLP(torch.nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(dim, hidden), torch.nn.Linear(hidden, dim)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


class HandBlock(torch.nn.Module):
    def __init__(self, dim: int, n_heads: int, hidden: int, core: str):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(dim), HandAttention(dim, n_heads, core)
        self.mlp_norm, self.mlp = torch.nn.LayerNorm(dim), HandMLP(dim, hidden)

    def forward(self, h):
        h = h + self.attn(self.attn_norm(h))
        return h + self.mlp(self.mlp_norm(h))


class HandLM(torch.nn.Module):
    """A small decoder written the way research code is: token and learned position
    embeddings, pre-norm blocks, a head. ``sp`` splits the residual stream's sequence
    over ``tp`` between blocks with ``constrain`` (a no-op on one process)."""

    def __init__(self, vocab, dim, n_heads, hidden, n_layers, max_len, sp=False,
                 core="plain"):
        super().__init__()
        self.sp = sp
        self.embed, self.pos = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(max_len, dim)
        self.blocks = torch.nn.ModuleList(HandBlock(dim, n_heads, hidden, core)
                                          for _ in range(n_layers))
        self.norm, self.head = RMSNorm(dim), torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        import meshlab as ml
        from meshlab import P

        B, S = ids.shape
        h = self.embed(ids) + self.pos(torch.arange(S, device=ids.device))
        for block in self.blocks:
            if self.sp:
                h = ml.constrain(h, P("batch", "tp", None))
            h = block(h)
        if self.sp:
            h = ml.constrain(h, P("batch", None, None))
        return self.head(self.norm(h))


def build_hand(**kw):
    with torch.device("meta"):
        return HandLM(**{**HAND, **kw})


def hand_loss(logits, ids):
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


HAND_RULES = dict(batch="dp", heads="tp", mlp="tp", vocab="tp", embed=None)
HAND_SPECS = {
    "embed.weight": ("vocab", "embed"),
    "blocks.*.attn.[qkv].weight": ("heads", "embed"),
    "blocks.*.attn.o.weight": ("embed", "heads"),
    "blocks.*.mlp.up.weight": ("mlp", "embed"),
    "blocks.*.mlp.up.bias": ("mlp",),
    "blocks.*.mlp.down.weight": ("embed", "mlp"),
    "head.weight": ("vocab", "embed"),
}
# Specs a local-shard path could not run: only q split, up split with down whole.
HAND_MIXED = {
    "blocks.*.attn.q.weight": ("heads", "embed"),
    "blocks.*.mlp.up.weight": ("mlp", "embed"),
    "blocks.*.mlp.up.bias": ("mlp",),
}



# -- a decoder written to the pipeline contract (docs/transforms.md, pipeline) ----------
STAGED = dict(vocab=96, dim=32, n_heads=4, hidden=64, n_layers=4, max_len=32)


class StagedBlock(torch.nn.Module):
    """A pre-norm block whose attention is causal and skips padded keys."""

    def __init__(self, dim: int, n_heads: int, hidden: int):
        super().__init__()
        self.n_heads = n_heads
        self.attn_norm, self.qkv = RMSNorm(dim), torch.nn.Linear(dim, 3 * dim, bias=False)
        self.o = torch.nn.Linear(dim, dim, bias=False)
        self.mlp_norm, self.mlp = torch.nn.LayerNorm(dim), HandMLP(dim, hidden)

    def forward(self, h, attention_mask=None):
        B, S, D = h.shape
        q, k, v = (t.view(B, S, self.n_heads, -1).transpose(1, 2)      # (B, nh, S, hd)
                   for t in self.qkv(self.attn_norm(h)).chunk(3, dim=-1))
        causal = torch.ones(S, S, dtype=torch.bool, device=h.device).tril()
        allowed = causal
        if attention_mask is not None:     # (B, 1, S, S); a padded query sees itself
            keys = attention_mask.bool()[:, None, None, :]
            allowed = causal & (keys | torch.eye(S, dtype=torch.bool, device=h.device))
        att = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        y = att.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
        h = h + self.o(y.transpose(1, 2).reshape(B, S, D))
        return h + self.mlp(self.mlp_norm(h))


class StagedLM(torch.nn.Module):
    """A decoder that follows the pipeline contract: its blocks in a ModuleDict, and a
    forward that skips what a stage does not hold (``None``), so
    ``pipeline('pp', blocks='layers')`` runs it on every stage as written."""

    def __init__(self, vocab, dim, n_heads, hidden, n_layers, max_len):
        super().__init__()
        self.embed, self.pos = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(max_len, dim)
        self.layers = torch.nn.ModuleDict({str(i): StagedBlock(dim, n_heads, hidden)
                                           for i in range(n_layers)})
        self.norm, self.head = RMSNorm(dim), torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, attention_mask=None, position_ids=None):
        if self.embed is not None:                     # the first stage: ids (B, S)
            if position_ids is None:
                position_ids = torch.arange(ids.shape[1], device=ids.device)
            h = self.embed(ids) + self.pos(position_ids)
        else:                                          # a later stage: hidden states
            h = ids
        for block in self.layers.values():
            h = block(h, attention_mask)
        return self.head(self.norm(h)) if self.head is not None else h   # (B, S, V)


def build_staged(**kw):
    with torch.device("meta"):
        return StagedLM(**{**STAGED, **kw})


def padded_batch(batch: int = 8, seq: int = 12, vocab: int = 96, seed: int = 3,
                 positions: bool = True, left: bool = False) -> dict:
    """Right-padded token rows (``left``: left-padded): ``attention_mask`` 0 and labels
    -100 on each row's padding; with ``positions``, each row's positions start at its own
    offset."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    if left:           # real tokens then attend to padded keys unless the mask hides them
        mask = mask.flip(1)
    labels = ids.masked_fill(mask == 0, -100)
    out = {"ids": ids, "attention_mask": mask, "labels": labels}
    if positions:
        out["position_ids"] = torch.randint(0, 32 - seq, (batch, 1), generator=g) + \
            torch.arange(seq)[None, :]
    return out


def staged_loss(logits, batch):
    """Next-token cross-entropy over the positions ``attention_mask`` keeps and the labels
    mark (the loss reads both from the microbatch)."""
    keep = batch["attention_mask"][:, 1:].bool() & (batch["labels"][:, 1:] != -100)
    targets = batch["labels"][:, 1:].masked_fill(~keep, -100)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(),
                                             ignore_index=-100)
