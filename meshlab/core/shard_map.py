"""shard_map: per-shard code with JAX's semantics.

Where a call runs (``_Target``) decides what a plain tensor argument means:

* outside a parallelized model (a mesh given or active, or DTensor arguments): a plain
  tensor is the global value, the same on every rank, split by its in_spec (JAX's
  ``shard_map``); the outputs come back as DTensors laid out as out_specs;
* inside a model running on DTensors: plain tensors are replicated, as every op there
  reads them, and split likewise;
* inside a model on the local-shard path (a policy marks its regions): activations are
  this rank's blocks already, and plain arguments are taken as such.

Gradients follow JAX's transpose rules (``meshlab.core.varying``): an input replicated
over an axis the function's values vary along gets its gradient summed over that axis.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from .context import ModelLayout, current_layout, current_mesh, in_local_region, local_region
from .distribute import (_check_shard_map, _dtensor_layout, _model_spec, _resolve_checked,
                         _rules_in)
from .errors import MeshError, SpecError
from .layout_check import check_blocks, check_global
from .mesh import Mesh
from .placement import from_placements, to_placements
from .rules import Rules
from .spec import P
from .tensors import scale_grad
from .varying import (current_region, mark, on_one_device, one_device, pvary, reenter,
                      region, vma)


class _Target:
    """Where one ``shard_map`` call runs: the DeviceMesh and its axis names, the rules,
    the DTensor-mode model layout (or None), whether outputs become DTensors, whether
    plain arguments are global values, and the axes whose variance is tracked."""

    def __init__(self, dm, rules, layout: ModelLayout | None, wrap: bool, name: str, *,
                 plain_global: bool = False, local_model: ModelLayout | None = None):
        self.dm, self.rules, self.layout, self.wrap, self.name = dm, rules, layout, wrap, name
        self.plain_global = plain_global
        self.axes = tuple(dm.mesh_dim_names or ())
        if not self.axes:
            raise MeshError(f"shard_map({name}): the DeviceMesh has no axis names; build "
                            f"it with meshlab.Mesh")
        # inside a model the data axes are every rank's own batch: not tracked
        data = tuple(local_model.data_axes) if local_model is not None else ()
        self.tracked = tuple(a for a in self.axes if a not in data)
        # on the local-shard path a closed-over tensor may be a module's local shard
        self.local_model = local_model is not None

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
        return _Target(dm, _rules_in(lay or layout, rules), lay, True, name,
                       plain_global=lay is None and layout is None)
    if layout is not None and layout.dtensor:
        return _Target(layout.tp_mesh, _rules_in(layout, rules), layout, True, name)
    if layout is not None:            # the local-shard path: plain tensors are blocks
        return _Target(layout.mesh.device_mesh, _rules_in(layout, rules), None, False, name,
                       local_model=layout)
    m = mesh or current_mesh()
    if m is None:
        return None
    return _Target(m.device_mesh, _rules_in(None, rules), None, True, name, plain_global=True)


def _localize(tgt: _Target, args, specs, name: str):
    """The local blocks ``fn`` sees, and the plain arguments the first call checks (as
    blocks, or as global values). Every spec is checked before the first redistribution."""
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
    local, blocks, whole = [], [], []
    for i, (x, s, pl) in enumerate(zip(args, specs, pls)):
        if pl is not None and not isinstance(x, DTensor) and (tgt.layout is not None or
                                                               tgt.plain_global):
            if s.partial:
                raise SpecError(
                    f"{what} is a plain tensor, the whole value, but in_specs[{i}] {s!r} "
                    f"declares a pending sum over {tuple(s.partial)}: a whole value has no "
                    f"pending sum. Give it a spec without partial=, or pass a DTensor that "
                    f"holds one (ml.distribute(...) of a Partial layout)")
            # a plain tensor is the whole value: replicated in DTensor mode, the global
            # array outside a model (JAX's reading)
            if tgt.plain_global:
                whole.append((f"argument {i}", x))
            x = DTensor.from_local(x, tgt.dm, (Replicate(),) * tgt.dm.ndim, run_check=False)
        if isinstance(x, DTensor):
            x = x if tuple(x.placements) == tuple(pl) else x.redistribute(tgt.dm, pl)
            local.append(x.to_local())
            continue
        if pl is not None:
            blocks.append((f"argument {i}", x, s))
        local.append(x)
    return local, blocks, whole


def _seed(tgt: _Target, r, local, specs) -> list:
    """Mark each input with the tracked axes its spec splits it over (or leaves pending):
    it varies along those and is the same on every rank of the others."""
    out = []
    for x, s in zip(local, specs):
        if isinstance(x, torch.Tensor) and s is not None:
            axes = (set(s.axes) | set(s.partial)) & set(tgt.tracked)
            x = mark(x.view_as(x), frozenset(axes), r)
        out.append(x)
    return out


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


def _resolved(tgt: _Target, ins, outs_given, args, name: str):
    """The in_specs (``None``: each DTensor's own layout) and out_specs, resolved."""
    from torch.distributed.tensor import DTensor

    if ins is None:        # DTensors as they are laid out; anything else as it is
        specs = [from_placements(x.placements, tgt.axes, x.ndim)
                 if isinstance(x, DTensor) else None for x in args]
    else:
        specs = [tgt.spec(s, f"shard_map({name}) in_specs[{i}]") for i, s in enumerate(ins)]
    outs = [tgt.spec(s, f"shard_map({name}) out_specs[{j}]") for j, s in enumerate(outs_given)]
    return specs, outs


def _broadcast_output(tgt: _Target, r, o, s: P | None):
    """JAX's implicit ``pvary`` on outputs: an output whose spec splits it over an axis it
    does not vary along (a value the same on every rank of ``'j'``, laid out as
    ``P('i', 'j')``) is broadcast there, so the blocks tile it and its gradient is summed
    over that axis instead of each rank keeping its own block's."""
    if not isinstance(o, torch.Tensor) or s is None:
        return o
    return pvary(o, frozenset(s.axes) & frozenset(tgt.tracked), r)


def _outputs(tgt: _Target, r, out, single: bool, outs, name: str) -> tuple:
    """``fn``'s result as one tensor per out_spec, each broadcast over the axes its spec
    lays it out over (``_broadcast_output``); called inside the call's region."""
    flat = (out,) if single else tuple(out)
    if len(flat) != len(outs):
        raise SpecError(f"shard_map({name}): the function returned {len(flat)} values for "
                        f"{len(outs)} out_specs; give one spec per output")
    return tuple(_broadcast_output(tgt, r, o, s) for o, s in zip(flat, outs))


def _plain(args, specs) -> list:
    """(label, tensor) of each plain tensor argument that has a spec."""
    from torch.distributed.tensor import DTensor

    return [(f"argument {i}", x) for i, (x, s) in enumerate(zip(args, specs))
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and s is not None]


def _arrays(args, ins, name: str) -> tuple:
    """A numpy array with a spec as the tensor it holds (JAX's shard_map takes arrays);
    any other non-tensor argument whose spec splits it or leaves a sum pending is
    refused: it has no blocks to give each rank."""
    if ins is None:
        return tuple(args)
    out = []
    for i, (x, s) in enumerate(zip(args, ins)):
        if isinstance(x, np.ndarray) and s is not None:
            x = torch.from_numpy(np.ascontiguousarray(x))
        elif not isinstance(x, torch.Tensor) and isinstance(s, P) and (s.axes or s.partial):
            raise SpecError(
                f"shard_map({name}) argument {i} is a {type(x).__name__}, not a tensor, but "
                f"in_specs[{i}] {s!r} splits it over mesh axes: only a tensor (or numpy "
                f"array) has blocks to give each rank (JAX refuses to split a Python "
                f"scalar too). Pass torch.as_tensor(...) of it, or give it P() or None")
        out.append(x)
    return tuple(out)


def _not_nested(name: str) -> None:
    """JAX refuses a ``shard_map`` nested over mesh axes that are manual already; here the
    outer function is manual over every axis, and an inner call would read this rank's
    block as the global value."""
    r = current_region()
    if r is not None:
        raise SpecError(
            f"shard_map({name}) is called inside the function of shard_map({r.name}), which "
            f"already runs on this rank's blocks over every mesh axis {r.axes}: the inner "
            f"call would read a block as the global value (JAX refuses a shard_map nested "
            f"over axes already manual too). Call its function directly there, with the "
            f"collectives by axis name (ml.psum, ...), or call shard_map({name}) outside")


def _check_even(tgt: _Target, args, specs, name: str) -> None:
    """An argument whose split dimension does not divide over the ranks splitting it is
    refused, as JAX's ``shard_map`` refuses it: every rank's block has one shape."""
    for i, (x, s) in enumerate(zip(args, specs)):
        if not isinstance(x, torch.Tensor) or s is None:
            continue
        for d in range(min(len(s), x.dim())):
            axes = s.dim_axes(d)
            k = math.prod(tgt.dm.size(tgt.axes.index(a)) for a in axes)
            if x.shape[d] % k:
                raise SpecError(
                    f"shard_map({name}) argument {i} has shape {tuple(x.shape)}: in_specs[{i}] "
                    f"{s!r} splits dim {d} (size {x.shape[d]}) over {axes} ({k} ranks), and "
                    f"{x.shape[d]} is not a multiple of {k} (JAX's shard_map refuses uneven "
                    f"blocks too). Pad dim {d} to a multiple of {k} and mask the padding, or "
                    f"leave dim {d} unsplit in in_specs[{i}]")


def _unmapped(tgt: _Target, r, flat, outs) -> list:
    """(index, spec, axes) of each output that varies along tracked axes its out_spec
    neither splits it over nor declares pending (JAX's ``check_vma``)."""
    bad = []
    for j, (o, s) in enumerate(zip(flat, outs)):
        if isinstance(o, torch.Tensor) and s is not None:
            extra = (vma(o, r) & r.tracked) - frozenset(s.axes) - frozenset(s.partial)
            if extra:
                bad.append((j, s, tuple(a for a in tgt.axes if a in extra)))
    return bad


def _counted_once(tgt: _Target, flat, bad: list) -> tuple:
    """With ``check=False`` an output that varies along axes its out_spec leaves out is
    taken at its word, the same on every rank there: its cotangent is divided by those
    axes' sizes, so the gradient each rank's copy sends back is counted once, as JAX's
    ``check_vma=False`` transpose divides it."""
    flat = list(flat)
    for j, _, axes in bad:
        n = math.prod(tgt.dm.size(tgt.axes.index(a)) for a in axes)
        if flat[j].requires_grad and torch.is_grad_enabled():
            flat[j] = scale_grad(flat[j], 1.0 / n)
    return tuple(flat)


def _refuse_unmapped(bad: list, name: str) -> None:
    if bad:
        j, s, axes = bad[0]
        raise SpecError(
            f"shard_map({name}) output {j} varies along {axes} (it is computed from blocks "
            f"that differ there: an input split over them, or all_gather, ppermute, "
            f"psum_scatter, all_to_all or axis_index over them), but out_specs[{j}] {s!r} "
            f"leaves {axes} out, which declares it the same on every rank there; its "
            f"gradient would be counted once per rank (JAX's shard_map refuses this too). "
            f"Name the axis in out_specs[{j}] (P(..., {axes[0]!r})) or reduce over it "
            f"inside the function (ml.psum, ml.pmean, ml.pmax); check=False turns the "
            f"checks off")


def _call(tgt: _Target, fn: Callable, args, specs_given, single: bool, name: str,
          pending: list, check: bool) -> list:
    """One call of the wrapped function: checked, localized, run, laid out."""
    specs, outs = _resolved(tgt, specs_given[0], specs_given[1], args, name)
    if pending[0] and tgt.plain_global:       # before any redistribution
        check_global(tgt, _plain(args, specs), name)
    if tgt.plain_global:
        _check_even(tgt, args, specs, name)
    local, blocks, _ = _localize(tgt, args, specs, name)
    if pending[0]:
        check_blocks(tgt, blocks, name)
    with local_region(), region(tgt.dm, tgt.tracked, unmarked_varying=tgt.local_model,
                                name=name) as r:
        flat = _outputs(tgt, r, fn(*_seed(tgt, r, local, specs)), single, outs, name)
        bad = _unmapped(tgt, r, flat, outs) if not tgt.local_model else []
        if not check:
            flat, bad = _counted_once(tgt, flat, bad), []
    if pending[0]:
        check_blocks(tgt, [(f"output {j}", o, s) for j, (o, s) in
                           enumerate(zip(flat, outs)) if isinstance(o, torch.Tensor)
                           and s is not None], name, outputs=True)
        pending[0] = False
    _refuse_unmapped(bad, name)
    return _wrap(tgt, flat, outs, name)


def shard_map(fn: Callable, in_specs: Sequence[P | None] | P | None, out_specs: Sequence[P] | P,
              *, mesh: Mesh | None = None, rules: Rules | None = None,
              check: bool = True) -> Callable:
    """Run ``fn`` on local blocks, as JAX's ``shard_map``.

    ``in_specs`` has one entry per positional argument (``None`` for non-tensors); a
    DTensor argument is redistributed to its spec first and ``fn`` sees its local block
    (``in_specs=None``: DTensors as they are laid out, other arguments as they are). A
    plain tensor argument is the global value, as in JAX: every rank passes the same one
    and ``fn`` sees the block its spec gives this rank (inside a model on the local-shard
    path, where activations are this rank's blocks already, it is taken as the block).
    ``fn`` returns plain tensors, which come back as DTensors laid out as ``out_specs``
    (inside a local-shard model they stay local, as ``local_map`` leaves them). Inside a
    parallelized model, spec names are the whole mesh's and the data-parallel axes are
    already true on dim 0 (``P('batch', 'tp')``). With no mesh anywhere (none given or
    active, no DTensor argument, no parallelized forward running), ``fn`` runs on the
    arguments as they are: one device holds every block, so the same code runs in one
    process, as ``constrain`` does; a collective by axis name there acts over an axis of
    one rank (``psum`` and ``all_gather(tiled=True)`` return their input, ``axis_index``
    0, ``axis_size`` 1).

    Inside ``fn``, collectives by axis name (``meshlab.psum``, ``pmean``, ``all_gather``,
    ``psum_scatter``, ``ppermute``, ``all_to_all``, ``axis_index``, ...) communicate, and
    gradients follow JAX's rules: an input replicated over an axis (its spec does not name
    it; a tensor ``fn`` closes over counts as replicated everywhere) that meets values
    varying along that axis gets its gradient summed over it, so ``grad`` of the global
    computation is what one process computes (``meshlab.core.varying``).

    ``check`` (on by default) verifies the layout on the first call, where a wrong spec
    would otherwise go unnoticed: every rank fingerprints each plain argument and output
    (shape and three float64 sums) and all see the same all-gathered table, so all raise
    the same ``SpecError`` or none does:

    * a plain argument read as the global value must be the same on every rank;
    * along an axis a spec does not name, the ranks must hold the same shape and the
      same values (within 1e-5 of the absolute sum): an output declared ``P()`` whose
      blocks differ is a local shard labeled as the whole tensor;
    * along an axis that splits a dim, a plain argument's sizes (where plain arguments
      are blocks) must be blocks of one tensor (``torch.chunk``'s sizes of their sum)
      and an output's sizes equal (its global shape is read as the local one times the
      axis size).

    Partial axes are not compared (pending sums). The check costs one round of tiny
    collectives once per wrapped function; ``check=False`` skips it. With ``check`` on,
    every call also refuses, as JAX's ``check_vma`` does, an output that varies along an
    axis its out_spec neither names nor declares pending (computed from blocks split over
    it, or by ``all_gather``, ``ppermute``, ... over it), even where its blocks happen to
    be equal: its gradient would be counted once per rank of that axis.

    As in JAX, a plain or DTensor argument outside a model whose split dimension does not
    divide over its ranks is refused before anything is sent, and so is a ``shard_map``
    called inside another's function (that function is manual over every axis already).
    """
    name = _check_shard_map(fn, in_specs, out_specs, mesh, rules, check)
    single = isinstance(out_specs, P)
    outs_given = (out_specs,) if single else tuple(out_specs)
    pending = [bool(check)]

    @functools.wraps(fn)
    def wrapped(*args: Any):
        ins = (in_specs,) if isinstance(in_specs, P) else in_specs
        if ins is not None and len(ins) != len(args):
            raise SpecError(f"shard_map({name}): {len(ins)} in_specs for {len(args)} "
                            f"positional arguments; give one spec (or None) per argument")
        _not_nested(name)
        args = _arrays(args, ins, name)
        tgt = _target(mesh, rules, args, name)
        if tgt is None:
            with one_device(name):        # every named axis has one rank: same code, one process
                return fn(*args)
        res = _call(tgt, fn, args, (ins, outs_given), single, name, pending, bool(check))
        return res[0] if single else tuple(res)

    return wrapped


def remat(fn: Callable) -> Callable:
    """``jax.remat`` (``jax.checkpoint``): ``fn`` keeps none of its intermediate values
    for the backward, which runs it again (``torch.utils.checkpoint``, non-reentrant).

    Inside a ``shard_map`` function the recomputation runs in the backward, after the
    function returned; it runs under the function's region again, so its collectives by
    axis name and its gradient rules are the first run's. JAX's FSDP example gathers the
    weights in a rematerialized function, so the backward gathers them again instead of
    keeping them (the whole function is recomputed: JAX's ``policy=`` is not taken)."""
    if not callable(fn):
        raise SpecError(f"remat({fn!r}): give the function to recompute in the backward, "
                        f"e.g. ml.remat(lambda w: ml.all_gather(w, 'dp', tiled=True))")

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any):
        r, one, local = current_region(), on_one_device(), in_local_region()

        @contextlib.contextmanager
        def again():
            with contextlib.ExitStack() as stack:
                if local:
                    stack.enter_context(local_region())
                if one is not None:
                    stack.enter_context(one_device(one))
                if r is not None:
                    stack.enter_context(reenter(r))
                yield

        return checkpoint(fn, *args, use_reentrant=False,
                          context_fn=lambda: (contextlib.nullcontext(), again()), **kwargs)

    return wrapped
