"""Meshes: ``Mesh`` (named axes over a ``DeviceMesh``) and ``AbstractMesh`` (for planning).

A ``Mesh`` spans the processes that a launcher (``torchrun``, ``meshlab run``, a test
harness) started: gloo on CPU, NCCL on CUDA. An ``AbstractMesh`` (``Mesh(..., fake=True)``)
is a shape and nothing else: it plans a 16,384-rank job in one process without devices or
process groups, and ``parallelize`` refuses it by its type.

>>> mesh = Mesh(pp=8, dp=16, tp=8, fake=True)
>>> mesh.size, mesh['tp'].size
(1024, 8)
>>> mesh.flatten('pp', 'dp')
Mesh(pp_dp=128, tp=8, fake=True)
"""

from __future__ import annotations

import atexit
import math
import os
from typing import Iterator, Mapping

import numpy as np
import torch

from .errors import MeshError
from . import context as _context


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _init_process_group(device_type: str, needed: int, desc: str) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    env = os.environ
    # A group meshlab starts, meshlab also ends: leaving it to interpreter teardown can
    # abort the process ("terminate called without an active exception") once work is done.
    atexit.register(_shutdown)
    if "RANK" in env and "WORLD_SIZE" in env:
        # CUDA jobs also get gloo for CPU tensors (loss scalars, overflow flags, checkpoint
        # agreement), so nothing has to be copied to the GPU just to be reduced.
        backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(int(env.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend=backend)
        return
    if needed == 1:
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        return
    raise MeshError(
        f"{desc} needs {needed} processes, but torch.distributed is not initialized and no "
        f"launcher set RANK/WORLD_SIZE. Start the script with "
        f"`meshlab run --nproc-per-node {needed} script.py` (or torchrun), or pass "
        f"fake=True to plan without processes."
    )


def _shutdown() -> None:
    """End the group meshlab started: wait (bounded) until every rank is done, so no rank
    closes its connections while a peer still uses them, then destroy it."""
    import datetime

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    except RuntimeError:
        pass  # a rank already failed or left: nothing to wait for
    dist.destroy_process_group()


MAX_RANKS = 2 ** 31
"""The most ranks a mesh may have: ``torch.distributed`` numbers ranks with 32-bit ints."""


def _checked_axes(axes, sizes: Mapping) -> tuple[tuple[str, int], ...]:
    """The ``(name, size)`` pairs of ``Mesh(axes, **sizes)``, each checked: identifier
    names, distinct, integer sizes >= 1, at most ``MAX_RANKS`` ranks in all."""
    if axes is not None and not isinstance(axes, Mapping):
        raise MeshError(f"Mesh({axes!r}): the positional argument must be a dict of axis name "
                        f"-> size, e.g. Mesh({{'dp': 2, 'tp': 2}}), or use Mesh(dp=2, tp=2)")
    items = list((axes or {}).items()) + list(sizes.items())
    if not items:
        raise MeshError("a Mesh needs at least one axis, e.g. Mesh(dp=4) or Mesh(dp=2, tp=2)")
    for n, s in items:
        if not isinstance(n, str) or not n.isidentifier():
            raise MeshError(f"mesh axis names must be identifiers such as 'dp', got {n!r}")
        if not isinstance(s, (int, np.integer)) or isinstance(s, bool) or s < 1:
            raise MeshError(f"mesh axis {n!r} has size {s!r}; sizes must be integers >= 1, "
                            f"e.g. {n}=2")
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise MeshError(f"mesh axis names must be distinct, got {names}; give each axis once")
    size = math.prod(int(s) for _, s in items)
    if size > MAX_RANKS:
        raise MeshError(
            f"Mesh({', '.join(f'{n}={s}' for n, s in items)}) has {size:,} ranks, more than "
            f"the {MAX_RANKS:,} torch.distributed can number (32-bit ranks); use smaller axes")
    return tuple((n, int(s)) for n, s in items)


class MeshBase:
    """What every mesh is: named axes, major first, with their sizes and the layout of
    ranks over them; sub-meshes, flattening, the ``with mesh:`` context and value
    semantics. Two kinds share it, as in JAX: ``Mesh`` (over launched processes) and
    ``AbstractMesh`` (a shape for planning, which nothing can run on)."""

    __slots__ = ("_axes", "_device_type", "_device_mesh", "_ranks")
    fake: bool = False

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __copy__(self) -> "MeshBase":
        return self

    def __deepcopy__(self, memo: dict) -> "MeshBase":
        """A mesh is an immutable value over this process's groups: a copy of a model
        that holds one (``copy.deepcopy`` of a parallelized model) shares it."""
        return self

    # -- description -------------------------------------------------------------------
    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self._axes)

    @property
    def shape(self) -> dict[str, int]:
        """Axis name -> size, in mesh order."""
        return dict(self._axes)

    @property
    def shape_tuple(self) -> tuple[int, ...]:
        return tuple(s for _, s in self._axes)

    @property
    def size(self) -> int:
        return math.prod(self.shape_tuple)

    @property
    def ndim(self) -> int:
        return len(self._axes)

    @property
    def device_type(self) -> str:
        return self._device_type

    def axis_size(self, name: str) -> int:
        for n, s in self._axes:
            if n == name:
                return s
        raise MeshError(f"{self!r} has no axis {name!r}; its axes are {self.axis_names}")

    @property
    def ranks(self) -> np.ndarray:
        """Global rank of every mesh position, shaped like the mesh."""
        if self._ranks is None:
            return np.arange(self.size).reshape(self.shape_tuple)
        return self._ranks

    def coordinate(self, rank: int) -> dict[str, int]:
        """The position of global ``rank`` on each axis."""
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
            raise MeshError(f"{self!r}.coordinate({rank!r}): a rank is an integer from 0 to "
                            f"{self.size - 1}")
        if self._ranks is None:          # row-major: computed, not searched
            if not 0 <= rank < self.size:
                raise MeshError(f"rank {rank} is not part of {self!r} (ranks 0 to "
                                f"{self.size - 1})")
            where = np.unravel_index(int(rank), self.shape_tuple)
            return dict(zip(self.axis_names, (int(i) for i in where)))
        where = np.argwhere(self._ranks == rank)
        if len(where) == 0:
            raise MeshError(f"rank {rank} is not part of {self!r}")
        return dict(zip(self.axis_names, (int(i) for i in where[0])))

    def _block(self, index: tuple) -> np.ndarray:
        """``self.ranks[index]`` (integers and full slices), without building every rank
        of a row-major mesh."""
        if self._ranks is not None:
            return self._ranks[index]
        strides = [math.prod(self.shape_tuple[d + 1:]) for d in range(self.ndim)]
        offset = sum(i * st for i, st in zip(index, strides) if not isinstance(i, slice))
        grids = np.ix_(*[np.arange(s) * st for i, s, st in
                         zip(index, self.shape_tuple, strides) if isinstance(i, slice)])
        return np.asarray(offset + sum(grids, np.int64(0)))

    def _like(self, axes: dict, ranks, device_mesh) -> "MeshBase":
        """A mesh of this kind over ``axes`` (a sub-mesh or a flattened one)."""
        raise NotImplementedError

    # -- slicing -----------------------------------------------------------------------
    def __getitem__(self, names) -> "MeshBase":
        """``mesh['tp']`` (one axis), ``mesh['dp', 'tp']`` (a sub-mesh over those axes)."""
        if not isinstance(names, (str, tuple, list)):
            raise MeshError(f"{self!r}[{names!r}]: index a mesh by axis names, e.g. "
                            f"mesh[{self.axis_names[0]!r}] or mesh[{self.axis_names!r}]")
        names = (names,) if isinstance(names, str) else tuple(names)
        return self.sub(*names)

    def sub(self, *names: str) -> "MeshBase":
        """The sub-mesh over ``names`` that contains this rank (rank 0 when abstract)."""
        for n in names:
            self.axis_size(n)
        if len(set(names)) != len(names):
            raise MeshError(f"sub-mesh axes must be distinct, got {names}")
        dims = [self.axis_names.index(n) for n in names]
        coord = self.coordinate(self.rank)
        index = tuple(slice(None) if n in names else coord[n] for n in self.axis_names)
        ranks = self._block(index)
        # keep the requested axis order
        order = sorted(range(len(names)), key=lambda i: dims[i])
        ranks = np.transpose(ranks, [order.index(i) for i in range(len(names))])
        dm = None if self._device_mesh is None else \
            self._device_mesh[names if len(names) > 1 else names[0]]
        return self._like({n: self.axis_size(n) for n in names}, ranks, dm)

    def flatten(self, *names: str, name: str | None = None) -> "MeshBase":
        """This mesh with adjacent axes ``names`` merged into one (default name ``a_b``)."""
        if len(names) < 2:
            raise MeshError(f"flatten needs at least two axes, got {names}")
        if name is not None and not (isinstance(name, str) and name.isidentifier()):
            raise MeshError(f"flatten(..., name={name!r}): the new axis name must be an "
                            f"identifier such as 'dp_fsdp'")
        idx = [self.axis_names.index(n) if n in self.axis_names else None for n in names]
        if None in idx:
            missing = [n for n, i in zip(names, idx) if i is None]
            raise MeshError(f"{self!r} has no axis {missing[0]!r}; its axes are {self.axis_names}")
        if idx != list(range(idx[0], idx[0] + len(idx))):
            raise MeshError(
                f"flatten({', '.join(map(repr, names))}): the axes must be adjacent and in mesh "
                f"order {self.axis_names}; build the Mesh with them next to each other"
            )
        new = name or "_".join(names)
        if new in self.axis_names and new not in names:
            raise MeshError(f"flatten({', '.join(map(repr, names))}): the new axis name {new!r} is "
                            f"already an axis of {self!r}; pass another name=")
        axes: dict[str, int] = {}
        for n, s in self._axes:
            if n in names:
                axes[new] = axes.get(new, 1) * s
            else:
                axes[n] = s
        # Merging adjacent axes keeps a row-major layout row-major.
        ranks = None if self._ranks is None else self._ranks.reshape([axes[n] for n in axes])
        dm = None
        if self._device_mesh is not None:
            dm_flat = self._device_mesh[names]._flatten(new)
            keep = [n for n in axes]
            root = dm_flat._get_root_mesh() if hasattr(dm_flat, "_get_root_mesh") else None
            dm = root[tuple(keep)] if root is not None and len(keep) > 1 else dm_flat
        return self._like(axes, ranks, dm)

    # -- context -----------------------------------------------------------------------
    def __enter__(self) -> "MeshBase":
        cm = _context.use_mesh(self)
        cm.__enter__()
        _STACK.append(cm)
        return self

    def __exit__(self, *exc) -> None:
        _STACK.pop().__exit__(*exc)

    # -- value semantics ---------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        return (type(other) is type(self) and self._axes == other._axes and (
            self._ranks is None and other._ranks is None
            or np.array_equal(self.ranks, other.ranks)))

    def __hash__(self) -> int:
        return hash((self._axes, self.fake))

    def __iter__(self) -> Iterator[str]:
        return iter(self.axis_names)

    def __repr__(self) -> str:
        body = ", ".join(f"{n}={s}" for n, s in self._axes)
        return f"Mesh({body}, fake=True)" if self.fake else f"Mesh({body})"


