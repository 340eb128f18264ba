"""GPT-2: Conv1D projections (weights stored (in, out)) and a fused q|k|v ``c_attn``."""

from ..core.spec import P
from ._policy import ModuleRule as R, Policy
from ._registry import register

GPT2 = register("gpt2", Policy(
    name="gpt2",
    modules=(
        R("wte", "embedding_rowwise"),
        R("h.*.ln_1", "norm"), R("h.*.ln_2", "norm"), R("ln_f", "norm"),
        R("h.*.attn.c_attn", "conv1d_packed_colwise", axis="heads"),   # q|k|v, each split
        R("h.*.attn.c_proj", "conv1d_rowwise", axis="heads"),
        R("h.*.mlp.c_fc", "conv1d_colwise", axis="mlp"),
        R("h.*.mlp.c_proj", "conv1d_rowwise", axis="mlp"),
        R("/lm_head", "vocab"),                                         # tied to wte
    ),
    activations=(("h.*", P("batch", "seq", "embed")),),
    regions=("h.*.attn", "h.*.mlp"),
    sequence_parallel=("h.*.ln_1", "h.*.ln_2"),
    # GPT2Attention splits c_attn's output by split_size: it must be the local width.
    local_attrs=(("h.*.attn", "split_size"), ("h.*.attn", "num_heads"), ("h.*.attn", "embed_dim")),
    optional=("/lm_head",),
))
