"""Forward hooks that cut the sequence before the blocks and join it after them.

Shared by Megatron sequence parallelism (inside ``shard``), Ulysses and ring attention:
the first block receives the whole sequence and splits it; later blocks receive it
already split but still get whole-sequence rotary tables, which are split for each; the
last block's output is gathered so the final norm and head see the whole sequence.
"""

from __future__ import annotations

from typing import Callable

import torch


def hidden_arg(args, kwargs):
    """Where a block's hidden states came in: ``('args', x)`` or ``('kw', x)``."""
    if args:
        return "args", args[0]
    if "hidden_states" in kwargs:
        return "kw", kwargs["hidden_states"]
    raise TypeError("sequence split: the module got no positional input and no "
                    "'hidden_states' keyword")


def with_hidden(args, kwargs, where, new):
    if where == "args":
        return (new,) + tuple(args[1:]), kwargs
    kwargs = dict(kwargs)
    kwargs["hidden_states"] = new
    return args, kwargs


def split_before(split: Callable[[torch.Tensor], torch.Tensor], *, tables: bool = False):
    """A pre-hook splitting the hidden states (and, with ``tables``, the rotary tables)."""
    def hook(_m, args, kwargs):
        where, x = hidden_arg(args, kwargs)
        args, kwargs = with_hidden(args, kwargs, where, split(x))
        return args, _split_tables(kwargs, split) if tables else kwargs

    return hook


def split_tables_only(split: Callable[[torch.Tensor], torch.Tensor]):
    """A pre-hook for the later blocks: only the rotary tables are still whole."""
    def hook(_m, args, kwargs):
        if kwargs.get("position_embeddings") is None:
            return None
        return args, _split_tables(kwargs, split)

    return hook


def _split_tables(kwargs, split):
    pe = kwargs.get("position_embeddings")
    if pe is None:
        return kwargs
    kwargs = dict(kwargs)
    kwargs["position_embeddings"] = tuple(split(t) for t in pe)
    return kwargs


def gather_after(gather: Callable[[torch.Tensor], torch.Tensor], name: str):
    """A forward hook joining the last block's output (a tensor, or a tuple starting
    with one)."""
    def hook(_m, _args, out):
        if isinstance(out, torch.Tensor):
            return gather(out)
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            return (gather(out[0]),) + tuple(out[1:])
        raise TypeError(f"sequence parallel: {name} returned {type(out).__name__}; expected "
                        f"a tensor or a tuple starting with one")

    return hook


def install_split(model, blocks: tuple[str, ...], split, gather,
                  held: frozenset | None = None) -> None:
    """Split before ``blocks[0]`` (tables before every block), gather after the last; of
    the blocks this rank runs (``held``: a pipeline stage's; default all). A stage after
    the first receives the sequence already split, one before the last hands it on
    split."""
    held = frozenset(blocks) if held is None else held
    mods = dict(model.named_modules())
    if blocks[0] in held:
        # first of the block's pre-hooks: beside Megatron sequence parallelism (shard's own
        # split over tp, registered earlier) this axis cuts the sequence first and tp cuts
        # each part, so gathering over tp (a region's entry) gives back this axis's part,
        # whose positions the tables split here hold; the gathers after the last block run
        # in the other order (tp's, registered first, then this one)
        mods[blocks[0]].register_forward_pre_hook(split_before(split, tables=True),
                                                  with_kwargs=True, prepend=True)
    for b in blocks[1:]:
        if b in held:
            mods[b].register_forward_pre_hook(split_tables_only(split), with_kwargs=True)
    if blocks[-1] in held:
        mods[blocks[-1]].register_forward_hook(gather_after(gather, blocks[-1]))

