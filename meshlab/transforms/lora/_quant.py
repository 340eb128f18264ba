"""QLoRA's base: the model's Linear layers held in 4 bits by bitsandbytes, frozen.

``Quantize`` is the value (``lora(config, quantize=Quantize())``): the 4-bit type
(``'nf4'`` or ``'fp4'``), whether the per-block scales are quantized again (double
quantization), the dtype the base's products are computed in, the block size, and the
modules kept in full precision. Which Linear layers it quantizes is decided in the plan
step (``quantized_modules``): every ``nn.Linear`` but the output head (the module
``get_output_embeddings`` returns, kept in full precision for numerical stability, as
Colossal-AI and transformers keep ``lm_head``), a Linear whose weight is tied to another
tensor, the modules ``modules_to_save`` trains, and those ``skip_modules`` names (which
replaces the head as the list of modules kept when given). The plan records each
quantized weight with dtype ``'nf4'``/``'fp4'`` (half a byte an element), frozen and
tagged ``keep_whole`` (no room may split or cast its packed bytes); its scales are rows of
their own in ``plan.memory()`` (``scale_rows``).

The install step (``quantize_model``) runs once the weights hold their values (after the
seeded initialization, a ``state_dict``, or ``sync_module_states``' broadcast), before
peft's adapters are injected: each chosen Linear becomes a ``bitsandbytes.nn.Linear4bit``
whose weight is quantized from the Linear's values on the mesh's device, so peft wraps it
with its own ``Linear4bit`` adapter layer, as it does for a model loaded in 4 bits. The
layer never takes bitsandbytes' CPU inference layout (which an eval-mode forward would
put in place of the quantized bytes, its scales in bfloat16): an evaluation leaves the
base as it was quantized.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ...core.errors import ConfigError, check_bool, check_int
from ...planning.plan import KEEP_WHOLE as KEEP_WHOLE
_TYPES = ("nf4", "fp4")
_COMPUTE = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16",
            "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}


def bnb_module():
    """bitsandbytes, the ``qlora`` extra, found when first needed."""
    try:
        import bitsandbytes
    except ImportError:
        raise ConfigError("lora(quantize=...) needs bitsandbytes: pip install "
                          "'meshlab[qlora]' (or pip install bitsandbytes)") from None
    return bitsandbytes


@dataclasses.dataclass(frozen=True)
class Quantize:
    """A 4-bit base for LoRA (QLoRA), as bitsandbytes stores it.

    ``quant_type`` is the 4-bit type (``'nf4'``, normal float, or ``'fp4'``);
    ``double_quant`` quantizes the per-block scales again (8-bit scales, a float32 scale
    per 256 of them); ``compute_dtype`` is the dtype the base's products run in
    (``'bfloat16'``, ``'float16'`` or ``'float32'``); ``blocksize`` the elements that share
    one scale; ``skip_modules`` the module names kept in full precision (a name matches a
    module whose path ends in it), None for the output head. The defaults are
    Colossal-AI's ``Booster.enable_lora(quantize=True)``: nf4, double quantization,
    bfloat16 products, blocks of 64.

    >>> Quantize(compute_dtype="float32")
    Quantize(quant_type='nf4', double_quant=True, compute_dtype='float32', blocksize=64, skip_modules=None)
    """

    quant_type: str = "nf4"
    double_quant: bool = True
    compute_dtype: str = "bfloat16"
    blocksize: int = 64
    skip_modules: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.quant_type not in _TYPES:
            raise ConfigError(f"Quantize(quant_type={self.quant_type!r}): one of {_TYPES} "
                              f"(bitsandbytes' 4-bit types); pass quant_type='nf4'")
        check_bool(self.double_quant, "Quantize", "double_quant")
        dt = self.compute_dtype
        if isinstance(dt, torch.dtype):
            dt = str(dt).replace("torch.", "")
        if not isinstance(dt, str) or dt not in _COMPUTE:
            raise ConfigError(f"Quantize(compute_dtype={self.compute_dtype!r}): the dtype the "
                              f"base's products run in, 'bfloat16', 'float16' or 'float32'")
        object.__setattr__(self, "compute_dtype", _COMPUTE[dt])
        check_int(self.blocksize, "Quantize", "blocksize", example=64)
        if self.blocksize not in (32, 64, 128, 256, 512, 1024, 2048, 4096):
            raise ConfigError(f"Quantize(blocksize={self.blocksize!r}): a power of two from "
                              f"32 to 4096 (bitsandbytes' block sizes); pass blocksize=64")
        skip = self.skip_modules
        if skip is not None:
            if isinstance(skip, str) or not all(isinstance(m, str) and m for m in skip):
                raise ConfigError(f"Quantize(skip_modules={skip!r}): a list of module names "
                                  f"kept in full precision, e.g. ['lm_head'], or None for "
                                  f"the output head")
            object.__setattr__(self, "skip_modules", tuple(skip))

    def to_json(self) -> dict:
        return {"quant_type": self.quant_type, "double_quant": self.double_quant,
                "compute_dtype": self.compute_dtype, "blocksize": self.blocksize,
                "skip_modules": None if self.skip_modules is None else list(self.skip_modules)}

    @classmethod
    def from_json(cls, d: dict) -> "Quantize":
        return cls(d["quant_type"], d["double_quant"], d["compute_dtype"], d["blocksize"],
                   None if d["skip_modules"] is None else tuple(d["skip_modules"]))


def quantization(value) -> Quantize | None:
    """``lora(quantize=...)``'s argument as a ``Quantize``: None or False (no quantization),
    True (the defaults), a ``Quantize``, or a configuration with bitsandbytes' field names
    (transformers' ``BitsAndBytesConfig``, Colossal-AI's ``BnbQuantizationConfig``)."""
    if value is None or value is False:
        return None
    if value is True:
        return Quantize()
    if isinstance(value, Quantize):
        return value
    if not hasattr(value, "load_in_4bit"):
        raise ConfigError(f"lora(quantize={value!r}): True, a meshlab Quantize(...), or a "
                          f"bitsandbytes configuration (transformers.BitsAndBytesConfig("
                          f"load_in_4bit=True, ...))")
    name = type(value).__name__
    if getattr(value, "load_in_8bit", False):
        raise ConfigError(f"lora(quantize={name}(load_in_8bit=True)): 8-bit bases are not "
                          f"implemented; pass load_in_4bit=True (QLoRA's 4-bit base)")
    if not value.load_in_4bit:
        raise ConfigError(f"lora(quantize={name}(load_in_4bit=False)): meshlab quantizes "
                          f"bases to 4 bits only; pass load_in_4bit=True, or quantize=None "
                          f"for a full-precision base")
    if getattr(value, "keep_in_fp32_modules", None):
        raise ConfigError(f"lora(quantize={name}(keep_in_fp32_modules=...)): modules are kept "
                          f"in the dtype the model was built in; name them in skip_modules "
                          f"instead")
    skip = getattr(value, "skip_modules", None)
    if skip is None:
        skip = getattr(value, "llm_int8_skip_modules", None)
    compute = getattr(value, "bnb_4bit_compute_dtype", None) or torch.float32
    if isinstance(compute, str):
        compute = _COMPUTE.get(compute, compute)
    quant_type = getattr(value, "bnb_4bit_quant_type", "fp4")
    if isinstance(quant_type, str):
        quant_type = quant_type.lower()
    return Quantize(quant_type=quant_type,
                    double_quant=bool(getattr(value, "bnb_4bit_use_double_quant", False)),
                    compute_dtype=compute,
                    skip_modules=None if skip is None else tuple(skip))


def _matches(fqn: str, name: str) -> bool:
    return fqn == name or fqn.endswith("." + name)


def quantized_modules(q: Quantize, plan, saved) -> tuple[str, ...]:
    """The Linear modules ``q`` quantizes in the traced ``plan`` (before peft's rewrite; the
    module doc says which). ``saved`` are the modules ``modules_to_save`` trains."""
    tied = {e.module for e in plan.params if e.tied_to is not None}
    tied |= {plan[e.tied_to].module for e in plan.params if e.tied_to is not None}
    keep = q.skip_modules if q.skip_modules is not None else \
        ((plan.model.head,) if plan.model.head else ())
    out = []
    for m in plan.model.modules:
        if m.cls in ("Linear4bit", "Linear8bitLt"):
            raise ConfigError(f"lora(quantize=...): {m.fqn} is already a bitsandbytes "
                              f"{m.cls}; give the model in full precision (lora quantizes it "
                              f"once its weights are loaded), or leave quantize out")
        if m.kind != "linear" or m.cls != "Linear" or not m.fqn:
            continue
        if m.fqn in tied or any(_matches(m.fqn, k) for k in keep) or any(
                m.fqn == s or m.fqn.startswith(s + ".") for s in saved):
            continue
        out.append(m.fqn)
    if not out:
        raise ConfigError(f"lora(quantize=...): {plan.model.cls} has no nn.Linear to quantize "
                          f"(GPT-2's Conv1D layers are not Linear); train LoRA on its "
                          f"full-precision base instead (quantize=None)")
    return tuple(out)


def scale_rows(q: Quantize, fqn: str, numel: int) -> list:
    """The memory rows of one quantized weight's scales (bitsandbytes' quant state): one
    per block of ``blocksize`` elements, float32, or with double quantization 8-bit plus a
    float32 scale per 256 of those and their offset. The code tables (the 4-bit type's 16
    values, the 8-bit map of the second quantization) are shared and not counted."""
    from ...planning.rows import MemRow

    blocks = math.ceil(numel / q.blocksize)
    if not q.double_quant:
        return [MemRow(fqn, "params", "float32", (blocks,))]
    return [MemRow(fqn, "params", "uint8", (blocks,)),
            MemRow(fqn, "params", "float32", (math.ceil(blocks / 256) + 1,))]


def quantize_model(q: Quantize, model: torch.nn.Module, names, device) -> None:
    """Replace each Linear of ``names`` in ``model`` with a frozen ``bnb.nn.Linear4bit``
    whose weight is the Linear's, quantized on ``device`` (the module doc)."""
    bnb = bnb_module()
    mods = dict(model.named_modules())
    compute = getattr(torch, q.compute_dtype)
    for fqn in names:
        lin = mods[fqn]
        parent_name, _, attr = fqn.rpartition(".")
        parent = mods[parent_name]
        with torch.device("meta"):
            new = bnb.nn.Linear4bit(lin.in_features, lin.out_features, lin.bias is not None,
                                    compute_dtype=compute, compress_statistics=q.double_quant,
                                    quant_type=q.quant_type)
        weight = bnb.nn.Params4bit(lin.weight.detach().clone(), requires_grad=False,
                                   blocksize=q.blocksize, compress_statistics=q.double_quant,
                                   quant_type=q.quant_type, module=new)
        new.weight = weight.to(device)        # bitsandbytes quantizes as it moves the data
        if lin.bias is not None:
            new.bias = torch.nn.Parameter(lin.bias.detach().to(device), requires_grad=False)
        # bitsandbytes repacks a weight in place on its first eval-mode forward without
        # gradients on a CPU with AVX512-BF16, its scales rounded to bfloat16: the frozen
        # base would change with an evaluation. It keeps the layout it was quantized in.
        new.support_avx512bf16_for_cpu = False
        new.train(lin.training)
        setattr(parent, attr, new)
    # transformers' mark of a model loaded in 4 bits: peft reads it to wrap each Linear4bit
    # in its own 4-bit adapter layer (without it, its plain Linear layer)
    model.is_loaded_in_4bit = True
