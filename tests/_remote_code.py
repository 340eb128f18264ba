"""A tiny remote-code model family, ``tinyglm``, and a policy for it written as a user would.

``write(path)`` makes a model directory the way a trust_remote_code repository on the Hub
ships one: ``config.json`` with ``model_type: tinyglm`` and an ``auto_map`` naming the
classes in ``configuration_tinyglm.py`` and ``modeling_tinyglm.py``, which are written
beside it. transformers knows nothing of the family; ``load(path)`` builds it on the meta
device with ``trust_remote_code=True``, from local files only (transformers copies the
two modules into ``HF_MODULES_CACHE`` and imports them from there).

The model is a small ChatGLM-like decoder in ChatGLM's naming: ``transformer.embedding.
word_embeddings``, blocks ``transformer.encoder.layers.*`` of RMSNorm, ``self_attention``
(one fused ``query_key_value``, rotary on the first half of each head's features, the
core attention, ``dense``) and ``mlp`` (``dense_h_to_4h`` packing gate|up for SwiGLU,
``dense_4h_to_h``), a final RMSNorm and the head ``transformer.output_layer``.

The fused projection has ChatGLM's two layouts:

* ``multi_query_attention=False``: the output is viewed as (heads, 3 x head_dim), each
  head's q, k and v side by side. A contiguous split over its output features gives each
  rank whole heads with their own q, k and v: plain ``colwise``.
* ``multi_query_attention=True``: q | k | v contiguous, q of ``num_attention_heads``
  heads, k and v of ``multi_query_group_num`` groups each. Each part must be split on its
  own. ``packed_qkv_colwise`` splits three *equal* parts, which is right only where the
  group count equals the head count (``POLICY``); with fewer groups (ChatGLM2/3's 2)
  the parts differ, no style splits them, and the plan refuses ``packed_qkv_colwise``
  (``ConfigError``): the policy leaves attention whole and splits the MLP (``MLP_ONLY``).

``PER_HEAD`` shards the first layout. The parity cases train the model single-process
and parallelized (``_families.parity_case``) and compare.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib

import torch

import meshlab as ml
from meshlab.policies import ModuleRule as R, Policy

from . import _families as F

V = 97

CONFIG = dict(num_layers=2, padded_vocab_size=V, hidden_size=32, ffn_hidden_size=64,
              kv_channels=8, num_attention_heads=4, multi_query_attention=True,
              multi_query_group_num=4, seq_length=64)

CONFIGURATION_PY = '''\
from transformers import PretrainedConfig


class TinyGLMConfig(PretrainedConfig):
    model_type = "tinyglm"

    def __init__(self, num_layers=2, padded_vocab_size=97, hidden_size=32,
                 ffn_hidden_size=64, kv_channels=8, num_attention_heads=4, seq_length=64,
                 layernorm_epsilon=1e-5, add_bias_linear=False, add_qkv_bias=True,
                 multi_query_attention=False, multi_query_group_num=1, rope_ratio=1.0,
                 initializer_range=0.02, **kwargs):
        self.num_layers = num_layers
        self.vocab_size = padded_vocab_size
        self.padded_vocab_size = padded_vocab_size
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size
        self.kv_channels = kv_channels
        self.num_attention_heads = num_attention_heads
        self.seq_length = seq_length
        self.layernorm_epsilon = layernorm_epsilon
        self.add_bias_linear = add_bias_linear
        self.add_qkv_bias = add_qkv_bias
        self.multi_query_attention = multi_query_attention
        self.multi_query_group_num = multi_query_group_num
        self.rope_ratio = rope_ratio
        self.initializer_range = initializer_range
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
'''

MODELING_PY = '''\
import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_tinyglm import TinyGLMConfig


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class RotaryEmbedding(nn.Module):
    """cos/sin of ``dim // 2`` frequencies: (seq, dim // 2, 2), as ChatGLM's rope cache."""

    def __init__(self, dim, rope_ratio=1.0):
        super().__init__()
        self.dim, self.base = dim, 10000.0 * rope_ratio

    def forward(self, seq_len, device, dtype):
        idx = torch.arange(0, self.dim, 2, dtype=torch.float32, device=device)
        inv_freq = 1.0 / (self.base ** (idx / self.dim))
        freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
        return torch.stack([torch.cos(freqs), torch.sin(freqs)], dim=-1).to(dtype)


