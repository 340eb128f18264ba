"""Pipelines on declared blocks: a model of one's own runs its own forward on every stage.

``pipeline('pp', blocks='layers')`` names the repeated blocks: a ``ModuleList`` or
``ModuleDict`` attribute (its entries are the blocks) or a list of module names. Nothing is
traced; the model keeps torchtitan's contract:

* each stage holds its own blocks; the others are deleted from a ``ModuleDict`` and
  replaced in a ``ModuleList`` by a pass-through (``Skipped``, so indices keep their
  meaning), or set to ``None`` where a block is a plain attribute;
* the modules with parameters registered before the first block (the embeddings) are kept
  on the first stage and set to ``None`` elsewhere, those registered after the last block
  (the final norm, the head) on the last stage only (``ends``: from the module order the
  plan traced, which the plan records); modules without parameters (dropout, a rotary
  table) stay on every stage;
* the model's own ``forward`` runs on every stage and skips what is ``None``::

      def forward(self, x, attention_mask=None):
          h = self.embed(x) if self.embed is not None else x
          for block in self.layers.values():
              h = block(h, attention_mask)
          return self.head(self.norm(h)) if self.head is not None else h

A rank that runs several stages (interleaved schedules) runs each through a view of the
model (``stage_view``): the modules on the path from the root to the blocks are copied,
every block and parameter shared, and the view holds that stage's blocks and ends only.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ...core.errors import ConfigError
from ...core.names import ancestors

_CONTAINERS = ("ModuleList", "ModuleDict")


def _parent(fqn: str) -> str:
    return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def _under(fqn: str, names) -> bool:
    """Whether module or parameter ``fqn`` is one of ``names`` or lies under one."""
    return fqn in names or any(a in names for a in ancestors(fqn))


def declared_blocks(plan, blocks) -> tuple[str, ...]:
    """The block names ``pipeline(blocks=...)`` declares, checked against the traced
    modules: a container's entries in order, or the names given, in module order."""
    modules = {m.fqn: m for m in plan.model.modules}
    cls = plan.model.cls or "the model"
    lists = [f for f, m in modules.items() if m.cls in _CONTAINERS and f]
    hint = (f"its ModuleList/ModuleDict modules are {lists}" if lists else
            "it has no ModuleList or ModuleDict; hold the blocks in one")
    if isinstance(blocks, str):
        m = modules.get(blocks)
        if m is None or m.cls not in _CONTAINERS:
            what = "has no module" if m is None else f"has a {m.cls} at"
            raise ConfigError(f"pipeline(blocks={blocks!r}): {cls} {what} {blocks!r}; name a "
                              f"ModuleList or ModuleDict attribute whose entries are the "
                              f"blocks ({hint}), or give the block modules' names as a list")
        found = tuple(f for f in modules if _parent(f) == blocks)
        if not found:
            raise ConfigError(f"pipeline(blocks={blocks!r}): {cls}.{blocks} is empty; a "
                              f"pipeline splits its entries into stages")
        return found
    missing = [b for b in blocks if b not in modules]
    if missing:
        raise ConfigError(f"pipeline(blocks={list(blocks)!r}): {cls} has no module(s) "
                          f"{missing}; name modules of the model ({hint})")
    for b in blocks:
        inner = [o for o in blocks if o != b and _under(o, {b})]
        if inner:
            raise ConfigError(f"pipeline(blocks=...): {inner[0]!r} lies inside block {b!r}; "
                              f"name blocks that do not contain one another")
    order = [f for f in modules if f in set(blocks)]
    if order != list(blocks):
        raise ConfigError(f"pipeline(blocks={list(blocks)!r}): list the blocks in the "
                          f"order the model registers them ({order}); the stages follow "
                          f"that order, and what comes before and after the blocks is read "
                          f"from it")
    return tuple(blocks)


