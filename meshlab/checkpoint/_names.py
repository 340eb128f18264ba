"""How the names of a file's tensors meet a model's: directly, or through peft's renaming.

peft's LoRA wraps each target layer: its weight becomes ``<module>.base_layer.weight``
beside the adapters ``<module>.lora_A.<adapter>.weight`` and ``lora_B``; a module to save
becomes ``<module>.original_module.*`` beside its trained copy
``<module>.modules_to_save.<adapter>.*``; and a ``PeftModel``'s own state prefixes every
name with ``base_model.model.``. A base model's checkpoint names those tensors as the
model had them before peft. ``align`` meets the two namings as Colossal-AI's
``booster.load_model`` of a LoRA model does (its ``PeftUnwrapMixin``): the file's
``q_proj.weight`` loads into ``q_proj.base_layer.weight``, and a module to save loads
into both of its copies (peft starts the trained copy as a copy of the original).

A file that holds no adapter at all is a base model's state by intent: the adapters keep
their values (LoRA's B starts at zero, so the model computes its base). Any other name
the file lacks is missing, and ``check`` refuses what no intent explains: a load that
matches none of the model's base weights, and a missing name the file holds under another
prefix.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable

from ._safe import CheckpointNamingError

PEFT_PREFIX = "base_model.model."
_ADAPTERS = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.")
_COPY = re.compile(r"\.modules_to_save\.[^.]+\.")


def is_adapter(name: str) -> bool:
    """Whether ``name`` is a tensor peft added (an adapter, or a module to save's trained
    copy) rather than one of the base model's."""
    return bool(_ADAPTERS.search(name) or _COPY.search(name))


def base_name(name: str) -> str:
    """The name a base tensor had before peft wrapped its module."""
    n = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
    n = n.replace(".base_layer.", ".").replace(".original_module.", ".")
    return _COPY.sub(".", n)


@dataclasses.dataclass
class Alignment:
    """Which file name each model tensor loads from, and what matched nothing."""

    source: dict[str, str]          # model name -> file name
    missing: list[str]              # model names the file lacks (and needs)
    used: set[str]                  # file names some model tensor loads from (or aliases)
    base_matched: int               # the model's base tensors that found a name
    base_total: int

    def unexpected(self, file_names: Iterable[str]) -> list[str]:
        """The file's names this model loads nothing from (on this rank)."""
        return sorted(n for n in file_names if n not in self.used)


def align(model_names: Iterable[str], file_names: Iterable[str],
          aliases: Iterable[str] = ()) -> Alignment:
    """Meet ``model_names`` with ``file_names``: the same name, else the same name without
    peft's ``base_model.model.`` prefix, else the one file name with the same base name
    (``base_name``). ``aliases`` are other names of the model's tensors (tied weights):
    a file that holds them holds nothing unexpected."""
    model_names = list(model_names)
    files = set(file_names)
    plain = {(n[len(PEFT_PREFIX):] if n.startswith(PEFT_PREFIX) else n): n for n in files}
    by_base: dict[str, list[str]] = {}
    for n in sorted(files):
        if not is_adapter(n):
            by_base.setdefault(base_name(n), []).append(n)
    source: dict[str, str] = {}
    for m in model_names:
        bare = m[len(PEFT_PREFIX):] if m.startswith(PEFT_PREFIX) else m
        if m in files:
            source[m] = m
        elif bare in plain:
            source[m] = plain[bare]
        elif _ADAPTERS.search(m) is None and len(by_base.get(base_name(m), ())) == 1:
            source[m] = by_base[base_name(m)][0]
    base_only = not any(is_adapter(n) for n in files)
    missing = [m for m in model_names if m not in source
               and not (base_only and is_adapter(m))]
    base = [m for m in model_names if not is_adapter(m)]
    used = set(source.values()) | (files & (set(aliases) | set(model_names)))
    return Alignment(source, missing, used, sum(m in source for m in base), len(base))


def check(al: Alignment, unexpected: list[str], where: str) -> None:
    """Refuse what no partial state by intent explains: a load that matched none of the
    model's base weights, and a missing name the file holds under another prefix
    (``unexpected``: the file's names no rank loads)."""
    missing = [m for m in al.missing if not is_adapter(m)]
    if al.base_total and not al.base_matched:
        names = (f"the model names e.g. {missing[0]!r}, the file {unexpected[0]!r}"
                 if missing and unexpected else "the file holds no weights of this model")
        raise CheckpointNamingError(
            f"{where}: none of the model's {al.base_total} weights is named as in the file "
            f"({names}){_prefix_hint(missing, unexpected)}; load it into a model named as "
            f"the file is, or export it again from this model")
    pairs = [(m, u) for m in missing for u in unexpected
             if u.endswith("." + m) or m.endswith("." + u)]
    if pairs:
        m, u = pairs[0]
        raise CheckpointNamingError(
            f"{where}: {len(pairs)} of the model's weights are in the file under other names "
            f"(the model's {m!r} is the file's {u!r}){_prefix_hint(missing, unexpected)}; "
            f"a partial load would leave them as they are. Load it into a model named as "
            f"the file is, or export it again from this model")


def _prefix_hint(missing: list[str], unexpected: list[str]) -> str:
    """', the file's names carry the prefix ...' where one explains a pair of names."""
    for m in missing:
        for u in unexpected:
            if u.endswith("." + m):
                return f", the file's names carry the prefix {u[:-len(m)]!r}"
            if m.endswith("." + u):
                return f", the model's names carry the prefix {m[:-len(u)]!r}"
    return ""
