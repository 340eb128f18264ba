"""Plan: the immutable per-FQN table that every transform reads and returns.

A plan is built by tracing a module on the meta device (``trace``); transforms
(``shard``, ``zero_shard``, ...) return new plans; ``bind(mesh)`` resolves logical specs
against a mesh and checks every entry once. Plans print as rich tables, diff against each
other, round-trip through JSON and estimate per-rank memory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from ..core.units import DTYPE_BYTES as DTYPE_BYTES, dtype_bytes as dtype_bytes, dtype_name as dtype_name
from ..core.errors import (ConfigError, MeshlabError, NotRunnable, PlanError,
                      check_choice, check_int)
from ..core.placement import local_shape
from .roles import AxisRoles, derive_roles, implied_rooms
from ..core.rules import Rules
from ..core.spec import P
from ._bind import bind_activations, bind_params
from .decisions import decision_from_json, decision_to_json
from .rows import OPTIMIZER_STATES


# The tag of a parameter every room keeps whole and in its dtype: bitsandbytes' packed
# 4-bit weights (``lora(quantize=...)``), which FSDP2 leaves unsharded and no cast touches.
KEEP_WHOLE = "keep_whole"


@dataclasses.dataclass(frozen=True, slots=True)
class ParamEntry:
    """One parameter: where it lives in the model and how it is laid out.

    ``spec`` is what the user or policy wrote (logical or mesh axes); ``mesh_spec`` is
    set by ``bind`` to the same spec in mesh axes. ``tags`` carry a policy's style
    (``'colwise'``, ``'replicated_with_grad_allreduce'``, ...) for the materializer, and
    ``KEEP_WHOLE`` for a parameter no room may split or cast (a 4-bit packed base weight).
    """

    fqn: str
    shape: tuple[int, ...]
    dtype: str
    spec: P = P()
    requires_grad: bool = True
    tied_to: str | None = None
    module: str = ""
    tags: tuple[str, ...] = ()
    mesh_spec: P | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def to_json(self) -> dict:
        d = {"fqn": self.fqn, "shape": list(self.shape), "dtype": self.dtype,
             "spec": self.spec.to_json(), "requires_grad": self.requires_grad,
             "tied_to": self.tied_to, "module": self.module, "tags": list(self.tags)}
        if self.mesh_spec is not None:
            d["mesh_spec"] = self.mesh_spec.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict) -> "ParamEntry":
        return cls(d["fqn"], tuple(d["shape"]), d["dtype"], P.from_json(d["spec"]),
                   d["requires_grad"], d["tied_to"], d["module"], tuple(d["tags"]),
                   P.from_json(d["mesh_spec"]) if "mesh_spec" in d else None)


@dataclasses.dataclass(frozen=True, slots=True)
class ActivationEntry:
    """A module boundary: the layout of the module's output (and, if given, its input)."""

    module: str
    output: P | None = None
    input: P | None = None
    shape: tuple[int, ...] | None = None
    tags: tuple[str, ...] = ()
    local_attrs: tuple[str, ...] = ()   # integer attributes that hold per-rank sizes under TP

    def to_json(self) -> dict:
        return {"module": self.module,
                "output": None if self.output is None else self.output.to_json(),
                "input": None if self.input is None else self.input.to_json(),
                "shape": None if self.shape is None else list(self.shape),
                "tags": list(self.tags), "local_attrs": list(self.local_attrs)}

    @classmethod
    def from_json(cls, d: dict) -> "ActivationEntry":
        return cls(d["module"], None if d["output"] is None else P.from_json(d["output"]),
                   None if d["input"] is None else P.from_json(d["input"]),
                   None if d["shape"] is None else tuple(d["shape"]), tuple(d["tags"]),
                   tuple(d.get("local_attrs", ())))


