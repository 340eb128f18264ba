"""What each room contributes to the estimates, as values: the rows of the memory table
(``MemRow``), of the activation table (``ActRow``) and of the communication table
(``CommOp``), and the few functions of a plan that build them before any estimator runs.

The rows live beside the plan, below the rooms and the estimators, so a room's hooks
(``Transform.memory``, ``comm``, ``activation_memory``) return them without importing the
estimators that add them up (``meshlab.estimate``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

from ..core.names import owner
from ..core.placement import local_shape
from ..core.units import dtype_bytes

# Optimizer states kept per parameter, by the names ``plan.memory(optimizer=)`` takes.
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "sgd_momentum": 1}


class _kept:
    """A property of an immutable row computed when first read and kept in the row's
    ``__dict__``, where later reads find it (the estimates sum a row's bytes several
    times: memory, the optimizer's traffic, a pipeline's heaviest rank)."""

    def __init__(self, fn) -> None:
        self.fn, self.name, self.__doc__ = fn, fn.__name__, fn.__doc__

    def __get__(self, row, cls=None):
        if row is None:
            return self
        value = row.__dict__[self.name] = self.fn(row)
        return value


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

    @_kept
    def bytes(self) -> int:
        # whole bytes: a 4-bit tensor of an odd size still takes its last byte
        return math.ceil(math.prod(self.shape) * dtype_bytes(self.dtype))


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


class SharedRows:
    """The answers ``room_rows`` gives inside one ``shared_rows()`` block."""

    def __init__(self) -> None:
        # (id(plan), n_states, id(until)) -> (plan, until, rows); the plan and ``until``
        # are kept so that their ids stay theirs while the block runs.
        self.rows: dict = {}
        self.alike: dict = {}          # id(plan) -> (plan, the plan it reads the rows of)

    def same(self, plan, like) -> None:
        """``plan`` answers with the rows and gradient reductions of ``like``
        (``room_rows``, ``alike``): for a ``plan`` that is ``like`` with rooms added that
        keep every room's rows and reductions as they are (``remat``, which changes what
        the step saves, not what a rank keeps between steps or how it reduces them)."""
        self.alike[id(plan)] = (plan, like)


_SHARED: contextvars.ContextVar[SharedRows | None] = contextvars.ContextVar(
    "meshlab_room_rows", default=None)


@contextlib.contextmanager
def shared_rows():
    """Inside the block, ``room_rows`` computes the rows of a plan object once and answers
    the same plan again from that first answer (``plan.memory`` and ``plan.time`` both
    read them: ``advise`` asks both of each layout). A plan is an immutable value, so its
    rows cannot change while the block runs; the answers are dropped when it ends.
    Yields the ``SharedRows``, whose ``same`` says which plans have another's rows."""
    shared = SharedRows()
    token = _SHARED.set(shared)
    try:
        yield shared
    finally:
        _SHARED.reset(token)


def alike(plan):
    """The plan whose rows and gradient reductions ``plan`` has (``SharedRows.same``):
    inside ``shared_rows()`` the one it was declared the same as, else ``plan``."""
    shared = _SHARED.get()
    got = shared.alike.get(id(plan)) if shared is not None else None
    return got[1] if got is not None and got[0] is plan else plan


def room_rows(plan, n_states: int = 2, *, until=None) -> list[MemRow]:
    """The rows after every room's ``memory`` (or those before room ``until``); inside
    ``shared_rows()``, computed once per plan object."""
    shared = _SHARED.get()
    if shared is None:
        return _room_rows(plan, n_states, until)
    plan = alike(plan)
    key = (id(plan), n_states, id(until))
    hit = shared.rows.get(key)
    if hit is None or hit[0] is not plan or hit[1] is not until:
        hit = shared.rows[key] = (plan, until, tuple(_room_rows(plan, n_states, until)))
    return list(hit[2])


def _room_rows(plan, n_states: int, until) -> list[MemRow]:
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
    out = []
    for e, block, before in _places(plan):
        if block is not None:
            if block in mine:
                out.append(e)
            continue
        if (blocks[0] in mine) if before else (blocks[-1] in mine):
            out.append(e)
    return out


_PLACES: list = []      # (params, model, places): ``_places`` of the last few tables


def _places(plan) -> list:
    """``(entry, the block it lies under or None, whether its module comes before the
    first block)`` for each parameter, read-only: a function of the parameter table and
    the model alone (both immutable), kept for the last few (layouts share bound tables)."""
    for params, model, got in _PLACES:
        if params is plan.params and model is plan.model:
            return got
    blocks = plan.model.blocks
    order = {m.fqn: i for i, m in reversed(list(enumerate(plan.model.modules)))}
    first = order.get(blocks[0], 0)
    names = set(blocks)
    got = [(e, owner(e.fqn, names), e.module in order and order[e.module] < first)
           for e in plan.params]
    _PLACES.insert(0, (plan.params, plan.model, got))
    del _PLACES[4:]
    return got
