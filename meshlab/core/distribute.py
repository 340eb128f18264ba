"""distribute and constrain: moving values onto a mesh (``shard_map`` is in ``shard_map``).

Spec names are checked wherever axes are known (a mesh given or active, a parallelized
forward running, a DTensor's own mesh): a name that is neither a mesh axis nor a logical
name the rules map raises ``SpecError`` with the mesh's axes and the nearest name, before
any communication.

Inside a parallelized model the whole mesh's names apply, and the data-parallel axes are
already true on dim 0 (the data loader split the batch over them), so
``P('batch', 'tp', None)`` means "split the sequence over tp" there.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch

from .context import (ModelLayout, current_layout, current_mesh, current_rules,
                       layout_of_mesh, local_region)
from .errors import (ConfigError, ConfigTypeError, MeshError, RulesError, SpecError,
                      check_bool, check_int)
from .mesh import Mesh, MeshBase
from .placement import check_spec, dim_block, from_placements, to_placements
from .rules import LOGICAL_AXES, Rules, nearest_axis
from .spec import P


def _check_common(fn: str, mesh=None, rules=None, x=None, tensor: bool = False) -> None:
    """The arguments ``distribute``, ``constrain`` and ``shard_map`` share, each refused by
    name when it is something else."""
    if tensor and not isinstance(x, torch.Tensor):
        raise ConfigTypeError(f"{fn}: expected a torch.Tensor, got {type(x).__name__}")
    if mesh is not None and not isinstance(mesh, MeshBase):
        raise MeshError(f"{fn}(mesh=...): a meshlab.Mesh such as Mesh(dp=2, tp=2), or None "
                        f"for the active one; got {type(mesh).__name__}")
    if rules is not None and not isinstance(rules, Rules):
        raise RulesError(f"{fn}(rules={rules!r}): a Rules such as Rules(batch='dp'), or None "
                         f"for the active ones")


def _spec_list(specs, fn: str, arg: str, none_ok: bool) -> None:
    """``in_specs``/``out_specs``: a ``P``, or a list/tuple of ``P`` (or ``None``)."""
    if isinstance(specs, P) or (none_ok and specs is None):
        return
    if not isinstance(specs, (tuple, list)) or not all(
            isinstance(s, P) or s is None for s in specs):
        raise SpecError(f"shard_map({fn}): {arg} must be a P(...) or a tuple of them (None "
                        f"for a non-tensor), e.g. {arg}=(P('dp', None), None); got {specs!r}")


def _check_shard_map(fn, in_specs, out_specs, mesh, rules, check) -> str:
    """``shard_map``'s arguments, refused by name when it wraps ``fn``; returns the name
    its messages use."""
    if not callable(fn):
        raise ConfigTypeError(f"shard_map: fn must be a function of the local blocks, got "
                              f"{type(fn).__name__}")
    name = getattr(fn, "__name__", repr(fn))
    _check_common(f"shard_map({name})", mesh, rules)
    _spec_list(in_specs, name, "in_specs", none_ok=True)
    _spec_list(out_specs, name, "out_specs", none_ok=False)
    check_bool(check, f"shard_map({name})", "check")
    return name


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


def _check_names(spec: P, axes: Sequence[str], rules: Rules | None, what: str) -> None:
    """Every name of ``spec`` is a mesh axis, or (with rules) a name they map."""
    axes = tuple(axes)
    known = set(axes) | ((set(rules) | set(LOGICAL_AXES)) if rules is not None else set())
    for name in spec.axes + tuple(spec.partial):
        if name in known:
            continue
        near = nearest_axis(name, sorted(known))
        hint = f"; did you mean {near!r}?" if near else "."
        mapped = f" nor a name of {rules!r}" if rules is not None else " (no rules map names)"
        raise SpecError(
            f"{what}: {spec!r} names axis {name!r}, which is neither an axis of the mesh "
            f"{axes}{mapped}{hint} Use a mesh axis, or map {name!r} with "
            f"Rules({name}=...)")


def _resolve_checked(spec: P, axes: Sequence[str], rules: Rules | None, what: str) -> P:
    if not isinstance(spec, P):
        raise SpecError(f"{what}: expected a P(...) spec, got {spec!r}")
    _check_names(spec, axes, rules, what)
    return rules.resolve(spec, tuple(axes), what=what) if rules is not None else spec


def _drop_data_axes(spec: P, data_axes: Sequence[str], what: str) -> P:
    """``spec`` without the data-parallel axes, which may shard dim 0 only (the batch the
    data loader already split over them)."""
    dims = []
    for d in range(len(spec)):
        axes = spec.dim_axes(d)
        data = tuple(a for a in axes if a in data_axes)
        if data and d != 0:
            raise SpecError(
                f"{what}: {spec!r} splits dim {d} over {data}, which carry data parallelism: "
                f"the data loader splits the batch (dim 0) over them and every rank computes "
                f"on its own. Name them on dim 0 only, or leave them out")
        rest = tuple(a for a in axes if a not in data_axes)
        dims.append(None if not rest else rest[0] if len(rest) == 1 else rest)
    if set(spec.partial) & set(data_axes):
        raise SpecError(f"{what}: {spec!r} declares a pending sum over the data-parallel "
                        f"axes {tuple(data_axes)}; the optimizer averages gradients over them, "
                        f"activations are never summed there. Drop them from partial=")
    partial = tuple(a for a in spec.partial if a not in data_axes)
    return P(*dims, partial=partial or None)


def _rules_in(layout: ModelLayout | None, rules: Rules | None) -> Rules | None:
    if rules is not None:
        return rules
    return current_rules() or (layout.rules if layout is not None else None)


def _model_spec(spec: P, layout: ModelLayout, rules: Rules | None, what: str) -> P:
    """``spec`` (names of the whole mesh) as a spec over the tensor-parallel DeviceMesh
    the activations of a DTensor-mode model live on."""
    s = _resolve_checked(spec, layout.mesh.axis_names, _rules_in(layout, rules), what)
    s = _drop_data_axes(s, layout.data_axes, what)
    extra = [a for a in s.axes + tuple(s.partial) if a != layout.tp_axis]
    if extra:
        raise SpecError(
            f"{what}: {spec!r} names {extra}, which this model's activations are not laid "
            f"out over: they are DTensors over {layout.tp_axis!r}, the batch already split "
            f"over {layout.data_axes} by the data loader. Name {layout.tp_axis!r}, the data "
            f"axes on dim 0, or None")
    return s


def distribute(tensor: torch.Tensor, mesh: Mesh | None = None, spec: P = P(), *,
               rules: Rules | None = None, src_rank: int = 0):
    """A global tensor -> a DTensor laid out on ``mesh`` as ``spec`` says.

    Every rank passes the same global value (DTensor scatters rank ``src_rank``'s copy).
    ``spec`` may use logical names when ``rules`` (or ambient rules) map them.

    >>> x = distribute(torch.randn(8, 16), mesh, P('dp', 'tp'))   # doctest: +SKIP
    """
    from torch.distributed.tensor import distribute_tensor

    _check_common("distribute", mesh, rules, tensor, tensor=True)
    mesh = _mesh_or_ambient(mesh, "distribute")
    check_int(src_rank, "distribute", "src_rank", low=0, high=mesh.size - 1, error=MeshError)
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


def _dtensor_layout(dm, layout: ModelLayout | None) -> ModelLayout | None:
    """The DTensor-mode model layout a DTensor over ``dm`` belongs to, if any."""
    if layout is not None and layout.dtensor and layout.tp_mesh == dm:
        return layout
    return layout_of_mesh(dm)


def _placements_of(x, spec: P, rules: Rules | None, what: str):
    names = x.device_mesh.mesh_dim_names
    if names is None:
        raise MeshError(f"{what}: this DTensor's DeviceMesh has no axis names; build it "
                        f"with meshlab.Mesh")
    lay = _dtensor_layout(x.device_mesh, current_layout())
    if lay is not None:
        s = _model_spec(spec, lay, rules, what)
    else:
        s = _resolve_checked(spec, names, _rules_in(None, rules), what)
    return to_placements(s, names, x.shape, what=what)


def constrain(x, spec: P, *, rules: Rules | None = None):
    """Lay an activation out as ``spec`` (``with_sharding_constraint``); autograd-correct.

    * A DTensor is redistributed (its gradient flows back through the inverse
      collective); one already laid out so is returned as it is.
    * Inside a model running in DTensor mode (shard specs without a policy's regions),
      spec names are the whole mesh's and the data-parallel axes are already true on dim
      0, so ``constrain(h, P('batch', 'tp', None))`` splits the sequence over ``tp``. A
      plain tensor made inside that forward is read as replicated (as every op there reads
      it) and moved too.
    * Inside a model on the local-shard path (a policy marks its regions), activations
      are this rank's local tensors laid out by the policy: a spec over the data axes
      (dim 0) or none is checked and the tensor returned; a spec over another axis raises
      ``ConfigError`` (the policy's ``activations`` / ``sequence_parallel`` say it there).
    * A plain tensor elsewhere is returned unchanged, so model code annotated with
      ``constrain`` runs as it is on one device; with a mesh active its names are checked.

    Unknown names raise ``SpecError`` with the mesh's axes and the nearest name.
    """
    from torch.distributed.tensor import DTensor, Replicate

    _check_common("constrain", None, rules, x, tensor=True)
    if not isinstance(spec, P):
        raise SpecError(f"constrain: expected a P(...) spec, got {spec!r}")
    what = f"constrain({tuple(x.shape)})"
    layout = current_layout()
    if isinstance(x, DTensor):
        placements = _placements_of(x, spec, rules, what)
        if tuple(placements) == tuple(x.placements):
            return x
        return x.redistribute(x.device_mesh, placements)
    if layout is not None and layout.dtensor:
        rep = (Replicate(),) * layout.tp_mesh.ndim
        return constrain(DTensor.from_local(x, layout.tp_mesh, rep, run_check=False), spec,
                         rules=rules)
    if layout is not None:
        _check_local_path(x, spec, rules, layout, what)
    elif current_mesh() is not None:
        axes = current_mesh().axis_names
        check_spec(_resolve_checked(spec, axes, _rules_in(None, rules), what), x.shape, axes,
                   what=what)
    return x


def _check_local_path(x, spec: P, rules: Rules | None, layout: ModelLayout, what: str) -> None:
    axes = layout.mesh.axis_names
    s = _resolve_checked(spec, axes, _rules_in(layout, rules), what)
    check_spec(s, x.shape, axes, what=what)
    rest = _drop_data_axes(s, layout.data_axes, what)
    if rest.axes or rest.partial:
        raise ConfigError(
            f"{what}: {spec!r} asks for a layout over {rest.axes + tuple(rest.partial)} "
            f"inside a model whose policy marks its tensor-parallel regions; there "
            f"activations are this rank's local tensors, laid out by the policy, and "
            f"constrain cannot move them. Say it in the policy (activations=, "
            f"sequence_parallel=; docs/policies.md), or shard the model with a specs dict "
            f"(no regions) so it runs on DTensors, where constrain redistributes")
