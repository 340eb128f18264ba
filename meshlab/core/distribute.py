"""distribute, constrain and shard_map: moving values onto a mesh and writing per-shard code.

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


# -- shard_map ---------------------------------------------------------------------------
class _Target:
    """Where one ``shard_map`` call runs: the DeviceMesh, its axis names, the rules, the
    DTensor-mode model layout (or None), and whether outputs become DTensors."""

    def __init__(self, dm, rules, layout: ModelLayout | None, wrap: bool, name: str):
        self.dm, self.rules, self.layout, self.wrap, self.name = dm, rules, layout, wrap, name
        self.axes = tuple(dm.mesh_dim_names or ())
        if not self.axes:
            raise MeshError(f"shard_map({name}): the DeviceMesh has no axis names; build "
                            f"it with meshlab.Mesh")

    def spec(self, s: P | None, what: str) -> P | None:
        if s is None:
            return None
        if self.layout is not None:
            return _model_spec(s, self.layout, self.rules, what)
        return _resolve_checked(s, self.axes, self.rules, what)

    def placements(self, s: P, shape, what: str):
        return to_placements(s, self.axes, shape, what=what)


def _target(mesh: Mesh | None, rules, args, name: str) -> _Target | None:
    from torch.distributed.tensor import DTensor

    layout = current_layout()
    dts = [a for a in args if isinstance(a, DTensor)]
    if dts:
        dm = dts[0].device_mesh
        lay = _dtensor_layout(dm, layout)
        if lay is None and mesh is not None and mesh.device_mesh != dm:
            raise SpecError(
                f"shard_map({name}): a DTensor argument lives on the mesh "
                f"{dm.mesh_dim_names}, not on the one given ({mesh!r}); distribute it on "
                f"that mesh or leave mesh= out")
        return _Target(dm, _rules_in(lay or layout, rules), lay, True, name)
    if layout is not None and layout.dtensor:
        return _Target(layout.tp_mesh, _rules_in(layout, rules), layout, True, name)
    m = mesh or current_mesh() or (layout.mesh if layout is not None else None)
    if m is None:
        return None
    return _Target(m.device_mesh, _rules_in(layout, rules), None, False, name)


def _localize(tgt: _Target, args, specs, name: str):
    """The local blocks ``fn`` sees, and the plain arguments the first call checks. Every
    spec is checked before the first redistribution."""
    from torch.distributed.tensor import DTensor, Replicate

    pls = []
    for i, (x, s) in enumerate(zip(args, specs)):
        what = f"shard_map({name}) argument {i}"
        if isinstance(x, DTensor) and s is None:
            raise SpecError(f"{what} is a DTensor but its in_spec is None; give it a spec "
                            f"(P() for replicated)")
        if isinstance(x, DTensor) and x.device_mesh != tgt.dm:
            raise SpecError(f"{what} lives on the mesh {x.device_mesh.mesh_dim_names}, the "
                            f"call on {tgt.axes}; pass DTensors of one mesh")
        ok = isinstance(x, torch.Tensor) and s is not None
        pls.append(tgt.placements(s, x.shape, what) if ok else None)
    local, plain = [], []
    for i, (x, s, pl) in enumerate(zip(args, specs, pls)):
        if pl is not None and not isinstance(x, DTensor) and tgt.layout is not None:
            # DTensor mode reads a plain tensor as replicated, as every op there does.
            x = DTensor.from_local(x, tgt.dm, (Replicate(),) * tgt.dm.ndim, run_check=False)
        if isinstance(x, DTensor):
            x = x if tuple(x.placements) == tuple(pl) else x.redistribute(tgt.dm, pl)
            local.append(x.to_local())
            continue
        if pl is not None:
            plain.append((f"argument {i}", x, s))
        local.append(x)
    return local, plain


def _wrap(tgt: _Target, outs, specs, name: str) -> list:
    from torch.distributed.tensor import DTensor

    res = []
    for j, (o, s) in enumerate(zip(outs, specs)):
        what = f"shard_map({name}) output {j}"
        if not isinstance(o, torch.Tensor):
            if s is not None:
                raise SpecError(f"{what} is {type(o).__name__}, not a tensor, but its "
                                f"out_spec is {s!r}; give it None")
            res.append(o)
        elif s is None:
            raise SpecError(f"{what} is a tensor but its out_spec is None; give it a spec")
        elif isinstance(o, DTensor):
            raise SpecError(f"{what} is a DTensor; the function runs on local blocks and "
                            f"returns plain tensors, which shard_map lays out as out_specs")
        else:
            pl = tgt.placements(s, o.shape, what)
            res.append(DTensor.from_local(o, tgt.dm, pl, run_check=False) if tgt.wrap else o)
    return res


def shard_map(fn: Callable, in_specs: Sequence[P | None] | P | None, out_specs: Sequence[P] | P,
              *, mesh: Mesh | None = None, rules: Rules | None = None,
              check: bool = True) -> Callable:
    """Run ``fn`` on local blocks, as JAX's ``shard_map``.

    ``in_specs`` has one entry per positional argument (``None`` for non-tensors); a
    DTensor argument is redistributed to its spec first and ``fn`` sees its local block
    (``in_specs=None``: DTensors as they are laid out, other arguments as they are).
    A plain tensor argument is taken as this rank's block already (in DTensor mode, where
    plain tensors are replicated, it is split as its spec says). ``fn`` returns plain
    tensors; with a DTensor among the arguments, or inside a model running in DTensor
    mode, they become DTensors laid out as ``out_specs`` (elsewhere they stay local, as
    ``local_map`` leaves them). Inside a parallelized model, spec names are the whole
    mesh's and the data-parallel axes are already true on dim 0 (``P('batch', 'tp')``).
    With no mesh anywhere (none given or active, no DTensor argument, no parallelized
    forward running), ``fn`` runs on the arguments as they are: one device holds every
    block, so the same code runs in one process, as ``constrain`` does.

    ``check`` (on by default) verifies the layout on the first call, where a wrong spec
    would otherwise go unnoticed: every rank fingerprints each plain argument and each
    output (its shape and three float64 sums of its values: plain, position-weighted,
    absolute) and the fingerprints are all-gathered over the mesh (one small all-gather
    per mesh axis). Every rank then runs the same test on the same table, so all raise the
    same ``SpecError`` or none does:

    * along an axis a spec does not name, the ranks must hold the same shape and the
      same values (within 1e-5 of the absolute sum): an output declared ``P()`` whose
      blocks differ is a local shard labeled as the whole tensor;
    * along an axis that splits a dim, a plain argument's sizes must be blocks of one
      tensor (``torch.chunk``'s sizes of their sum) and an output's sizes equal (its
      global shape is read as the local one times the axis size).

    Partial axes are not compared (their values are pending sums). The check costs one
    round of tiny collectives once per wrapped function (none on torch's fake process
    group, whose collectives return no data); ``check=False`` skips it.
    """
    name = _check_shard_map(fn, in_specs, out_specs, mesh, rules, check)
    single = isinstance(out_specs, P)
    outs_given = (out_specs,) if single else tuple(out_specs)
    pending = [bool(check)]

    @functools.wraps(fn)
    def wrapped(*args: Any):
        from torch.distributed.tensor import DTensor

        ins = (in_specs,) if isinstance(in_specs, P) else in_specs
        if ins is not None and len(ins) != len(args):
            raise SpecError(f"shard_map({name}): {len(ins)} in_specs for {len(args)} "
                            f"positional arguments; give one spec (or None) per argument")
        tgt = _target(mesh, rules, args, name)
        if tgt is None:
            return fn(*args)
        if ins is None:        # DTensors as they are laid out; anything else as it is
            specs = [from_placements(x.placements, tgt.axes, x.ndim)
                     if isinstance(x, DTensor) else None for x in args]
        else:
            specs = [tgt.spec(s, f"shard_map({name}) in_specs[{i}]") for i, s in enumerate(ins)]
        outs = [tgt.spec(s, f"shard_map({name}) out_specs[{j}]")
                for j, s in enumerate(outs_given)]
        local, plain = _localize(tgt, args, specs, name)
        if pending[0]:
            _check_blocks(tgt, plain, name)
        with local_region():
            out = fn(*local)
        flat = (out,) if single else tuple(out)
        if len(flat) != len(outs):
            raise SpecError(f"shard_map({name}): the function returned {len(flat)} values "
                            f"for {len(outs)} out_specs; give one spec per output")
        if pending[0]:
            _check_blocks(tgt, [(f"output {j}", o, s) for j, (o, s) in
                                enumerate(zip(flat, outs)) if isinstance(o, torch.Tensor)
                                and s is not None], name, outputs=True)
            pending[0] = False
        res = _wrap(tgt, flat, outs, name)
        return res[0] if single else tuple(res)

    return wrapped


# -- the first call's layout check -------------------------------------------------------
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


def _check_blocks(tgt: _Target, items: list, name: str, outputs: bool = False) -> None:
    """The first call's check (``shard_map``'s docstring); ``items``: (label, tensor,
    resolved spec)."""
    import torch.distributed as dist

    if not items or (dist.is_initialized() and dist.get_backend() == "fake"):
        return                         # a dry run's collectives return no data to compare
    dm = tgt.dm
    dev = torch.device("cuda", torch.cuda.current_device()) if dm.device_type == "cuda" \
        else torch.device(dm.device_type)
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
