"""Fused ops registered as ``torch.library`` custom ops under the ``meshlab::`` namespace.

One op per file, each with a pure-PyTorch reference beside it. Kernels live in ``csrc/``
(C++, CPU) and ``_triton.py`` (CUDA); they are built the first time an op runs on such a
tensor, never at import. Where no kernel can run, an op runs its reference and
``meshlab check`` says why.

On CUDA the kernels are Triton rather than hand-written CUDA: every op here is memory-bound
(a handful of flops per byte), so what matters is one read of each input, one write of each
output and wide coalesced accesses, which Triton's block programs give with a fraction of
the code, no nvcc at install time, and tuning by block size alone. Attention is the
exception: it is compute-bound, and on CUDA it runs cuDNN's or flash-attn's kernels
(``attention.py`` says when which).

Layouts: every op accepts strided inputs (Hugging Face's transposed queries and keys, a
chunk of a packed projection, an expanded cos/sin table) and returns fresh contiguous
outputs, whichever path runs (C++, Triton, the PyTorch fallback); each fake kernel returns
contiguous tensors of the same shapes and dtypes, forward and backward ops alike. Under
``torch.compile`` the generated code asserts exactly these strides, so a fake that followed
an input's strides (``empty_like``) while the kernel wrote contiguous memory would fail on
the first transposed input.

``paged_attention`` (attention over a paged KV cache, ``meshlab.inference``'s) is for
decoding only: it has no backward and is not in ``OPS``.

>>> import torch, meshlab.ops as ops
>>> sorted(ops.OPS)
['attention', 'geglu', 'layer_norm', 'linear_cross_entropy', 'rms_norm', 'rotary', 'swiglu']
"""

from .rms_norm import rms_norm as rms_norm, rms_norm_reference as rms_norm_reference
from .rotary import (rotary as rotary, apply_rotary as apply_rotary,
                     rotary_reference as rotary_reference)
from .swiglu import (swiglu as swiglu, swiglu_mlp as swiglu_mlp,
                     swiglu_reference as swiglu_reference, geglu as geglu,
                     geglu_mlp as geglu_mlp, geglu_reference as geglu_reference)
from .layer_norm import layer_norm as layer_norm, layer_norm_reference as layer_norm_reference
from .linear_cross_entropy import (linear_cross_entropy as linear_cross_entropy,
                                   linear_cross_entropy_reference as
                                   linear_cross_entropy_reference)
from .attention import attention as attention, attention_reference as attention_reference
from ._attention_hf import hf_attention as hf_attention, register_hf as register_hf
from .paged_attention import paged_attention as paged_attention
from .cpu_adam import CPUAdamW as CPUAdamW
from .fused_adamw import FusedAdamW as FusedAdamW

# Public op name -> (fused function, pure-PyTorch reference).
OPS = {
    "rms_norm": (rms_norm, rms_norm_reference),
    "rotary": (rotary, rotary_reference),
    "swiglu": (swiglu, swiglu_reference),
    "geglu": (geglu, geglu_reference),
    "layer_norm": (layer_norm, layer_norm_reference),
    "linear_cross_entropy": (linear_cross_entropy, linear_cross_entropy_reference),
    "attention": (attention, attention_reference),
}
