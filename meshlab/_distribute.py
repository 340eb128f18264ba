"""distribute, constrain and shard_map: moving values onto a mesh and writing per-shard code."""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch

from ._context import current_mesh, current_rules
from ._errors import MeshError, SpecError
from ._mesh import Mesh
from ._placement import from_placements, to_placements
from ._rules import Rules
from ._spec import P


def _mesh_or_ambient(mesh: Mesh | None, fn: str) -> Mesh:
    mesh = mesh if mesh is not None else current_mesh()
    if mesh is None:
        raise MeshError(f"{fn}: no mesh given and none is active; pass mesh= or use `with mesh:`")
    return mesh


def _resolve(spec: P, axes: Sequence[str], rules: Rules | None, what: str) -> P:
    if not isinstance(spec, P):
        raise SpecError(f"{what}: expected a P(...) spec, got {spec!r}")
    rules = rules if rules is not None else current_rules()
    return rules.resolve(spec, axes, what=what) if rules is not None else spec


def distribute(tensor: torch.Tensor, mesh: Mesh | None = None, spec: P = P(), *,
               rules: Rules | None = None, src_rank: int = 0):
    """A global tensor -> a DTensor laid out on ``mesh`` as ``spec`` says.

    Every rank passes the same global value (DTensor scatters rank ``src_rank``'s copy).
    ``spec`` may use logical names when ``rules`` (or ambient rules) map them.

    >>> x = distribute(torch.randn(8, 16), mesh, P('dp', 'tp'))   # doctest: +SKIP
    """
    from torch.distributed.tensor import distribute_tensor

    mesh = _mesh_or_ambient(mesh, "distribute")
    what = f"distribute({tuple(tensor.shape)})"
    spec = _resolve(spec, mesh.axis_names, rules, what)
    if spec.partial:
        raise SpecError(
            f"{what}: {spec!r} is partial, but distribute takes a whole (reduced) value; "
            f"pending sums come out of computation. Drop partial=, or build the value with "
            f"torch.distributed.tensor.DTensor.from_local"
        )
    placements = to_placements(spec, mesh.axis_names, tensor.shape, what=what)
    return distribute_tensor(tensor, mesh.device_mesh, placements, src_data_rank=src_rank)


def spec_of(x) -> P:
    """The ``P`` (in mesh axes) of a DTensor."""
    names = x.device_mesh.mesh_dim_names
    if names is None:
        raise MeshError("this DTensor's DeviceMesh has no axis names; build it with meshlab.Mesh")
    return from_placements(x.placements, names, x.ndim)


def constrain(x, spec: P, *, rules: Rules | None = None):
    """Lay an activation out as ``spec`` (``with_sharding_constraint``); autograd-correct.

    A DTensor is redistributed (its gradient flows back through the inverse
    collective). A plain tensor is returned unchanged, so model code annotated with
    ``constrain`` runs as it is on one device.
    """
    from torch.distributed.tensor import DTensor

    if not isinstance(x, DTensor):
        return x
    axes = x.device_mesh.mesh_dim_names
    if axes is None:
        raise MeshError("constrain: this DTensor's DeviceMesh has no axis names")
    what = f"constrain({tuple(x.shape)})"
    spec = _resolve(spec, axes, rules, what)
    placements = to_placements(spec, axes, x.shape, what=what)
    if tuple(placements) == tuple(x.placements):
        return x
    return x.redistribute(x.device_mesh, placements)


def shard_map(fn: Callable, in_specs: Sequence[P | None] | P | None, out_specs: Sequence[P] | P,
              *, mesh: Mesh | None = None, rules: Rules | None = None) -> Callable:
    """Run ``fn`` on local shards (``torch.distributed.tensor.experimental.local_map``).

    ``in_specs`` has one entry per positional argument (``None`` for non-tensors);
    DTensor arguments are redistributed to them first. ``fn`` sees plain local tensors;
    its outputs are wrapped as DTensors laid out as ``out_specs``.
    """
    from torch.distributed.tensor.experimental import local_map

    single_out = isinstance(out_specs, P)

    @functools.wraps(fn)
    def wrapped(*args: Any):
        m = _mesh_or_ambient(mesh, "shard_map")
        ins = (in_specs,) if isinstance(in_specs, P) else in_specs
        if ins is not None and len(ins) != len(args):
            raise SpecError(
                f"shard_map({getattr(fn, '__name__', fn)}): {len(ins)} in_specs for "
                f"{len(args)} positional arguments; give one spec (or None) per argument"
            )

        def pl(s: P | None, x: Any):
            if s is None:
                return None
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else (0,) * len(s)
            return to_placements(_resolve(s, m.axis_names, rules, "shard_map"),
                                 m.axis_names, shape, what="shard_map argument")

        # local_map reads a tuple as "one entry per output/argument" and a list as the
        # placements of one value.
        in_pl = None if ins is None else tuple(
            None if s is None else list(pl(s, x)) for s, x in zip(ins, args))
        outs = (out_specs,) if single_out else tuple(out_specs)
        out_pl = [list(pl(s, None)) for s in outs]
        lm = local_map(fn, out_placements=out_pl[0] if single_out else tuple(out_pl),
                       in_placements=in_pl, device_mesh=m.device_mesh, redistribute_inputs=True)
        return lm(*args)

    return wrapped