def ends(plan) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The modules the first stage alone holds (registered before the first block) and
    those the last stage alone holds (after the last): the outermost module above each
    parameter outside the blocks that is not itself above a block. A parameter that
    would belong to no one stage is refused by name: one held by a module above the blocks
    (the model itself), or one registered between two blocks."""
    blocks = plan.model.blocks
    order = [m.fqn for m in plan.model.modules]
    pos = {f: i for i, f in enumerate(order)}
    spine = {a for b in blocks for a in ("",) + ancestors(b)}
    first = pos[blocks[0]]
    last = max(i for i, f in enumerate(order) if _under(f, {blocks[-1]}))
    cls = plan.model.cls or "the model"
    before, after = {}, {}
    names = set(blocks)
    for e in plan.params:
        if _under(e.fqn, names):
            continue
        if e.module in spine:
            where = f"{cls} itself" if not e.module else f"{e.module!r}, above the blocks"
            raise ConfigError(
                f"pipeline: parameter {e.fqn!r} is held by {where}, so it would run on every "
                f"stage and no one stage can hold it; move it into a module registered "
                f"before the blocks (the first stage runs it, e.g. an nn.Embedding) or "
                f"after them (the last stage)")
        top = e.module
        while _parent(top) not in spine:
            top = _parent(top)
        if pos[top] < first:
            before[top] = pos[top]
        elif pos[top] > last:
            after[top] = pos[top]
        else:
            prev = max((b for b in blocks if pos[b] < pos[top]), key=pos.get)
            nxt = min((b for b in blocks if pos[b] > pos[top]), key=pos.get)
            raise ConfigError(
                f"pipeline: {top!r} (holding {e.fqn!r}) is registered between blocks "
                f"{prev!r} and {nxt!r}, so it is neither before the first block nor after "
                f"the last and no stage can be said to hold it; declare it a block "
                f"(pipeline(blocks=[...])) or register it before or after the blocks")
    return tuple(sorted(before, key=pos.get)), tuple(sorted(after, key=pos.get))


class Skipped(nn.Module):
    """A ``ModuleList`` entry whose block another stage runs: it hands on its first
    argument, so a loop over the list runs this stage's blocks only."""

    def forward(self, x, *args, **kwargs):
        return x


def _remove(parent: nn.Module, name: str) -> None:
    """Take block or end ``name`` out of ``parent`` as the contract says (module doc)."""
    if isinstance(parent, nn.ModuleDict):
        del parent[name]
    elif isinstance(parent, nn.ModuleList):
        parent[int(name)] = Skipped()
    else:
        setattr(parent, name, None)


def prune(model: nn.Module, blocks: tuple[str, ...], kept: set[str], before, after,
          first: bool, last: bool) -> None:
    """Drop from ``model`` the blocks this rank does not run (their parameters are
    freed), the modules before the blocks unless it runs the first stage, and those
    after unless it runs the last."""
    gone = [b for b in blocks if b not in kept]
    gone += [] if first else list(before)
    gone += [] if last else list(after)
    for fqn in gone:
        parent = model.get_submodule(_parent(fqn))
        name = fqn.rsplit(".", 1)[-1]
        if isinstance(parent, nn.ModuleDict) and name not in parent:
            continue
        if fqn in blocks:
            _remove(parent, name)
        else:
            setattr(parent, name, None)


def stage_view(model: nn.Module, blocks: tuple[str, ...], mine: tuple[str, ...], before,
               after, first: bool, last: bool) -> tuple[nn.Module, list]:
    """``model`` as stage ``mine`` runs it: the modules above the blocks and ends copied
    (their parameters, buffers and hooks shared), the blocks of other stages and the ends
    this stage does not hold taken out of the copies. Returns the view and the (copy,
    original) pairs, whose ``training`` flag the stage follows."""
    drop = set(blocks) - set(mine)
    nulls = (set() if first else set(before)) | (set() if last else set(after))
    spine = {a for f in drop | nulls for a in ("",) + ancestors(f)}
    pairs: list = []

    def view(m: nn.Module, fqn: str) -> nn.Module:
        c = copy.copy(m)
        c._modules = dict(m._modules)
        pairs.append((c, m))
        for name, child in m._modules.items():
            f = f"{fqn}.{name}" if fqn else name
            if f in drop:
                _remove(c, name)
            elif f in nulls:
                c._modules[name] = None
            elif f in spine and child is not None:
                c._modules[name] = view(child, f)
        return c

    return view(model, ""), pairs


class OwnStage(nn.Module):
    """A stage of a model with declared blocks: the model's own ``forward`` on the view
    of the model this stage holds (``stage_view``). The root's hooks are not run, as a
    stage of a Hugging Face decoder runs the model's parts without its forward."""

    def __init__(self, model: nn.Module, view: nn.Module, pairs: list, width: int,
                 failures=None):
        super().__init__()
        self.view = view         # registered: the stage's parameters are its own
        self._pairs = pairs
        self._forward = type(model).forward
        self.width = width       # the hidden states' width, for a failed stage's stand-in
        self.failures = failures   # ``_guard.StageFailures``: where an exception goes

    def forward(self, *args, **kwargs):
        """The model's forward on this stage's view; under a schedule, an exception is
        recorded and a stand-in handed on, so the other stages do not wait (``_guard``)."""
        for c, m in self._pairs:
            c.training = m.training
        if self.failures is None:
            return self._forward(self.view, *args, **kwargs)
        try:
            return self._forward(self.view, *args, **kwargs)
        except Exception as e:     # raised on every rank once the schedule is done
            from ._guard import stand_in

            self.failures.record(e)
            x = args[0]
            dtype = x.dtype if x.is_floating_point() else next(
                (p.dtype for p in self.view.parameters() if p.is_floating_point()),
                torch.get_default_dtype())
            out = stand_in(x, self.width, dtype)
            self.failures.stand_ins.add(id(out))
            return out