def apply_rotary_pos_emb(x, rope_cache):
    """Rotary on the first ``2 x rope_cache.shape[-2]`` features of each head, pairs
    interleaved; x is (batch, seq, heads, head_dim)."""
    b, sq, nh, _ = x.shape
    rot_dim = rope_cache.shape[-2] * 2
    x, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    xs = x.reshape(b, sq, nh, rot_dim // 2, 2)
    rc = rope_cache[:sq].view(1, sq, 1, rot_dim // 2, 2)
    out = torch.stack([xs[..., 0] * rc[..., 0] - xs[..., 1] * rc[..., 1],
                       xs[..., 1] * rc[..., 0] + xs[..., 0] * rc[..., 1]], -1)
    return torch.cat((out.flatten(3), x_pass), dim=-1)


class CoreAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size_per_partition = config.kv_channels * config.num_attention_heads

    def forward(self, q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        b, _, s, _ = ctx.shape
        return ctx.transpose(1, 2).reshape(b, s, self.hidden_size_per_partition)


class SelfAttention(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        self.layer_number = layer_number
        self.projection_size = config.kv_channels * config.num_attention_heads
        self.hidden_size_per_attention_head = config.kv_channels
        self.num_attention_heads_per_partition = config.num_attention_heads
        self.multi_query_attention = config.multi_query_attention
        self.qkv_hidden_size = 3 * self.projection_size
        if self.multi_query_attention:
            self.num_multi_query_groups_per_partition = config.multi_query_group_num
            self.qkv_hidden_size = (self.projection_size + 2 * config.kv_channels *
                                    config.multi_query_group_num)
        self.query_key_value = nn.Linear(config.hidden_size, self.qkv_hidden_size,
                                         bias=config.add_bias_linear or config.add_qkv_bias)
        self.core_attention = CoreAttention(config)
        self.dense = nn.Linear(self.projection_size, config.hidden_size,
                               bias=config.add_bias_linear)

    def forward(self, hidden_states, rotary_pos_emb=None):
        mixed = self.query_key_value(hidden_states)
        b, s = mixed.shape[:2]
        hn, nh = self.hidden_size_per_attention_head, self.num_attention_heads_per_partition
        if self.multi_query_attention:
            ng = self.num_multi_query_groups_per_partition
            q, k, v = mixed.split([nh * hn, ng * hn, ng * hn], dim=-1)
            q, k, v = q.view(b, s, nh, hn), k.view(b, s, ng, hn), v.view(b, s, ng, hn)
        else:
            q, k, v = mixed.view(b, s, nh, 3 * hn).chunk(3, dim=-1)
        q = apply_rotary_pos_emb(q, rotary_pos_emb)
        k = apply_rotary_pos_emb(k, rotary_pos_emb)
        if self.multi_query_attention:
            rep = nh // self.num_multi_query_groups_per_partition
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        return self.dense(self.core_attention(q, k, v))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.ffn_hidden_size * 2,
                                       bias=config.add_bias_linear)
        self.dense_4h_to_h = nn.Linear(config.ffn_hidden_size, config.hidden_size,
                                       bias=config.add_bias_linear)

    def forward(self, x):
        x0, x1 = torch.chunk(self.dense_h_to_4h(x), 2, dim=-1)
        return self.dense_4h_to_h(F.silu(x0) * x1)


class GLMBlock(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        eps = config.layernorm_epsilon
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attention = SelfAttention(config, layer_number)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = MLP(config)

    def forward(self, hidden_states, rotary_pos_emb=None):
        h = hidden_states + self.self_attention(self.input_layernorm(hidden_states),
                                                rotary_pos_emb=rotary_pos_emb)
        return h + self.mlp(self.post_attention_layernorm(h))


class GLMTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_layers = config.num_layers
        self.layers = nn.ModuleList(GLMBlock(config, i + 1) for i in range(config.num_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon)

    def forward(self, hidden_states, rotary_pos_emb=None):
        for layer in self.layers:
            hidden_states = layer(hidden_states, rotary_pos_emb=rotary_pos_emb)
        return self.final_layernorm(hidden_states)


class Embedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size)

    def forward(self, input_ids):
        return self.word_embeddings(input_ids)


class TinyGLMPreTrainedModel(PreTrainedModel):
    config_class = TinyGLMConfig
    base_model_prefix = "transformer"
    _no_split_modules = ["GLMBlock"]

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)


class TinyGLMModel(TinyGLMPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embedding = Embedding(config)
        self.rotary_pos_emb = RotaryEmbedding(config.kv_channels // 2, config.rope_ratio)
        self.encoder = GLMTransformer(config)
        self.output_layer = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.embedding.word_embeddings

    def forward(self, input_ids):
        h = self.embedding(input_ids)
        rope = self.rotary_pos_emb(input_ids.shape[1], h.device, h.dtype)
        return self.encoder(h, rotary_pos_emb=rope)


class TinyGLMForCausalLM(TinyGLMPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.transformer = TinyGLMModel(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.embedding.word_embeddings

    def get_output_embeddings(self):
        return self.transformer.output_layer

    def forward(self, input_ids=None, **kwargs):
        hidden_states = self.transformer(input_ids)
        return CausalLMOutput(logits=self.transformer.output_layer(hidden_states))
'''


def write(path, **overrides) -> pathlib.Path:
    """Write the ``tinyglm`` model directory at ``path``: config.json and its two modules."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "tinyglm", "architectures": ["TinyGLMForCausalLM"],
              "auto_map": {"AutoConfig": "configuration_tinyglm.TinyGLMConfig",
                           "AutoModelForCausalLM": "modeling_tinyglm.TinyGLMForCausalLM"},
              **CONFIG, **overrides}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "configuration_tinyglm.py").write_text(CONFIGURATION_PY)
    (path / "modeling_tinyglm.py").write_text(MODELING_PY)
    return path


def load(path):
    """The model of the directory ``path``, built on the meta device from its own code."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path, trust_remote_code=True, local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, trust_remote_code=True)


# -- the user's policy -------------------------------------------------------------------
# Globs are relative to the base model (``base_model_prefix = "transformer"``).
_LAYER = "encoder.layers.*"
_STREAM = (R("embedding.word_embeddings", "embedding_rowwise"),           # outside the regions
           R(f"{_LAYER}.input_layernorm", "norm"),
           R(f"{_LAYER}.post_attention_layernorm", "norm"),
           R("encoder.final_layernorm", "norm"),
           R("output_layer", "vocab"))
_MLP = (R(f"{_LAYER}.mlp.dense_h_to_4h", "packed_colwise", axis="mlp"),     # gate|up
        R(f"{_LAYER}.mlp.dense_4h_to_h", "rowwise", axis="mlp"))


def policy(multi_query: bool = True) -> Policy:
    """Attention and MLP tensor-parallel. ``multi_query``: the contiguous q|k|v of
    ``multi_query_attention`` (as many groups as heads), each part split
    (``packed_qkv_colwise``); else the per-head layout, split whole heads (``colwise``)."""
    attn = f"{_LAYER}.self_attention"
    # the integers the forward reshapes by hold this rank's share
    attrs = ((attn, "num_attention_heads_per_partition"),
             (f"{attn}.core_attention", "hidden_size_per_partition"))
    if multi_query:
        attrs += ((attn, "num_multi_query_groups_per_partition"),)
    return Policy(
        name="tinyglm",
        modules=_STREAM + _MLP + (
            R(f"{attn}.query_key_value", "packed_qkv_colwise" if multi_query else "colwise",
              axis="heads"),
            R(f"{attn}.dense", "rowwise", axis="heads"),
        ),
        regions=(attn, f"{_LAYER}.mlp"),
        local_attrs=attrs,
    )


POLICY = policy()
PER_HEAD = policy(multi_query=False)
# The contiguous q|k|v cut as if it were per head: the shapes fit (the plan cannot tell),
# the heads do not; only a parity run shows it.
WRONG_SPLIT = dataclasses.replace(POLICY, modules=tuple(
    R(r.glob, "colwise", axis="heads") if r.style == "packed_qkv_colwise" else r
    for r in POLICY.modules))

# Fewer K/V groups than heads: attention runs whole on every rank, the MLP is split.
MLP_ONLY = Policy(
    name="tinyglm",
    modules=_STREAM + _MLP + (R(f"{_LAYER}.self_attention.query_key_value", "replicate"),
                             R(f"{_LAYER}.self_attention.dense", "replicate")),
    regions=(f"{_LAYER}.mlp",),
)


@contextlib.contextmanager
def registered(pol: Policy = POLICY, model_type: str = "tinyglm"):
    """``pol`` registered for ``model_type`` while the block runs, removed after."""
    from meshlab.policies import _registry

    before = _registry._REGISTRY.get(model_type)
    ml.policies.register(model_type, pol)
    try:
        yield pol
    finally:
        if before is None:
            _registry._REGISTRY.pop(model_type, None)
        else:
            _registry._REGISTRY[model_type] = before


# -- parity ------------------------------------------------------------------------------
def _ids(n, g):
    return {"input_ids": torch.randint(0, V, (n, 8), generator=g)}


def _lm(out, batch):
    return ml.losses.causal_lm_loss(out, batch)


def family(path) -> F.Family:
    return F.Family({}, "AutoModelForCausalLM", _ids, _lm, make=lambda: load(path))


def use_modules_cache(cache) -> None:
    """Import remote code from ``cache`` (transformers' ``HF_MODULES_CACHE``)."""
    import transformers.dynamic_module_utils as dmu

    os.environ["HF_MODULES_CACHE"] = str(cache)
    dmu.HF_MODULES_CACHE = str(cache)


def parity(rank, world, path, cache, spec_name, pol="POLICY"):
    """``parity_case`` for the model at ``path`` under the policy named ``pol`` (a name of
    this module), registered on this rank for the case only."""
    use_modules_cache(cache)
    pol = globals()[pol]
    with registered(pol):
        return F.parity_case(rank, world, fam=family(path), spec_name=spec_name)