class AbstractMesh(MeshBase):
    """A mesh that is a shape and nothing else (JAX's ``AbstractMesh``): it plans a
    16,384-rank job in one process, without devices or process groups, and nothing can be
    materialized on it. ``Mesh(..., fake=True)`` builds one; its repr pastes back as that.

    >>> m = AbstractMesh(dp=2, tp=2)
    >>> m == Mesh(dp=2, tp=2, fake=True), isinstance(m, Mesh), m.rank
    (True, False, 0)
    """

    __slots__ = ()
    fake = True

    def __init__(self, axes: Mapping[str, int] | None = None, /, *,
                 device_type: str | None = None, _ranks=None, **sizes: int) -> None:
        items = _checked_axes(axes, sizes)
        _check_device_type(device_type)
        set_ = object.__setattr__
        set_(self, "_axes", items)
        set_(self, "_device_type", device_type or "meta")
        # None: the row-major layout, computed when asked for (a mesh of 2**30 ranks
        # would otherwise allocate 8 GiB of rank numbers to plan nothing with them).
        set_(self, "_ranks", _ranks)
        set_(self, "_device_mesh", None)

    @property
    def rank(self) -> int:
        """Rank 0: a planning mesh is seen from its first rank."""
        return 0

    @property
    def device_mesh(self):
        raise MeshError(
            f"{self!r} is abstract (planning only) and has no DeviceMesh; build a real Mesh "
            f"inside launched processes to run on it"
        )

    def _like(self, axes: dict, ranks, device_mesh) -> "AbstractMesh":
        return AbstractMesh(axes, device_type=self._device_type, _ranks=ranks)


