"""Collective hygiene for checkpoints: which group, who is rank 0, and agreement.

Every checkpoint call is collective. A rank that fails alone (a full disk, a damaged
file only it reads) must not leave the others waiting inside a collective: each section
ends with ``agree`` over the gloo control group, after which every rank continues or
every rank raises a ``CheckpointError`` (``CheckpointPeerError`` on the ranks that did not
fail, naming the rank that did and its message).
"""

from __future__ import annotations

import errno
import os

import torch.distributed as dist

from ..core.agree import agree as _agree
from ..core.errors import PeerError, RankMismatchError
from ..train._content import replica_peers
from ..transforms._install import runtime_or_none
from ._safe import CheckpointError, CheckpointMismatchError, CheckpointPeerError


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def ctrl_group(model):
    """The model's gloo control group (None: the default group, or no group at all)."""
    rt = runtime_or_none(model)
    return getattr(rt, "ctrl_group", None) if rt is not None else None


def _agree_group(group):
    """``agree`` treats None as "no exchange"; here None means the default group."""
    if group is None and distributed():
        return dist.group.WORLD
    return group


def agree(group, what: str, fields: dict | None = None,
          error: BaseException | None = None, timeout: float | None = None,
          peers: dict | None = None) -> None:
    """``meshlab.core.agree.agree`` over ``group``, every failure a ``CheckpointError``."""
    try:
        _agree(_agree_group(group), what, fields, error, timeout=timeout, peers=peers)
    except CheckpointError:
        raise
    except PeerError as e:
        raise CheckpointPeerError(str(e)) from e
    except RankMismatchError as e:
        raise CheckpointMismatchError(str(e)) from e


def barrier(group) -> None:
    if distributed():
        dist.barrier(group=group)


def enter(what: str, path: str, model, timeout: float) -> None:
    """Every rank must call ``what`` with the same path: the first exchange is the ranks'
    agreement, so a rank still stepping while another saves makes both raise (their
    sections differ) instead of pairing unrelated collectives; a rank that never comes
    fails the others after ``timeout`` seconds. Saving a parallelized model, the ranks
    also compare their replicas' parameters (``meshlab.train._content``): a checkpoint of
    replicas that drifted apart would keep one of them and hide the divergence."""
    if not distributed():
        return
    peers = None
    if what.startswith("save") and runtime_or_none(model) is not None:
        peers = replica_peers(model)
    agree(ctrl_group(model), f"checkpoint.{what}", {"path": os.path.abspath(path)},
          timeout=timeout, peers=peers)


def as_error(e: BaseException, what: str, path: str, where: str | None = None
             ) -> CheckpointError:
    """A failure inside a checkpoint call as a ``CheckpointError`` naming the rank, the
    file (``where`` when the error names none) and the damage (``ENOSPC``: out of space);
    torch's ``CheckpointException`` (a ``BaseException``) is unpacked into the failure of
    each rank it lists."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointError):
        return e
    where = where or path
    if isinstance(e, CheckpointException):
        errors = [exc for _, (exc, _) in sorted(e.failures.items())]
        parts = [_describe(exc, r, where) for r, (exc, _) in sorted(e.failures.items())]
    else:
        errors, parts = [e], [_describe(e, rank(), where)]
    disk = any(isinstance(x, OSError) for x in errors)
    out = CheckpointError(f"{what} {path} failed: " + "; ".join(parts) + _fix(what, disk))
    out.__cause__ = e
    return out


def _describe(exc: BaseException, r: int, where: str) -> str:
    if isinstance(exc, CheckpointError):
        return f"rank {r}: {exc}"
    if isinstance(exc, OSError):
        where = exc.filename or where
        if exc.errno == errno.ENOSPC:
            return f"rank {r} ran out of space writing {where} (ENOSPC: {exc.strerror})"
        return f"rank {r} could not access {where} ({exc.strerror or exc})"
    return f"rank {r}: {type(exc).__name__}: {exc}"


def _fix(what: str, disk: bool = True) -> str:
    if "save" not in what:
        return ("; the checkpoint cannot be read as it is: load an older one "
                "(meshlab.checkpoint.latest lists the valid ones)")
    done = ("; nothing was committed (the previous checkpoint, if any, is unchanged and "
            "what this save wrote was removed). ")
    if disk:
        return done + "Free space or save elsewhere, then retry"
    # not the disk: torch's checkpoint writer refused what it was given (a layout its
    # planner cannot express, as GPT-2's fused c_attn split by heads)
    return done + ("This is not a disk fault: the writer refused the tensors as they are "
                   "laid out. meshlab.checkpoint.save_pretrained writes whole tensors and "
                   "takes such a layout")
