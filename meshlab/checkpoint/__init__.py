"""Checkpoints: sharded DCP save/load (atomic, checksummed, async, reshardable) and Hugging
Face safetensors export/import.

>>> from meshlab import checkpoint
>>> checkpoint.save('ckpt/step-100', model, opt, extra={'step': 100})   # doctest: +SKIP
>>> extra, report = checkpoint.load(checkpoint.latest('ckpt'), model, opt)  # doctest: +SKIP

Every failure is a ``CheckpointError`` on every rank (``CheckpointPeerError`` on the ranks
that did not fail themselves), naming the rank, the file and the damage. A load checks
everything before it writes anything: every file's checksum (the marker's and an export's
manifest checksum themselves too), the names (met through peft's:
``CheckpointNamingError`` where none match), shapes, the optimizer's groups and the
scheduler's and data position's state.
"""

from ._safe import (CheckpointError as CheckpointError,
                    CheckpointPeerError as CheckpointPeerError,
                    CheckpointMismatchError as CheckpointMismatchError,
                    CheckpointNamingError as CheckpointNamingError,
                    CheckpointStepError as CheckpointStepError,
                    AdapterConfigError as AdapterConfigError)
from ._dcp import (save as save, load as load, latest as latest, wait as wait,
                   is_complete as is_complete, LoadReport as LoadReport)
from ._hf import save_pretrained as save_pretrained, load_pretrained as load_pretrained


# -- argument checks where the arguments enter --------------------------------------------
def _check_args(call: str, args: dict) -> None:
    """The types of ``save``'s and ``load``'s arguments, refused by name before any rank
    touches a file or a collective (every rank passes the same kinds of values)."""
    import os

    from torch import nn

    from ..core.errors import ConfigTypeError, check_bool, check_int, check_number

    path = args.get("path")
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ConfigTypeError(f"{call}(path={path!r}): path is the checkpoint's directory, a "
                              f"non-empty str or os.PathLike, e.g. 'ckpt/step-100'")
    if not isinstance(args.get("model"), nn.Module):
        raise ConfigTypeError(f"{call}: model must be the nn.Module (parallelized or not), got "
                              f"{type(args.get('model')).__name__}")
    for name in ("optimizer", "scheduler", "dataloader"):
        v = args.get(name)
        if v is not None and not (callable(getattr(v, "state_dict", None))
                                  and callable(getattr(v, "load_state_dict", None))):
            raise ConfigTypeError(f"{call}({name}=...): {type(v).__name__} has no state_dict/"
                                  f"load_state_dict; pass the {name} itself, or None")
    if args.get("extra") is not None and not isinstance(args["extra"], dict):
        raise ConfigTypeError(f"{call}(extra={args['extra']!r}): extra is a dict of JSON "
                              f"values, e.g. extra={{'step': 100}}")
    for name in ("overwrite", "async_save", "strict", "trust_pickles", "restore_rng",
                 "weights"):
        if name in args:
            check_bool(args[name], call, name)
    if args.get("keep_last") is not None:
        check_int(args["keep_last"], call, "keep_last", example=3)
    if "timeout" in args:
        check_number(args["timeout"], call, "timeout", example=300.0)


def _checked(fn):
    """``fn`` with ``_check_args`` run on its arguments first; signature and docs kept."""
    import functools
    import inspect

    from ..core.errors import ConfigTypeError

    sig = inspect.signature(fn)
    call_name = f"checkpoint.{fn.__name__}"

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise ConfigTypeError(f"{call_name}: {e}") from None
        bound.apply_defaults()
        _check_args(call_name, dict(bound.arguments))
        return fn(*args, **kwargs)

    return checked


save = _checked(save)
load = _checked(load)
