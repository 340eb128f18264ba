"""visualize: which rank holds which block of a tensor, and short type strings."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

import torch

from .errors import SpecError
from .mesh import Mesh
from .placement import check_spec, dim_block
from .spec import P

_DTYPE_SHORT = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "bool",
}


def dtype_short(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, str):         # a type torch has no dtype for ('nf4')
        return dtype
    return _DTYPE_SHORT.get(dtype, str(dtype).replace("torch.", ""))


def type_string(shape: Sequence[int], dtype: torch.dtype | str, spec: P) -> str:
    """``f32[8@dp,4@tp]``: the JAX sharding-in-types spelling of a sharded value."""
    dims = []
    for d, n in enumerate(shape):
        axes = spec.dim_axes(d)
        if not axes:
            dims.append(str(n))
        elif len(axes) == 1:
            dims.append(f"{n}@{axes[0]}")
        else:
            dims.append(f"{n}@({','.join(axes)})")
    s = f"{dtype_short(dtype)}[{','.join(dims)}]"
    if spec.partial:
        op = "" if spec.partial_op == "sum" else f".{spec.partial_op}"
        s += "{P" + op + ":" + ",".join(spec.partial) + "}"
    return s


def typeof(x) -> str:
    """Type string of a DTensor (or a plain tensor, which is unsharded)."""
    from torch.distributed.tensor import DTensor

    from .distribute import spec_of

    if isinstance(x, DTensor):
        return type_string(x.shape, x.dtype, spec_of(x))
    return type_string(x.shape, x.dtype, P())


@dataclasses.dataclass(frozen=True)
class ShardingView:
    """The blocks of one sharded tensor: block (per-dim (offset, length)) -> ranks."""

    shape: tuple[int, ...]
    spec: P
    mesh_shape: tuple[tuple[str, int], ...]
    blocks: dict  # tuple[tuple[int, int], ...] -> tuple[int, ...]
    type_str: str

    def rank_block(self, rank: int) -> tuple[tuple[int, int], ...]:
        for blk, ranks in self.blocks.items():
            if rank in ranks:
                return blk
        raise KeyError(rank)

    def __rich__(self):
        from rich.table import Table

        title = self.type_str
        caption = f"on Mesh({', '.join(f'{n}={s}' for n, s in self.mesh_shape)})"
        if self.spec.partial:
            caption += f"; values are partial sums over {', '.join(self.spec.partial)}"
        if len(self.shape) in (1, 2):
            rows = sorted({b[0] for b in self.blocks})
            cols = sorted({b[1] for b in self.blocks}) if len(self.shape) == 2 else [None]
            t = Table(title=title, caption=caption, show_header=len(self.shape) == 2,
                      show_lines=True, min_width=len(title) + 4)
            t.add_column("")
            shown_cols = cols[:8]
            for c in shown_cols:
                t.add_column("" if c is None else f"{c[0]}:{c[0] + c[1]}", justify="center")
            if len(cols) > len(shown_cols):
                t.add_column(f"… {len(cols) - len(shown_cols)} more", justify="center")
            for r in rows[:16]:
                cells = []
                for c in shown_cols:
                    key = (r,) if c is None else (r, c)
                    cells.append(_fmt_ranks(self.blocks.get(key, ())))
                if len(cols) > len(shown_cols):
                    cells.append("…")
                t.add_row(f"{r[0]}:{r[0] + r[1]}", *cells)
            if len(rows) > 16:
                t.add_row(f"… {len(rows) - 16} more", *["…"] * (len(t.columns) - 1))
            return t
        t = Table(title=title, caption=caption, min_width=len(title) + 4)
        t.add_column("block")
        t.add_column("ranks")
        for blk, ranks in list(self.blocks.items())[:64]:
            t.add_row("[" + ", ".join(f"{o}:{o + n}" for o, n in blk) + "]", _fmt_ranks(ranks))
        if len(self.blocks) > 64:
            t.add_row(f"… {len(self.blocks) - 64} more blocks", "")
        return t

    def __str__(self) -> str:
        from rich.console import Console

        console = Console(width=120, record=True, file=_Null())
        console.print(self)
        return console.export_text()


class _Null:
    def write(self, *_):
        pass

    def flush(self):
        pass


def _fmt_ranks(ranks: Sequence[int]) -> str:
    ranks = list(ranks)
    if not ranks:
        return "·"
    if len(ranks) > 6:
        return f"{ranks[0]},{ranks[1]},…,{ranks[-1]} ({len(ranks)})"
    return ",".join(map(str, ranks))


def sharding_view(shape: Sequence[int], spec: P, mesh: Mesh, dtype=torch.float32, *,
                  any_order: bool = False) -> ShardingView:
    """Compute which rank of ``mesh`` holds which block of a tensor laid out as ``spec``
    (``any_order``: the axes of a dim in their true major order, as a DTensor with a
    strided shard holds them, not in mesh order)."""
    shape = tuple(int(n) for n in shape)
    check_spec(spec, shape, mesh.axis_names, what="visualize", mesh_repr=repr(mesh),
               any_order=any_order)
    names = mesh.axis_names
    sizes = mesh.shape
    blocks: dict = {}
    for coord in itertools.product(*(range(s) for s in mesh.shape_tuple)):
        c = dict(zip(names, coord))
        blk = tuple(
            dim_block(n, [sizes[a] for a in spec.dim_axes(d)], [c[a] for a in spec.dim_axes(d)])
            for d, n in enumerate(shape)
        )
        blocks.setdefault(blk, []).append(int(mesh.ranks[coord]))
    blocks = {k: tuple(v) for k, v in blocks.items()}
    return ShardingView(shape, spec, tuple(mesh.shape.items()), blocks,
                        type_string(shape, dtype, spec))


def visualize(x, spec: P | None = None, mesh: Mesh | None = None, *, show: bool = True):
    """Show which rank holds which block, like ``jax.debug.visualize_array_sharding``.

    ``x`` is a DTensor, or a shape / plain tensor together with ``spec`` and ``mesh``
    (a fake mesh works: nothing is allocated). Prints a rich table on rank 0 and returns
    the ``ShardingView`` (``view.blocks`` maps each block to the ranks holding it).

    >>> visualize((8, 4), P('dp', 'tp'), Mesh(dp=2, tp=2, fake=True), show=False).type_str
    'f32[8@dp,4@tp]'
    """
    from torch.distributed.tensor import DTensor

    from .distribute import spec_of

    if isinstance(x, DTensor):
        dm = x.device_mesh
        mesh = Mesh(dict(zip(dm.mesh_dim_names, dm.shape)), fake=True,
                    _ranks=dm.mesh.cpu().numpy())
        view = sharding_view(x.shape, spec_of(x), mesh, x.dtype, any_order=True)
    else:
        if spec is None or mesh is None:
            raise SpecError("visualize: a plain tensor or shape needs spec= and mesh= as well")
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else tuple(x)
        dtype = x.dtype if isinstance(x, torch.Tensor) else torch.float32
        from .context import current_rules

        rules = current_rules()
        if rules is not None:
            spec = rules.resolve(spec, mesh.axis_names, what="visualize")
        view = sharding_view(shape, spec, mesh, dtype)
    if show and _is_rank0():
        from rich.console import Console

        Console().print(view)
    return view


def _is_rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0
