"""What each room contributes to the estimates, as values: the rows of the memory table
(``MemRow``), of the activation table (``ActRow``) and of the communication table
(``CommOp``), and the few functions of a plan that build them before any estimator runs.

The rows live beside the plan, below the rooms and the estimators, so a room's hooks
(``Transform.memory``, ``comm``, ``activation_memory``) return them without importing the
estimators that add them up (``meshlab.estimate``).
"""

from __future__ import annotations

import dataclasses
import math

from ..core.names import owner
from ..core.placement import local_shape
from ..core.units import dtype_bytes

# Optimizer states kept per parameter, by the names ``plan.memory(optimizer=)`` takes.
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}


@dataclasses.dataclass(frozen=True)
class MemRow:
    """One tensor one rank keeps between steps: ``category`` (``params``, ``grads``,
    ``optimizer`` or one a transform adds), dtype, per-rank shape, and ``where`` it
    lives (``device``, or ``host`` memory under ``offload``)."""

    fqn: str
    category: str
    dtype: str
    shape: tuple[int, ...]
    where: str = "device"            # or "host": kept in host memory (offload)

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * dtype_bytes(self.dtype)


@dataclasses.dataclass(frozen=True)
class ActRow:
    """``copies`` of a storage of ``bytes`` (after the rooms' splits) one rank holds."""

    module: str
    op: str
    dtype: str
    shape: tuple[int, ...]
    bytes: float
    copies: float = 1.0
    in_block: bool = False
    grad: str = ""
    users: tuple[str, ...] = ()
    note: str = ""
    role: str = ""          # "block_input" / "block_output" where the profile says so

    @property
    def total(self) -> float:
        return self.bytes * self.copies

    def split(self, n: float, why: str = "") -> "ActRow":
        return dataclasses.replace(self, bytes=self.bytes / n,
                                   note=(self.note + " " + why).strip())


@dataclasses.dataclass(frozen=True)
class CommOp:
    """``count`` collectives of ``kind`` over mesh axis ``axis`` per step, ``bytes`` in all."""

    kind: str
    axis: str | None
    count: int
    bytes: int


def base_rows(plan, n_states: int) -> list[MemRow]:
    """The rows of a plan run by no transform (see the module docstring)."""
    sizes = plan.mesh_shape
    rows: list[MemRow] = []
    for e in plan.params:
        if e.tied_to is not None:
            continue
        ls = tuple(local_shape(e.shape, e.mesh_spec, sizes))
        rows.append(MemRow(e.fqn, "params", e.dtype, ls))
        if e.requires_grad:
            rows.append(MemRow(e.fqn, "grads", e.dtype, ls))
            rows += [MemRow(e.fqn, "optimizer", e.dtype, ls)] * n_states
    return rows


def room_rows(plan, n_states: int = 2, *, until=None) -> list[MemRow]:
    """The rows after every room's ``memory`` (or those before room ``until``)."""
    rows = base_rows(plan, n_states)
    for t in plan.rooms:
        if t is until:
            break
        rows = list(t.memory(plan, rows))
    return rows


def rank_params(plan, coord=None) -> list:
    """The parameter entries the rank at ``coord`` holds: those of its blocks
    (``plan.local_blocks``), those before the first block on the rank that runs it, those
    after the last on the rank that runs that one (every entry without a pipeline)."""
    blocks = plan.model.blocks
    mine = set(plan.local_blocks(coord))
    if not blocks or len(mine) == len(blocks):
        return list(plan.params)
    order = {m.fqn: i for i, m in reversed(list(enumerate(plan.model.modules)))}
    first = order.get(blocks[0], 0)
    names = set(blocks)
    out = []
    for e in plan.params:
        block = owner(e.fqn, names)
        if block is not None:
            if block in mine:
                out.append(e)
            continue
        before = e.module in order and order[e.module] < first
        if (blocks[0] in mine) if before else (blocks[-1] in mine):
            out.append(e)
    return out