class Mesh(MeshBase):
    """Named mesh axes, major first, over the ranks a launcher started (gloo on CPU, NCCL
    on CUDA). ``Mesh(..., fake=True)`` returns an ``AbstractMesh`` (planning only)."""

    __slots__ = ()

    def __new__(cls, axes: Mapping[str, int] | None = None, /, *, fake: bool = False,
                device_type: str | None = None, _device_mesh=None, _ranks=None,
                **sizes: int):
        if not isinstance(fake, bool):
            raise MeshError(f"Mesh(fake={fake!r}): fake must be True (plan only) or False "
                            f"(over launched processes)")
        if fake:
            return AbstractMesh(axes, device_type=device_type, _ranks=_ranks, **sizes)
        return super().__new__(cls)

    def __init__(self, axes: Mapping[str, int] | None = None, /, *, fake: bool = False,
                 device_type: str | None = None, _device_mesh=None, _ranks=None,
                 **sizes: int) -> None:
        items = _checked_axes(axes, sizes)
        _check_device_type(device_type)
        set_ = object.__setattr__
        set_(self, "_axes", items)
        set_(self, "_device_type", device_type or _default_device_type())
        set_(self, "_ranks", _ranks)
        if _device_mesh is None:
            import torch.distributed as dist
            from torch.distributed.device_mesh import init_device_mesh

            size = math.prod(s for _, s in items)
            _init_process_group(self._device_type, size, repr(self))
            world = dist.get_world_size()
            if world != size:
                raise MeshError(
                    f"{self!r} has {' x '.join(str(s) for _, s in items)} = {size} ranks, but "
                    f"{world} processes were started; start {size} processes or change the "
                    f"axis sizes so that their product is {world}"
                )
            _device_mesh = init_device_mesh(self._device_type, self.shape_tuple,
                                            mesh_dim_names=self.axis_names)
        set_(self, "_device_mesh", _device_mesh)

    @property
    def device_mesh(self):
        """The ``torch.distributed.DeviceMesh`` behind this mesh."""
        return self._device_mesh

    @property
    def rank(self) -> int:
        """This process's global rank."""
        import torch.distributed as dist

        return dist.get_rank()

    def _like(self, axes: dict, ranks, device_mesh) -> "Mesh":
        return Mesh(axes, device_type=self._device_type, _device_mesh=device_mesh,
                    _ranks=ranks)

    @classmethod
    def parse(cls, text: str, *, fake: bool = True) -> MeshBase:
        """``Mesh.parse('pp=8,dp=16,tp=8')`` (the CLI's ``--mesh`` syntax)."""
        if not isinstance(text, str):
            raise MeshError(f"Mesh.parse({text!r}): give the mesh as text, e.g. 'dp=16,tp=8'")
        axes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, eq, size = part.partition("=")
            size, name = size.strip(), name.strip()
            if not eq or not (size.isascii() and size.isdigit()):
                raise MeshError(f"--mesh {text!r}: expected name=size pairs such as 'dp=16,tp=8'")
            if name in axes:
                raise MeshError(f"--mesh {text!r}: axis {name!r} is given twice")
            axes[name] = int(size)
        return cls(axes, fake=fake)


def _check_device_type(device_type) -> None:
    if device_type is not None and not (isinstance(device_type, str) and device_type):
        raise MeshError(f"Mesh(device_type={device_type!r}): give a device type such as "
                        f"'cpu' or 'cuda', or None for the default")


_STACK: list = []
