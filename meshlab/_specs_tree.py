"""Model-wide specs in two spellings: FQN globs, or a pytree mirroring the module tree.

Globs match one FQN segment per ``*`` (``layers.*.mlp.up_proj.weight``) and any number
of segments per ``**`` (``**.bias``). The first glob that matches a parameter wins, so
write specific globs before general ones. A glob that matches no parameter raises.

The pytree spelling is what JAX users write for a tree of arrays: nested dicts (and
lists for ``ModuleList``s) whose leaves are ``P``; ``specs_like(model)`` builds one to
fill in.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Iterable, Mapping

import optree
from torch import nn

from ._errors import PlanError, SpecError
from ._spec import P


@functools.lru_cache(maxsize=4096)
def _glob_regex(glob: str) -> re.Pattern:
    # Built by hand (not fnmatch.translate, whose output differs across Python versions):
    # '*' and '?' never cross a '.', and '**' spans any number of whole segments (zero too).
    out = []
    segs = glob.split(".")
    for i, seg in enumerate(segs):
        last = i == len(segs) - 1
        if seg == "**":
            out.append(r"(?:[^.]+(?:\.[^.]+)*)?" if last else r"(?:[^.]+\.)*")
            continue
        pat, j = "", 0
        while j < len(seg):
            c = seg[j]
            close = seg.find("]", j + 2) if c == "[" else -1
            if c == "*":
                pat += "[^.]*"
            elif c == "?":
                pat += "[^.]"
            elif close > 0:  # a character class, as in fnmatch: [01], [!a-z]
                body = seg[j + 1:close]
                body = "^" + body[1:] if body.startswith("!") else body
                pat += "[" + body.replace("\\", "\\\\") + "]"
                j = close
            else:
                pat += re.escape(c)
            j += 1
        out.append(pat if last else pat + r"\.")
    return re.compile(r"\A" + "".join(out) + r"\Z")


def glob_match(glob: str, fqn: str) -> bool:
    """Whether ``fqn`` matches ``glob`` (``*``: one segment, ``**``: any number)."""
    return bool(_glob_regex(glob).match(fqn))


def is_spec_leaf(x: Any) -> bool:
    return isinstance(x, P) or x is None


def tree_to_globs(tree: Any) -> dict[str, P]:
    """A pytree of specs (nested dicts/lists, ``P`` leaves) -> ``{fqn: P}``."""
    paths, leaves, _ = optree.tree_flatten_with_path(tree, is_leaf=is_spec_leaf, none_is_leaf=True)
    out = {}
    for path, leaf in zip(paths, leaves):
        fqn = ".".join(str(k) for k in path)
        if leaf is None:
            leaf = P()
        if not isinstance(leaf, P):
            raise SpecError(f"spec tree leaf at {fqn!r} is {leaf!r}; leaves must be P(...) or None")
        out[fqn] = leaf
    return out


def normalize_specs(specs: Any) -> dict[str, P]:
    """Either spelling -> an ordered ``{glob_or_fqn: P}``."""
    if isinstance(specs, Mapping) and all(isinstance(v, P) or v is None for v in specs.values()):
        return {k: (v if v is not None else P()) for k, v in specs.items()}
    if isinstance(specs, (Mapping, list, tuple)):
        return tree_to_globs(specs)
    raise SpecError(
        f"specs must be a dict of FQN globs -> P, or a pytree of P mirroring the model; "
        f"got {type(specs).__name__}"
    )


def match_specs(globs: Mapping[str, P], fqns: Iterable[str], *, what: str = "specs") -> dict[str, tuple[str, P]]:
    """``{fqn: (glob, P)}`` by first-match; raises for a glob that matches nothing."""
    fqns = list(fqns)
    hits: dict[str, tuple[str, P]] = {}
    used = set()
    for glob, spec in globs.items():
        for f in fqns:
            if glob_match(glob, f):
                used.add(glob)
                hits.setdefault(f, (glob, spec))
    unused = [g for g in globs if g not in used]
    if unused:
        close = [f for f in fqns if any(s in f for s in unused[0].replace("*", ".").split(".") if s)][:3]
        raise PlanError(
            f"{what}: glob {unused[0]!r} matches no parameter of the model"
            + (f" (similar: {close})" if close else "")
            + "; fix the name (see plan.fqns) or remove it"
        )
    return hits


def specs_like(model: nn.Module, fill: P = P()) -> Any:
    """A pytree mirroring ``model``'s parameters (dicts; lists for ModuleLists), every
    leaf ``fill``: a template to edit and pass to ``shard``."""

    def build(mod: nn.Module):
        node: dict | list
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and all(
                k.isdigit() for k, _ in mod.named_children()):
            return [build(c) for c in mod.children()]
        node = {n: fill for n, _ in mod.named_parameters(recurse=False)}
        for n, c in mod.named_children():
            sub = build(c)
            if sub:
                node[n] = sub
        return node

    return build(model)
