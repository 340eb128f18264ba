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

from .errors import PlanError, SpecError
from .spec import P


def _pattern(glob: str) -> re.Pattern:
    """The compiled pattern of ``glob``; a glob that is not a string, or whose character
    class is no class (``[z-a]``), raises ``SpecError`` naming it."""
    if not isinstance(glob, str):
        raise SpecError(f"glob {glob!r}: spec keys are FQN globs, strings such as "
                        f"'layers.*.mlp.up_proj.weight'; got {type(glob).__name__}")
    return _glob_regex(glob)


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
    try:
        return re.compile(r"\A" + "".join(out) + r"\Z")
    except re.error as e:
        raise SpecError(f"glob {glob!r} is not a valid pattern ({e}); write character classes "
                        f"as in fnmatch, low to high: '[0-9]', '[!a-c]'") from None


_WILD = re.compile(r"[*?\[]")        # what makes a glob more than a literal name


def glob_match(glob: str, fqn: str) -> bool:
    """Whether ``fqn`` matches ``glob`` (``*``: one segment, ``**``: any number)."""
    return bool(_pattern(glob).match(fqn))


def is_spec_leaf(x: Any) -> bool:
    return isinstance(x, P) or x is None


def tree_to_globs(tree: Any) -> dict[str, P]:
    """A pytree of specs (nested dicts/lists, ``P`` leaves) -> ``{fqn: P}``."""
    try:
        paths, leaves, _ = optree.tree_flatten_with_path(tree, is_leaf=is_spec_leaf,
                                                         none_is_leaf=True)
    except (TypeError, ValueError) as e:
        raise SpecError(f"spec tree: {e}; a spec tree is nested dicts with string keys "
                        f"(lists for ModuleLists) and P(...) leaves, as specs_like(model) "
                        f"builds") from None
    out = {}
    for path, leaf in zip(paths, leaves):
        fqn = ".".join(str(k) for k in path)
        if leaf is None:
            leaf = P()
        if not isinstance(leaf, P):
            raise SpecError(f"spec tree leaf at {fqn!r} is {leaf!r}; leaves must be P(...) or None")
        out[fqn] = leaf
    return out


def check_param_spec(glob: str, spec: P, what: str = "specs") -> None:
    """A parameter's spec: ``glob`` a valid glob, ``spec`` a ``P`` without ``partial``
    (a parameter is a whole value; pending sums are what computation leaves in
    activations)."""
    if not isinstance(glob, str) or _WILD.search(glob):   # a literal name is a valid glob
        _pattern(glob)
    if not isinstance(spec, P):
        raise SpecError(f"{what}: {glob!r} maps to {spec!r}; parameter specs are P(...) or "
                        f"None")
    if spec.partial:
        raise SpecError(
            f"{what}: {glob!r} -> {spec!r} declares a pending sum over {spec.partial}, but a "
            f"parameter is a whole value (partial= describes activations, e.g. in "
            f"constrain); drop partial= from the parameter spec")


def normalize_specs(specs: Any) -> dict[str, P]:
    """Either spelling -> an ordered ``{glob_or_fqn: P}``; every glob and spec checked
    (``check_param_spec``)."""
    if isinstance(specs, Mapping) and all(isinstance(v, P) or v is None for v in specs.values()):
        out = {k: (v if v is not None else P()) for k, v in specs.items()}
    elif isinstance(specs, (Mapping, list, tuple)):
        out = tree_to_globs(specs)
    else:
        out = None
    if out is not None:
        for k, v in out.items():
            check_param_spec(k, v, "shard specs")
        return out
    raise SpecError(
        f"specs must be a dict of FQN globs -> P, or a pytree of P mirroring the model; "
        f"got {type(specs).__name__}"
    )


def match_specs(globs: Mapping[str, P], fqns: Iterable[str], *, what: str = "specs") -> dict[str, tuple[str, P]]:
    """``{fqn: (glob, P)}`` by first-match; raises for a glob that matches nothing."""
    if not isinstance(globs, Mapping):
        raise SpecError(f"{what}: specs must be a dict of FQN globs -> P, got "
                        f"{type(globs).__name__}")
    for glob, spec in globs.items():
        check_param_spec(glob, spec, what)
    fqns = list(fqns)
    present = set(fqns)
    hits: dict[str, tuple[str, P]] = {}
    used = set()
    for glob, spec in globs.items():
        if not _WILD.search(glob):      # no wildcard: the glob matches its own name alone
            if glob in present:
                used.add(glob)
                hits.setdefault(glob, (glob, spec))
            continue
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
    if not isinstance(model, nn.Module):
        raise SpecError(f"specs_like({model!r}): give the nn.Module whose parameters the "
                        f"tree mirrors")
    if not isinstance(fill, P):
        raise SpecError(f"specs_like(fill={fill!r}): fill must be a P(...), e.g. P()")

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
