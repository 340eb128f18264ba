"""``shard_map``'s first-call check: every rank fingerprints what it passes and returns
(shape and three float64 sums of the values), the fingerprints are all-gathered over the
mesh, and every rank runs the same test on the same table, so all raise the same
``SpecError`` or none does (``shard_map``'s docstring says what is tested)."""

from __future__ import annotations

import torch

from .errors import SpecError
from .placement import dim_block
from .spec import P

_DIMS = 6          # sizes recorded per tensor; higher dims are covered by the element count
_FP = 1 + _DIMS + 1 + 3


def _fingerprint(t: torch.Tensor, dev) -> torch.Tensor:
    """ndim, the first sizes (-1 past the last), numel, and three float64 sums."""
    shape = list(t.shape)[:_DIMS]
    head = [float(t.dim())] + [float(n) for n in shape] + [-1.0] * (_DIMS - len(shape)) + \
        [float(t.numel())]
    flat = t.detach().reshape(-1)
    sums = torch.zeros(3, dtype=torch.float64, device=dev)
    step = 1 << 22                     # float64 copies of at most 32 MiB at a time
    for lo in range(0, flat.numel(), step):
        v = flat[lo:lo + step].to(device=dev, dtype=torch.float64)
        w = torch.arange(lo, lo + v.numel(), device=dev, dtype=torch.float64)
        w.mul_(0.7548776662466927).frac_()           # fixed weights in [0, 1)
        sums += torch.stack([v.sum(), (v * w).sum(), v.abs().sum()])
    return torch.cat([torch.tensor(head, dtype=torch.float64, device=dev), sums])


def _table(vec: torch.Tensor, dm) -> torch.Tensor:
    """Every rank's ``vec``, indexed by mesh coordinate: shape (*mesh shape, len(vec))."""
    from .collectives import all_gather_into

    t = vec
    for i in range(dm.ndim):
        n = dm.size(i)
        flat = t.contiguous().reshape(-1)
        out = flat.new_empty(n * flat.numel())
        if n > 1:
            all_gather_into(out, flat, dm.get_group(i))
        else:
            out.copy_(flat)
        t = out.view((n,) + tuple(t.shape))
    return t.permute(*range(dm.ndim - 1, -1, -1), dm.ndim).contiguous()


def check_blocks(tgt, items: list, name: str, outputs: bool = False) -> None:
    """The first call's check (``shard_map``'s docstring); ``items``: (label, tensor,
    resolved spec)."""
    import torch.distributed as dist

    if not items or (dist.is_initialized() and dist.get_backend() == "fake"):
        return                         # a dry run's collectives return no data to compare
    dm = tgt.dm
    dev = _device(dm)
    with torch.no_grad():
        vec = torch.cat([_fingerprint(t, dev) for _, t, _ in items])
        table = _table(vec, dm).cpu().view(*dm.shape, len(items), _FP)
    for i, axis in enumerate(tgt.axes):
        n = dm.size(i)
        if n == 1:
            continue
        lines = table.movedim(i, 0).reshape(n, -1, len(items), _FP)
        for c in range(lines.shape[1]):
            for k, (label, t, spec) in enumerate(items):
                _check_line(lines[:, c, k], axis, spec, f"shard_map({name}): {label}",
                            outputs)


def _check_line(rows: torch.Tensor, axis: str, spec: P, what: str, outputs: bool) -> None:
    """One tensor's fingerprints along one mesh axis (the other coordinates fixed)."""
    n = rows.shape[0]
    nd = rows[:, 0].long().tolist()
    if len(set(nd)) > 1:
        raise SpecError(f"{what}: the {n} ranks along {axis!r} hold tensors of {nd} dims; "
                        f"every rank must pass (or return) a block of one tensor")
    for d in range(min(nd[0], _DIMS)):
        sizes = rows[:, 1 + d].long().tolist()
        dax = spec.dim_axes(d) if d < len(spec) else ()
        if axis not in dax:
            if len(set(sizes)) > 1:
                raise SpecError(
                    f"{what}: dim {d} has sizes {sizes} across the ranks of {axis!r}, which "
                    f"{spec!r} does not split dim {d} over, so each must hold all of it. "
                    f"Name {axis!r} on dim {d} in the spec, or give every rank the same size")
            continue
        expect = [sizes[0]] * n if outputs else \
            [dim_block(sum(sizes), [n], [c])[1] for c in range(n)]
        if (outputs or dax[-1] == axis) and sizes != expect:
            raise SpecError(
                f"{what}: dim {d} has sizes {sizes} across the ranks of {axis!r}, not the "
                f"blocks {expect} {spec!r} makes of one tensor. "
                + ("Return equal blocks (pad them): the output is laid out with the local "
                   "size times the axis size" if outputs else
                   "A plain argument is this rank's block: pass each rank its own block, "
                   "or pass the whole tensor as a DTensor (meshlab.distribute) to be split"))
    if axis in spec.axes or axis in spec.partial:
        return
    sums = rows[:, -3:]
    spread = (sums[:, :2].max(0).values - sums[:, :2].min(0).values).abs().max().item()
    if spread > 1e-5 * max(sums[:, 2].max().item(), 1e-30):
        raise SpecError(
            f"{what} is declared {spec!r}, the same on every rank of {axis!r}, but the {n} "
            f"ranks of {axis!r} hold different values (sums {sums[:, 0].tolist()}): a local "
            f"block would be labeled as the whole tensor. Name the axis it is split over in "
            f"its spec (P(..., {axis!r}, ...)), declare a pending sum (partial={axis!r}) or "
            f"reduce it inside the function; check=False turns this first-call check off")


def check_global(tgt, items: list, name: str) -> None:
    """A plain tensor given to a ``shard_map`` call outside a parallelized model is the
    global value, split by its spec: every rank must pass the same one (``items``:
    (label, tensor))."""
    import torch.distributed as dist

    if not items or (dist.is_initialized() and dist.get_backend() == "fake"):
        return
    dm = tgt.dm
    dev = _device(dm)
    with torch.no_grad():
        vec = torch.cat([_fingerprint(t, dev) for _, t in items])
        table = _table(vec, dm).cpu().view(-1, len(items), _FP)
    for k, (label, t) in enumerate(items):
        rows = table[:, k]
        shapes_differ = (rows[:, :1 + _DIMS + 1] != rows[:1, :1 + _DIMS + 1]).any()
        sums = rows[:, -3:]
        spread = (sums[:, :2].max(0).values - sums[:, :2].min(0).values).abs().max().item()
        if shapes_differ or spread > 1e-5 * max(sums[:, 2].max().item(), 1e-30):
            raise SpecError(
                f"shard_map({name}): {label} is a plain tensor, which shard_map reads as the "
                f"global value and splits as its in_spec says (as JAX does), but the ranks "
                f"pass different ones (shapes or sums differ: {sums[:, 0].tolist()}). Pass "
                f"every rank the same global tensor, or pass a DTensor "
                f"(meshlab.distribute(x, mesh, spec)) laid out as you mean it")


def _device(dm):
    return torch.device("cuda", torch.cuda.current_device()) if dm.device_type == "cuda" \
        else torch.device(dm.device_type)
