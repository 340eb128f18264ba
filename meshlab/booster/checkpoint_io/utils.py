"""Colossal-AI's ``colossalai.checkpoint_io.utils`` helpers a training script calls."""

from __future__ import annotations

import torch

from ...core.errors import ConfigError


def create_pinned_state_dict(state_dict, empty: bool = True, num_threads: int = 1):
    """The same nested state (dicts, lists, tuples) with every tensor replaced by one in
    pinned host memory: its copy, or with ``empty`` a buffer of its shape and dtype (what
    ``move_and_save`` copies into). Values that are not tensors are kept as they are.
    ``num_threads`` copies that many tensors at once. Pinned memory needs an accelerator:
    without one the call is refused by name."""
    import optree

    from ...core.errors import check_int

    check_int(num_threads, "create_pinned_state_dict", "num_threads", low=1, example=4)
    if not torch.accelerator.is_available():
        raise ConfigError("create_pinned_state_dict: pinned host memory needs an accelerator "
                          "(torch.accelerator.is_available() is False here); on this machine "
                          "keep the state dict as it is (host tensors) and save it with "
                          "meshlab.booster.utils.safetensors.save")

    def pin(v):
        if not torch.is_tensor(v):
            return v
        out = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
        return out if empty else out.copy_(v.detach())

    leaves, spec = optree.tree_flatten(state_dict, none_is_leaf=True)
    if num_threads > 1:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(num_threads) as pool:
            leaves = list(pool.map(pin, leaves))
    else:
        leaves = [pin(v) for v in leaves]
    return optree.tree_unflatten(spec, leaves)
