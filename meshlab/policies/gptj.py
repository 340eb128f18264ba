"""GPT-J: separate q/k/v projections, attention and MLP in parallel on one ``ln_1``.

Its config's ``base_model_tp_plan`` names the projections, but the shared decoder
defaults it is translated with name Llama's modules (``layers.*``), so the translation
marks no tensor-parallel region here and leaves ``ln_1``/``ln_f`` out; this policy says
them. The forward reshapes by ``head_dim`` with ``-1`` heads, so no attribute changes
under TP; the untied ``lm_head`` has a bias, split with the vocabulary.
"""

from ..core.spec import P
from ._policy import ModuleRule as R, Policy
from ._registry import register

GPTJ = register("gptj", Policy(
    name="gptj",
    modules=(
        R("wte", "embedding_rowwise"),
        R("h.*.ln_1", "norm"), R("ln_f", "norm"),
        R("h.*.attn.q_proj", "colwise", axis="heads"),
        R("h.*.attn.k_proj", "colwise", axis="heads"),
        R("h.*.attn.v_proj", "colwise", axis="heads"),
        R("h.*.attn.out_proj", "rowwise", axis="heads"),
        R("h.*.mlp.fc_in", "colwise", axis="mlp"),
        R("h.*.mlp.fc_out", "rowwise", axis="mlp"),
        R("/lm_head", "vocab"),
    ),
    activations=(("h.*", P("batch", "seq", "embed")),),
    # both regions read ln_1's output: under SP each gathers the sequence it needs
    regions=("h.*.attn", "h.*.mlp"),
    sequence_parallel=("h.*.ln_1",),
    optional=("/lm_head",),
))