@dataclasses.dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a plan knows of the model it was traced from (JSON-able)."""

    cls: str = ""
    model_type: str | None = None
    base_prefix: str = ""
    blocks: tuple[str, ...] = ()          # FQNs of the repeated blocks, in order
    config: tuple[tuple[str, Any], ...] = ()  # a JSON-able subset of the HF config
    tp_plan: tuple[tuple[str, str], ...] = ()  # the config's base_model_tp_plan
    modules: tuple["ModuleInfo", ...] = ()   # every module: its kind and integer attributes
    head: str | None = None                  # the output embedding (get_output_embeddings)
    # (op, why) for each op ``fuse(...)`` would refuse to route in this model, found by its
    # plan step on the traced module; empty where that step had no module (a traced plan
    # read back from JSON), and then only the install checks
    fuse_refusals: tuple[tuple[str, str], ...] = ()
    # the ops among those that find nothing in the model to route (``fuse()`` leaves them)
    fuse_absent: tuple[str, ...] = ()

    def config_get(self, key: str, default: Any = None) -> Any:
        return dict(self.config).get(key, default)

    def module(self, fqn: str) -> "ModuleInfo | None":
        return next((m for m in self.modules if m.fqn == fqn), None)

    def to_json(self) -> dict:
        return {"cls": self.cls, "model_type": self.model_type, "base_prefix": self.base_prefix,
                "blocks": list(self.blocks), "config": dict(self.config),
                "tp_plan": dict(self.tp_plan), "modules": [m.to_json() for m in self.modules],
                "head": self.head, "fuse_refusals": dict(self.fuse_refusals),
                "fuse_absent": list(self.fuse_absent)}

    @classmethod
    def from_json(cls, d: dict) -> "ModelInfo":
        return cls(d["cls"], d["model_type"], d["base_prefix"], tuple(d["blocks"]),
                   tuple(d["config"].items()), tuple(d["tp_plan"].items()),
                   tuple(ModuleInfo.from_json(m) for m in d.get("modules", ())), d.get("head"),
                   tuple(d.get("fuse_refusals", {}).items()), tuple(d.get("fuse_absent", ())))


@dataclasses.dataclass(frozen=True, slots=True)
class ModuleInfo:
    """What the layout needs of one module without the module: its kind (``linear``,
    ``embedding``, ``conv1d`` or ``''``), class name and integer attributes."""

    fqn: str
    cls: str
    kind: str = ""
    ints: tuple[tuple[str, int], ...] = ()

    def get(self, attr: str) -> int | None:
        return dict(self.ints).get(attr)

    def to_json(self) -> list:
        return [self.fqn, self.cls, self.kind, [list(x) for x in self.ints]]

    @classmethod
    def from_json(cls, d: list) -> "ModuleInfo":
        return cls(d[0], d[1], d[2], tuple((k, v) for k, v in d[3]))


# The estimates are functions of a plan in the layer above the rooms (``meshlab.estimate``);
# that layer hands them over here when it is imported (``import meshlab`` does), so
# ``plan.memory()`` / ``comm()`` / ``time()`` stay the public spelling while this value
# imports no estimator.
_ESTIMATORS: dict[str, Callable] = {}


def register_estimator(name: str, fn: Callable) -> None:
    """Make ``plan.<name>(...)`` call ``fn(plan, ...)`` (``memory``, ``comm``, ``time``)."""
    _ESTIMATORS[name] = fn


def _estimator(name: str) -> Callable:
    fn = _ESTIMATORS.get(name)
    if fn is None:
        raise PlanError(f"plan.{name}(): the estimators are not loaded; import meshlab (or "
                        f"meshlab.estimate) first")
    return fn


_OPTION_TYPES: dict[str, type] = {}


def register_option(kind: str, cls: type) -> None:
    """Make ``cls`` (a transform type) readable from plan JSON under ``kind``."""
    _OPTION_TYPES.setdefault(kind, cls)


def option_type(kind: str) -> type:
    """The transform type registered under ``kind`` (plans and specs read from JSON)."""
    cls = _OPTION_TYPES.get(kind)
    if cls is None:
        raise PlanError(f"the plan names a transform of kind {kind!r} that is not defined "
                        f"here (known: {sorted(_OPTION_TYPES)}); import its module first")
    return cls


def _option_from_json(d: Mapping) -> Any:
    return option_type(d.get("kind")).from_json(d)


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """An immutable table: parameters, activation boundaries, rules and options.

    ``options`` are the transform values applied, in order (``plan.get(ZeroShard)``);
    ``transforms`` their reprs. ``bind`` adds the mesh, the axis ``roles``, ``rooms``:
    every transform the plan runs, implied ones included, in install order, and
    ``decisions``: what those rooms decided for this layout (a pipeline's stages, offload's
    host set, the experts each rank holds), looked up by type with ``plan.decision(cls)``
    and read from there by everything downstream.
    """

    params: tuple[ParamEntry, ...]
    activations: tuple[ActivationEntry, ...] = ()
    rules: Rules | None = None
    model: ModelInfo = ModelInfo()
    options: tuple[Any, ...] = ()
    transforms: tuple[str, ...] = ()
    mesh: tuple[tuple[str, int], ...] | None = None
    uneven: bool = False
    roles: AxisRoles | None = None
    rooms: tuple[Any, ...] = ()
    decisions: tuple[Any, ...] = ()
    not_runnable: tuple[str, ...] = ()   # why parallelize cannot run this layout, if it cannot
    # The traced module, for the estimates that run it on fake tensors (activations, time)
    # and for fuse()'s probes; not part of the value: never compared, printed or written
    # to JSON.
    source: Any = dataclasses.field(default=None, compare=False, repr=False)

    # -- lookup --------------------------------------------------------------------------
    def __getitem__(self, fqn: str) -> ParamEntry:
        for e in self.params:
            if e.fqn == fqn:
                return e
        raise KeyError(f"{fqn!r} is not a parameter of this plan")

    def __iter__(self):
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)

    @property
    def fqns(self) -> tuple[str, ...]:
        return tuple(e.fqn for e in self.params)

    def get(self, cls: type):
        """The transform of type ``cls`` this plan runs (bound: implied ones too), or None."""
        for t in self.rooms or self.options:
            if isinstance(t, cls):
                return t
        return None

    def decision(self, cls: type):
        """The decision of type ``cls`` a room recorded in ``bind`` (``Transform.decide``),
        or None where no room of this plan makes one. An unbound plan has no decisions:
        asking one raises ``PlanError``."""
        if self.mesh is None:
            raise PlanError(f"plan.decision({cls.__name__}): this plan is not bound to a mesh, "
                            f"and the rooms decide at bind time; call plan.bind(mesh) (or "
                            f"meshlab.plan(model, spec, mesh)) first")
        for d in self.decisions:
            if isinstance(d, cls):
                return d
        return None

    def replace(self, **kw) -> "Plan":
        return dataclasses.replace(self, **kw)

    @property
    def is_bound(self) -> bool:
        return self.mesh is not None

    @property
    def mesh_shape(self) -> dict[str, int]:
        if self.mesh is None:
            raise PlanError("this plan is not bound to a mesh; call plan.bind(mesh) first")
        return dict(self.mesh)

    # -- binding -------------------------------------------------------------------------
    def bind(self, mesh, *, uneven: bool | None = None) -> "Plan":
        """Resolve every spec against ``mesh``, derive the axis roles and run every
        transform's check; returns a bound plan. Fake and real meshes are checked alike.

        Raises ``SpecError`` naming the FQN, shape, spec, axis and the fix for an unknown
        axis, a spec longer than its tensor, axes out of mesh order, or (unless
        ``uneven=True``) a dimension its shard count does not divide; ``ConfigError`` for
        a combination of transforms that cannot run (the composition table's pairs are
        held by ``composition_check``, which every transform inherits).
        """
        from ..core.mesh import MeshBase

        uneven = self.uneven if uneven is None else uneven
        axes = mesh.axis_names if isinstance(mesh, MeshBase) else tuple(n for n, _ in mesh)
        sizes = mesh.shape if isinstance(mesh, MeshBase) else dict(mesh)
        rules = self.rules or Rules()
        out = bind_params(self.params, rules, axes, sizes, self.model, uneven)
        acts = bind_activations(self.activations, rules, axes)
        bound = dataclasses.replace(self, params=out, activations=acts,
                                    mesh=tuple(sizes.items()), uneven=uneven, rooms=(),
                                    decisions=())
        roles = derive_roles(bound, sizes)
        rooms = self.options + implied_rooms(bound.replace(roles=roles), roles)
        rooms = tuple(sorted(_unique_rooms(rooms), key=lambda t: t.phase))
        bound = bound.replace(roles=roles, rooms=rooms)
        # Each room decides once, in install order, seeing what the rooms before it decided
        # (offload's auto selection reads the memory rows of the rooms before it); the
        # checks then read those decisions, as does everything after bind.
        for t in rooms:
            decided = t.decide(bound)
            if decided is not None:
                bound = bound.replace(decisions=bound.decisions + (decided,))
        blocked = [_unused_message(a, sizes[a]) for a in roles.replicated(sizes)]
        # What composes with what is one table (meshlab.transforms.composition), read once
        # for every pair of rows the rooms take, before each room's own checks.
        if rooms:
            blocked += rooms[0].composition_check(bound)
        for t in rooms:
            try:
                t.check(bound)
            except NotRunnable as e:
                blocked.append(str(e))
        return bound.replace(not_runnable=tuple(blocked))

    @property
    def runnable(self) -> bool:
        """Whether ``parallelize`` can run this bound plan (else ``not_runnable`` says why)."""
        return self.is_bound and not self.not_runnable

    def unused_axes(self) -> tuple[str, ...]:
        """Mesh axes of size > 1 that no role uses: replica axes, along which every rank
        holds and computes the same (bound plans only)."""
        if self.roles is None:
            return tuple(a for a, s in self.mesh_shape.items() if s > 1)
        return self.roles.replicated(self.mesh_shape)

    # -- layout queries ------------------------------------------------------------------
    def local_shape(self, fqn: str) -> tuple[int, ...]:
        e = self[fqn]
        return local_shape(e.shape, e.mesh_spec if e.mesh_spec is not None else P(),
                           self.mesh_shape)

    # -- memory --------------------------------------------------------------------------
    def memory(self, *, optimizer: str = "adamw", batch: int | None = None,
               seq: int | None = None, inputs: Callable | None = None,
               loss: Callable | None = None):
        """Per-rank bytes of parameters, gradients and optimizer state (a bound plan); with
        the per-data-parallel-rank ``batch`` and ``seq``, also the activations saved for
        backward and the step's peak (``meshlab.estimate.activations``), counted on one
        step of the model: called with token ids, or for a model of your own with what
        ``inputs(batch, seq)`` returns (a tensor, a tuple of arguments or a dict of keyword
        arguments), its loss ``loss(output, args)`` (``meshlab.estimate.example``)."""
        check_choice(optimizer, "plan.memory", "optimizer", sorted(OPTIMIZER_STATES))
        self._need_bound("memory")
        if (batch is None) != (seq is None):
            raise ConfigError("plan.memory(batch=, seq=): give both (the per-data-parallel-"
                              "rank batch and the sequence length) or neither")
        return _estimator("memory")(self, optimizer=optimizer, batch=batch, seq=seq,
                                    inputs=inputs, loss=loss)

    def time(self, *, batch: int, seq: int, gpu="h200", inputs: Callable | None = None,
             loss: Callable | None = None):
        """Predicted seconds of one training step per rank on ``gpu`` (a preset name such
        as ``'h200'``, a ``meshlab calibrate`` JSON file or a ``Machine``), for ``batch``
        sequences of ``seq`` tokens per data-parallel rank (``meshlab.estimate.time``);
        ``inputs`` and ``loss`` as ``memory``'s."""
        self._need_bound("time")
        return _estimator("time")(self, batch=batch, seq=seq, gpu=gpu, inputs=inputs,
                                  loss=loss)

    def comm(self, *, batch: int | None = None, seq: int | None = None,
             coord: dict[str, int] | None = None, inputs: Callable | None = None,
             loss: Callable | None = None):
        """Per-step collectives per rank (a bound plan); give the per-data-parallel-rank
        ``batch`` and ``seq`` to include activation traffic (see ``meshlab.estimate.comm``;
        ``inputs`` and ``loss`` as ``memory``'s, for a model whose config gives no hidden
        size)."""
        self._need_bound("comm")
        batch, seq, coord = self._comm_args(batch, seq, coord)
        return _estimator("comm")(self, batch=batch, seq=seq, coord=coord, inputs=inputs,
                                  loss=loss)

    def local_blocks(self, coord: Mapping[str, int] | None = None) -> tuple[str, ...]:
        """The repeated blocks (``model.blocks``, in order) the rank at mesh ``coord`` runs:
        every block unless a room splits them (``pipeline``: its stages' blocks). Without
        ``coord`` (or without that room's axis in it) the room picks its rank, the one
        ``plan.comm()`` counts by default. What comes before the first block (embeddings)
        runs on the rank that runs the first block, what comes after the last (final norm,
        head, loss) on the one that runs the last."""
        self._need_bound("local_blocks")
        blocks = self.model.blocks
        for t in self.rooms:
            hook = getattr(t, "local_blocks", None)
            mine = hook(self, coord) if hook is not None else None
            if mine is not None:
                keep = set(mine)
                blocks = tuple(b for b in blocks if b in keep)
        return blocks

    def _need_bound(self, what: str) -> None:
        if self.mesh is None:
            raise PlanError(f"plan.{what}(): this plan is not bound to a mesh; estimate a plan "
                            f"from meshlab.plan(model, spec, mesh), or call plan.bind(mesh)")

    def _comm_args(self, batch, seq, coord):
        """``comm``'s arguments checked: ``batch`` and ``seq`` positive integers given
        together (one alone would be ignored), ``coord`` a position on this plan's mesh."""
        if (batch is None) != (seq is None):
            given = "batch" if seq is None else "seq"
            raise ConfigError(f"plan.comm({given}=...): activation traffic needs both batch= "
                              f"(per data-parallel rank) and seq=; pass both, or neither for "
                              f"the gradient traffic alone")
        if batch is not None:
            batch = check_int(batch, "plan.comm", "batch", example=8)
            seq = check_int(seq, "plan.comm", "seq", example=2048)
        if coord is None:
            return batch, seq, None
        sizes = self.mesh_shape
        if not isinstance(coord, Mapping) or any(k not in sizes for k in coord):
            raise ConfigError(f"plan.comm(coord={coord!r}): coord maps mesh axes "
                              f"{tuple(sizes)} to positions, e.g. "
                              f"{ {a: 0 for a in sizes}!r}")
        return batch, seq, {a: check_int(i, "plan.comm", f"coord[{a!r}]", low=0,
                                         high=sizes[a] - 1) for a, i in coord.items()}

    # -- presentation --------------------------------------------------------------------
    def table(self, *, collapse: bool = True, max_rows: int = 200):
        from .view import plan_table

        return plan_table(self, collapse=collapse, max_rows=max_rows)

    def __rich__(self):
        return self.table()

    def __str__(self) -> str:
        from .view import render_text

        return render_text(self.table())

    def __repr__(self) -> str:
        """One line (model, mesh, counts, transforms, refusals); ``str`` is the table."""
        from .view import plan_repr

        return plan_repr(self)

    def _repr_html_(self) -> str:
        """The notebook view: refusals, transforms, parameter table, memory per rank."""
        from .view import plan_html

        return plan_html(self)

    def diff(self, other: "Plan"):
        """What changes from ``self`` to ``other``: per FQN, the options, the mesh, and
        between bound plans what one rank holds (``meshlab.planning.diff.PlanDiff``)."""
        from .diff import diff_plans

        return diff_plans(self, other)

    # -- JSON ----------------------------------------------------------------------------
    def to_json(self, **dump_kw) -> str:
        d = {
            "format": "meshlab.plan/1",
            "params": [e.to_json() for e in self.params],
            "activations": [a.to_json() for a in self.activations],
            "rules": None if self.rules is None else self.rules.to_json(),
            "model": self.model.to_json(),
            "options": [t.to_json() for t in self.options],
            "transforms": list(self.transforms),
            "mesh": None if self.mesh is None else [[n, s] for n, s in self.mesh],
            "uneven": self.uneven,
            "roles": None if self.roles is None else self.roles.to_json(),
            "rooms": [t.to_json() for t in self.rooms],
            "decisions": [decision_to_json(x) for x in self.decisions],
            "not_runnable": list(self.not_runnable),
        }
        return json.dumps(d, **dump_kw)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Plan":
        """The plan ``to_json`` wrote. Text that is not JSON, or JSON that is not a
        meshlab plan, raises ``PlanError`` saying what is wrong."""
        if not isinstance(text, (str, bytes, bytearray)):
            raise PlanError(f"Plan.from_json: expected the JSON text plan.to_json() writes, "
                            f"got {type(text).__name__}")
        try:
            d = json.loads(text)
        except (ValueError, UnicodeDecodeError) as e:
            raise PlanError(f"Plan.from_json: the text is not JSON ({e}); pass what "
                            f"plan.to_json() wrote") from None
        if not isinstance(d, dict) or d.get("format") != "meshlab.plan/1":
            fmt = d.get("format") if isinstance(d, dict) else None
            raise PlanError(f"not a meshlab plan (format {fmt!r}); expected "
                            f"'meshlab.plan/1', as plan.to_json() writes")
        try:
            return cls._from_dict(d)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            if isinstance(e, MeshlabError):
                raise
            raise PlanError(f"Plan.from_json: a meshlab.plan/1 document with a missing or "
                            f"malformed field ({type(e).__name__}: {e}); pass what "
                            f"plan.to_json() wrote, unedited") from None

    @classmethod
    def _from_dict(cls, d: dict) -> "Plan":
        return cls(
            params=tuple(ParamEntry.from_json(e) for e in d["params"]),
            activations=tuple(ActivationEntry.from_json(a) for a in d["activations"]),
            rules=None if d["rules"] is None else Rules.from_json(d["rules"]),
            model=ModelInfo.from_json(d["model"]),
            options=tuple(_option_from_json(o) for o in d["options"]),
            transforms=tuple(d["transforms"]),
            mesh=None if d["mesh"] is None else tuple((n, s) for n, s in d["mesh"]),
            uneven=d["uneven"],
            roles=None if d.get("roles") is None else AxisRoles.from_json(d["roles"]),
            rooms=tuple(_option_from_json(o) for o in d.get("rooms", ())),
            decisions=tuple(decision_from_json(x) for x in d.get("decisions", ())),
            not_runnable=tuple(d.get("not_runnable", ())),
        )


def _unused_message(a: str, size: int) -> str:
    return (f"mesh axis {a!r} (size {size}) is used by no transform: no parameter is sharded "
            f"over it and it carries no data parallelism. Add zero_shard(stage, axis={a!r}) or "
            f"data_parallel({a!r}), map the batch to it in Rules, or give it size 1")


def _unique_rooms(rooms) -> list:
    """One room per kind: repeatable kinds (several ``shard``s) install once."""
    out, kinds = [], set()
    for t in rooms:
        if t.kind in kinds:
            continue
        kinds.add(t.kind)
        out.append(t)
    return out
