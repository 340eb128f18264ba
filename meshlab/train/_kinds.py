"""Which optimizers meshlab may hand pieces of parameters, and which it steps whole.

``ELEMENTWISE``: optimizers that update each element from its own gradient and state, so
ZeRO-1 may give them flat slices (``register_elementwise`` declares another). Others get
whole tensors, each parameter stepped by the data rank that owns it
(``transforms/zero/_owned.py``). ``WHOLE_ON_DTENSORS``: optimizers DTensor cannot compute,
stepped on whole plain tensors (``_whole.py``). ``meshlab.train.optimizer`` reads these
and re-exports the public names.
"""

from __future__ import annotations

import torch

from ..core.errors import ConfigError
from ..core.tensors import local as _local


# Optimizers whose update of each element reads that element's gradient and state only, so
# they step a flat slice of a parameter exactly as they step the whole of it (ZeRO-1's fp32
# slices). Those that reduce over a tensor (Adafactor's factored moments, LAMB's and LARS's
# trust ratios, Muon's and Shampoo's whole-matrix preconditioners) would compute those
# reductions over each slice instead: ZeRO-1 gives them whole tensors, each parameter
# stepped by one data rank that owns it (``transforms/zero/_owned.py``), never slices.
ELEMENTWISE: list[type] = [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW,
                           torch.optim.Adamax, torch.optim.Adagrad, torch.optim.Adadelta,
                           torch.optim.RMSprop, torch.optim.Rprop, torch.optim.NAdam,
                           torch.optim.RAdam, torch.optim.ASGD]


def _meshlab_elementwise() -> list[type]:
    from ..ops.cpu_adam import CPUAdamW
    from ..ops.fused_adamw import FusedAdamW
    from ..transforms.offload._hybrid import HybridAdamW

    return [FusedAdamW, CPUAdamW, HybridAdamW]


def register_elementwise(cls: type) -> type:
    """Declare that optimizer ``cls`` updates every element from that element's gradient
    and state alone, so ZeRO-1 may hand it flat slices of parameters (cheaper than the
    whole tensors, each on one owner, that any other optimizer gets); returns ``cls``
    (usable as a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"register_elementwise({cls!r}): give a torch.optim.Optimizer class")
    if cls not in ELEMENTWISE:
        ELEMENTWISE.append(cls)
    return cls


def elementwise(cls: type) -> bool:
    """Whether ``cls`` (or a class it derives from) is known to update elementwise."""
    return any(issubclass(cls, e) for e in ELEMENTWISE + _meshlab_elementwise())


def _refuse_on_slices(cls: type, owner) -> None:
    """A part hands the optimizer tensors of its own (ZeRO-1): an optimizer that is not
    known to update elementwise asked it for whole parameters (``whole=True``); refuse it,
    by name, where a tensor still stands for several parameters or a piece of one."""
    if elementwise(cls):
        return
    if all(len(b.params) == 1 and _local(t).numel() == _local(b.params[0]).numel()
           for b, t in owner.stepped()):
        return
    raise ConfigError(
        f"optimizer {cls.__name__} under {type(owner).__name__.removesuffix('Part')}: this "
        f"room steps flat slices of the parameters, and {cls.__name__} is not known to "
        f"update elementwise (factored moments, trust ratios or whole-matrix "
        f"preconditioners would be computed over each slice, not the tensor: the weights "
        f"would silently differ from one process). Use an elementwise optimizer (SGD, "
        f"Adam, AdamW, Adagrad, RMSprop, ...), or, if {cls.__name__} does update each "
        f"element alone, declare it with "
        f"meshlab.train.optimizer.register_elementwise({cls.__name__})")


# Optimizers whose update DTensor cannot compute on DTensor parameters (tensor parallelism,
# ZeRO-3): refused by name before any step, where torch would stop inside the update.
# (None today: the one there was, Adafactor, steps whole tensors, ``WHOLE_ON_DTENSORS``.)
_NOT_ON_DTENSORS: dict[type, str] = {}

# Optimizers stepped on whole plain tensors where they would get DTensors (``_whole``):
# each DTensor's owner gathers it, steps it with the optimizer's own code and broadcasts
# it back. torch's Adafactor squares a pending row norm in place (aten.pow_), which DTensor
# refuses.
WHOLE_ON_DTENSORS: list[type] = [torch.optim.Adafactor]


def _refuse_on_dtensors(cls: type, tensors) -> None:
    from torch.distributed.tensor import DTensor

    why = next((w for c, w in _NOT_ON_DTENSORS.items() if issubclass(cls, c)), None)
    if why is not None and any(isinstance(t, DTensor) for t in tensors):
        raise ConfigError(f"optimizer {cls.__name__} on DTensor parameters (tensor parallelism "
                          f"or zero_shard(3)): {why}. Use an elementwise optimizer (AdamW, "
                          f"...) or torch.optim.Muon, shown to train these layouts as one "
                          f"process, or lay the model out with data parallelism alone")


def _whole_on_dtensors(cls: type, tensors) -> bool:
    from torch.distributed.tensor import DTensor

    return any(issubclass(cls, c) for c in WHOLE_ON_DTENSORS) and \
        any(isinstance(t, DTensor) for t in tensors)
