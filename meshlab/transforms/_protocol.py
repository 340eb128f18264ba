"""The transform protocol: what a transform is, and what it may contribute.

A transform is a frozen value. Everything about it lives in its own room (a package
under ``meshlab/transforms/``), written against the hooks below, each optional:

=================  ======================================================================
``apply(plan)``    the pure plan step, ``Plan -> Plan`` (default: the plan as it is; the
                   transform is recorded in ``plan.options`` either way)
``claims(plan)``   the mesh axes it takes, by role: ``{'dp': ('dp',)}``
``rows(plan)``     the rows of the composition table (``composition``) it takes in the
                   bound ``plan`` (``plan=None``: those its value alone names); default
                   ``(kind,)``
``decide(plan)``   what it decides for the bound layout (a frozen value registered with
                   ``planning.decisions.register_decision``), recorded in
                   ``plan.decisions`` before any check and read everywhere after with
                   ``plan.decision(cls)``
``check(plan)``    model-free checks on the bound plan (fake or real mesh alike); raise a
                   ``MeshlabError`` naming the thing and the fix
``prepare(ctx)``   before the model is initialized (may add ``ctx.on_module`` and
                   ``ctx.after_init`` callbacks)
``install(ctx)``   at ``phase``: mutate the model; return a ``Part`` the runtime keeps
``memory(plan,     its share of ``plan.memory()``: returns the per-rank rows, changed or
rows)``            extended
``comm(plan,       its share of ``plan.comm()``: ``CommOp`` rows
...)``
``local_blocks(    the repeated blocks the rank at ``coord`` runs (``plan.local_blocks``),
plan, coord)``     or None for all of them (pipeline: its stages' blocks)
``profile(plan,    change the one-block meta copy the activation profile runs as
model)``           ``install`` would change the model (fused ops, checkpointing)
``activation_memory(  its share of the activation estimate: rewrite the per-rank
plan, rows, ...)`` ``ActRow``s (split by TP, multiplied by microbatches in flight)
``transients(      what it adds to the step's peak only (ZeRO's gathered parameters)
plan, ...)``
``work_share``,    its share of ``plan.time()``: the compute a rank does, how much of its
``hidden``,        collectives hide behind it, a pipeline's idle fraction, host work
``idle``,
``host_seconds``
=================  ======================================================================

``t1 | t2`` composes; two transforms of one kind (``kind``) refuse to compose unless the
kind is ``repeatable`` (where they take two rows of the composition table, with that
cell's reason) or the earlier one's ``combine(later)`` makes one value of the two (hybrid
sharding: ``data_parallel`` over one axis, ``zero_shard`` over another), which the plan
then holds in place of the earlier one. What composes with what is one table,
``composition``: every transform inherits ``composition_check(plan)``, which ``Plan.bind``
runs once for all the rows of all the rooms of a plan (a pair the table has as ``not yet``
raises ``ConfigError`` or is recorded in ``plan.not_runnable``, as its cell says), and
``|`` refuses a pair written in the order the table forbids. No room names another room's
kind: their own checks hold only conditions that are not pairs.

A transform written outside meshlab subclasses ``Transform`` as a frozen dataclass and
composes like a built-in one. It takes the row ``kind`` and declares that row's cells in a
class attribute, ``composition: ClassVar[Mapping[str, Cell]]`` (other row -> ``Cell``,
e.g. ``{'zero_shard(1)': composes('tests/test_mine.py::test_parity')}``); a row it names
no cell for is ``not yet``. ``composition.table()`` then lists it with meshlab's rows.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, ClassVar, Iterable, Mapping

import math

from ..planning.rows import CommOp as CommOp
from ..core.errors import ConfigError
from ..planning.rows import MemRow as MemRow
from ..planning.plan import Plan, option_type, register_option
from . import composition


class Phase(enum.IntEnum):
    """The fixed order in which ``materialize`` runs the install steps, and why each comes
    where it does (the order torchtitan's ``parallelize`` writes out: tensor parallelism,
    then activation checkpointing, then compile, then FSDP).
    """

    # peft wraps the target Linear modules before anything is sharded, so tensor
    # parallelism sees the adapters' A and B as parameters of the model and splits them
    # with their base weight
    ADAPTERS = 10
    # parameters become DTensors (tensor parallelism), module by module as each is
    # initialized; every room after this one sees the local shapes
    SHARD = 20
    # expert weights split over the expert axis and tokens dispatched to them, once tensor
    # parallelism has laid out the rest of each mixture-of-experts block
    EXPERTS = 25
    # forward hooks of the sharded modules (the activation layouts the specs name)
    HOOKS = 30
    # fused ops routed into the sharded modules (fuse) and the compute dtype (precision):
    # they need the final parameters and wrap no forward that a later room wraps again
    KERNELS = 40
    # checkpointing wraps each block's forward, the fused ops inside it, so the recompute
    # in the backward runs the same kernels
    REMAT = 50
    # torch.compile of each block compiles the checkpoint wrapper with it, and runs before
    # FSDP2, whose gather and reshard hooks must stay outside the compiled graphs
    COMPILE = 55
    # data parallelism and ZeRO (FSDP2's fully_shard on the finished blocks: each unit is a
    # compiled, checkpointed block; ZeRO-1's optimizer slices)
    DATA = 60
    # host residency of what DATA built: FSDP2's units, gradients and optimizer state
    OFFLOAD = 65
    # how the optimizer steps (in the backward, per parameter), hooked onto the final
    # parameters and gradients
    OPTIMIZER = 67
    # sequence-parallel attention routed in and the sequence cut at the blocks'
    # boundaries; it changes no parameter, so it follows every room that does
    SEQUENCE = 70
    # the pipeline splits the finished model into stages last, so every change the rooms
    # above made to the blocks travels with them
    SCHEDULE = 80
    # transforms written outside meshlab run after all of these unless they say otherwise
    USER = 90


class Part:
    """What an installed transform leaves with the runtime: its share of the step.

    What the backward does to the gradients is declared on the transform
    (``Transform.reductions``; ``GradSync`` runs it). ``sync_grads`` is for what only
    ``meshlab.optimizer`` can do (ZeRO-1's reduce-scatter into its fp32 slices), run in
    ``order``. The other hooks let a part own the optimizer's view of the parameters
    (ZeRO-1: ``optimizer_params``, ``stepped``, and for checkpoints ``state_to_save`` and
    ``load_saved_state``), add groups to the gradient norm (pipeline), or run the whole
    step (pipeline schedules).
    """

    order: ClassVar[int] = 0
    casts_params: ClassVar[bool] = False   # runs the forward in the compute dtype itself
    runs_step: ClassVar[bool] = False      # run_step runs the whole step (a pipeline schedule)

    def sync_grads(self, params: list) -> None:
        """Reduce the gradients of ``params`` (``[(fqn, parameter)]``) in place, in
        ``meshlab.optimizer``'s step (only what a plain optimizer cannot do)."""

    def optimizer_params(self, params: list, group_of: Mapping | None = None) -> list | None:
        """The tensors the inner optimizer updates instead of ``params`` (or None). With
        several parameter groups, ``group_of`` maps ``id(parameter)`` to its group: a
        tensor standing for several parameters stands for those of one group only.
        A part that declares a ``whole`` keyword gets ``whole=True`` for an optimizer that
        is not elementwise (it reduces over each tensor): each tensor it gives must then
        stand for one whole parameter (ZeRO-1 steps each on one owner); a part that gives
        such an optimizer slices of parameters has it refused by name."""
        return None

    def stepped(self) -> list:
        """``[(bucket, tensor)]``: each tensor the inner optimizer steps in place of model
        parameters (ZeRO-1: this rank's fp32 slice of a bucket) with the bucket of
        parameters it stands for (``bucket.params``); empty where the optimizer steps the
        parameters themselves."""
        return []

    def state_to_save(self, state: Mapping) -> list | None:
        """``[(parameter, key, tensor)]``: the inner optimizer's ``state`` of the tensors
        this part steps (``stepped``), given back per model parameter for a checkpoint
        (shaped like the parameter's local block, or a scalar such as the step count);
        None where this part steps no tensors of its own."""
        return None

    def load_saved_state(self, state: Mapping, read) -> bool:
        """Write a checkpoint's per-parameter state (``read(parameter, key)``, as
        ``state_to_save`` gave it) into the inner optimizer's ``state`` of the tensors this
        part steps; False where it steps none."""
        return False

    def make_optimizer(self, opt, cls: type, kwargs: dict, tensors: list):
        """The inner optimizer over ``tensors`` (what ``optimizer_params`` chose), or None
        for ``cls(tensors, **kwargs)``; ``offload`` splits it between host and device."""
        return None

    def refresh_master(self) -> None:
        """Copy the model's parameters into master copies a part keeps (after a load)."""

    def tensor_of(self, p):
        """The tensor the inner optimizer updates for model parameter ``p`` (its state's
        key): ``p``, or a copy the part keeps (offload's host master)."""
        return p

    def model_state(self) -> dict:
        """FQN -> the tensor that holds a parameter's value when it is not the parameter
        itself (offload's fp32 master of a bf16 device copy); checkpoints save that."""
        return {}

    def grad_items(self, items: list) -> list:
        """``[(local gradient, groups it is sharded over)]`` for norms and overflow."""
        return items

    def norm_groups(self) -> tuple:
        """Groups over which the summed squared norm is also all-reduced."""
        return ()

    def after_step(self) -> None:
        """Runs after the inner optimizer's update."""

    def set_gradient_sync(self, model, enabled: bool) -> None:
        """Microbatches before the last run with ``enabled=False``."""

    def compute_context(self, parts: tuple):
        """A context every forward runs in (``precision``'s autocast), or None."""
        return None

    def run_step(self, rt, opt, batch, loss_fn) -> float | None:
        """Run forward, backward and ``opt.step()`` for ``batch``; None leaves it to ``step``."""
        return None

    def evaluate(self, rt, batch, loss_fn) -> float | None:
        """Run the forward and loss of ``batch`` only (``step(..., train=False)``); None
        leaves it to ``step``."""
        return None


class Transform:
    """Base of every transform: a frozen dataclass implementing some of the hooks above."""

    kind: ClassVar[str] = ""
    repeatable: ClassVar[bool] = False
    phase: ClassVar[Phase] = Phase.USER

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if not cls.__dict__.get("kind"):
            cls.kind = cls.__name__.lower()
        if cls.kind not in ("compose", "identity"):
            register_option(cls.kind, cls)
        cells = cls.__dict__.get("composition")
        if cells is not None:               # a transform from outside meshlab: its own row
            composition.declare(cls.kind, cells)

    # -- the hooks ----------------------------------------------------------------------
    def apply(self, plan: Plan) -> Plan:
        return plan

    def claims(self, plan: Plan) -> Mapping[str, tuple[str, ...]]:
        return {}

    def combine(self, other: "Transform") -> "Transform | None":
        """The one value this transform and ``other``, a later one of its kind, make
        together (the plan holds it in place of this one), or None where a room holds only
        one of them; may raise ``ConfigError`` naming the fix for a pair that means
        nothing."""
        return None

    def rows(self, plan: Plan | None) -> tuple[str, ...]:
        """The rows of the composition table this transform takes in the bound ``plan``
        (with ``plan=None``, those its value alone names: what ``|`` reads); a transform
        whose variants compose differently names each (``zero_shard(3)``,
        ``offload(grads)``)."""
        return (self.kind,)

    def composition_check(self, plan: Plan) -> tuple[str, ...]:
        """Hold every pair of rows the rooms of the bound ``plan`` take against the
        composition table: raise ``ConfigError`` for the first pair (in the table's order)
        whose cell raises, and return the ``NotRunnable`` reasons, one per pair of
        transforms, for ``plan.not_runnable``. The same for every transform; ``Plan.bind``
        calls it once, through any room. A row two rooms take (Megatron SP: ``shard`` with
        seq -> tp, and ``sequence('split_gather')``) is named by the one that takes fewest
        rows, the transform written for it."""
        taken = {id(t): t.rows(plan) for t in plan.rooms}
        holder: dict[str, Transform] = {}
        for t in sorted(plan.rooms, key=lambda t: len(taken[id(t)])):
            for r in taken[id(t)]:
                holder.setdefault(r, t)
        known = composition.rows()
        names = [r for r in known if r in holder] + [r for r in holder if r not in known]
        ranks = math.prod(plan.mesh_shape[a] for a in plan.roles.dp)
        regions = any("tp_region" in a.tags for a in plan.activations)
        recorded: dict[frozenset, str] = {}
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                c = composition.cell(a, b)
                if not composition.applies(c, ranks, regions) or \
                        c.refusal == composition.AT_OPTIMIZER:
                    continue      # composes here (or meshlab.optimizer refuses it)
                text = composition.refusal(a, b, holder[a], holder[b], tp=plan.roles.tp,
                                           ranks=ranks)
                if c.refusal == composition.RAISES or c.status == composition.MEANINGLESS:
                    raise ConfigError(text)
                recorded.setdefault(frozenset((id(holder[a]), id(holder[b]))), text)
        return tuple(recorded.values())

    def decide(self, plan: Plan) -> Any:
        """What this room decides for the bound ``plan`` (which stages run which blocks,
        which tensors live on the host), or None: ``bind`` records it in
        ``plan.decisions`` once, before the checks, and every later step reads it with
        ``plan.decision(cls)`` instead of working it out again. ``plan`` holds the
        decisions of the rooms before this one in install order."""
        return None

    def check(self, plan: Plan) -> None:
        pass

    def prepare(self, ctx) -> None:
        pass

    def install(self, ctx) -> Part | None:
        return None

    def check_batch(self, plan: Plan, batch, layout) -> None:
        """Refuse, with ``ConfigError``, a batch this room cannot train as one process
        would (padding or packing its attention cannot read: ``layout`` is
        ``transforms._packing.layout_of(batch)``). ``meshlab.step`` calls it before the
        step's first collective, for the rooms that define it."""
        return None

    def reductions(self, plan: Plan) -> list:
        """The gradient ``Reduction``s (``_gradsync``) the backward runs for this room,
        from the plan alone: ``materialize`` installs them and ``plan.comm`` counts them."""
        return []

    def memory(self, plan: Plan, rows: list[MemRow]) -> list[MemRow]:
        return rows

    def comm(self, plan: Plan, *, batch: int | None, seq: int | None,
             coord: Mapping[str, int] | None) -> Iterable[CommOp]:
        return ()

    def local_blocks(self, plan: Plan, coord: Mapping[str, int] | None) -> tuple[str, ...] | None:
        """The blocks of ``plan.model.blocks`` the rank at ``coord`` runs (None: the room's
        default rank), or None when this room runs every block on every rank."""
        return None

    def profile(self, plan: Plan, model) -> dict | None:
        """Change ``model`` (a meta copy cut to one block, ``meshlab.estimate.profile``) the way
        ``install`` would, so the activation profile sees what this room changes; may
        return ``{'loss': loss_fn, 'contexts': [context managers the step runs in]}``."""
        return None

    def activation_memory(self, plan: Plan, rows: list, *, batch: int, seq: int) -> list:
        """Its share of the activation estimate: rewrite the per-rank ``ActRow``s."""
        return rows

    def transients(self, plan: Plan, *, batch: int, seq: int) -> list:
        """``ActRow``s this room adds to the step's peak only (gathered parameters)."""
        return []

    # -- its share of the step time (``meshlab.estimate.time``) ---------------------------------
    def work_share(self, plan: Plan, parts: dict) -> dict:
        """The compute one rank does: ``{'blocks': Work, 'rest': Work}`` rewritten."""
        return parts

    def hidden(self, plan: Plan, kind: str) -> float:
        """The fraction of this room's ``kind`` collectives hidden behind compute."""
        return 0.0

    def idle(self, plan: Plan, seconds: dict | None = None) -> float:
        """The fraction of the step the busiest rank waits (a pipeline's bubble), given
        the profiled ``seconds`` by part (``meshlab.estimate.time.part_seconds``) where known."""
        return 0.0

    def host_seconds(self, plan: Plan) -> float:
        """Seconds of host work a step adds after the backward (offload's step)."""
        return 0.0

    # -- composition --------------------------------------------------------------------
    def __call__(self, plan: Plan) -> Plan:
        if not isinstance(plan, Plan):
            from ..core.errors import ConfigTypeError

            raise ConfigTypeError(f"{self!r} takes a Plan, got {type(plan).__name__}; build one "
                                  f"with meshlab.plan(model, spec, mesh) or meshlab.trace(model)")
        _refuse_second(self, plan.options)
        _refuse_order(self, plan.options)
        out = self.apply(plan)
        prev = None if self.repeatable else next(
            (o for o in out.options if getattr(o, "kind", None) == self.kind), None)
        if prev is not None:            # combines with it (``_refuse_second`` let it pass)
            one = prev.combine(self)
            return dataclasses.replace(out, options=tuple(one if o is prev else o
                                                          for o in out.options),
                                       transforms=out.transforms + (repr(self),))
        return dataclasses.replace(out, options=out.options + (self,),
                                   transforms=out.transforms + (repr(self),))

    def __or__(self, other: "Transform") -> "Compose":
        if not isinstance(other, Transform):
            raise ConfigError(f"{self!r} | {other!r}: both sides of | must be transforms "
                              f"such as zero_shard(3) or precision('bf16'), not "
                              f"{type(other).__name__}")
        return Compose(_flat(self) + _flat(other))

    def __ror__(self, other):
        raise ConfigError(f"{other!r} | {self!r}: both sides of | must be transforms, not "
                          f"{type(other).__name__}")

    @property
    def parts(self) -> tuple["Transform", ...]:
        return (self,)

    # -- JSON ---------------------------------------------------------------------------
    def to_json(self) -> dict:
        """``{'kind': ..., <field>: <JSON value>}``; ``from_json`` reads it back."""
        return {"kind": self.kind, **{f.name: encode(getattr(self, f.name))
                                      for f in dataclasses.fields(self)}}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Transform":
        if d.get("kind") == "compose":
            return Compose(tuple(Transform.from_json(x) for x in d["transforms"]))
        cls = option_type(d.get("kind"))
        if cls.from_json.__func__ is not Transform.from_json.__func__:
            return cls.from_json(d)          # a transform with its own JSON form (shard)
        return cls._from_fields({k: decode(v) for k, v in d.items() if k != "kind"})

    @classmethod
    def _from_fields(cls, fields: dict) -> "Transform":
        return cls(**fields)


def _flat(t: Transform) -> tuple[Transform, ...]:
    """``t``'s transforms in order; ``identity()`` is the neutral element and drops out."""
    if isinstance(t, Identity):
        return ()
    return t.transforms if isinstance(t, Compose) else (t,)


def _refuse_second(t: Transform, earlier: Iterable[Transform]) -> None:
    """Refuse ``t`` after a transform of its kind (unless the kind is ``repeatable``): a
    room holds one. Where the two take different rows of the composition table whose
    cell refuses them (two ZeRO stages are ``meaningless``), the refusal gives that
    cell's reason. Two that ``combine`` into one value pass."""
    if t.repeatable:
        return
    for prev in earlier:
        if getattr(prev, "kind", None) != t.kind or prev.combine(t) is not None:
            continue
        text = (f"{prev!r} and {t!r}: two {t.kind} transforms in one spec; the second would "
                f"silently replace the first. Keep one")
        theirs, mine = prev.rows(None), t.rows(None)
        pair = None if set(theirs) & set(mine) else next(
            ((a, b) for a in theirs for b in mine if composition.cell(a, b).refused), None)
        if pair is not None:
            c = composition.cell(*pair)
            text += f"; {c.reason} {composition.label(*pair, c)}"
        raise ConfigError(text)


def _refuse_order(t: Transform, earlier: Iterable[Transform]) -> None:
    """Refuse ``t`` after a transform whose row the composition table says must come
    after ``t``'s (``lora`` after ``shard``: the sharding reads the model before adapters)."""
    for prev in earlier:
        for a in prev.rows(None):
            for b in t.rows(None):
                if a != b and composition.cell(a, b).before == b:
                    raise ConfigError(composition.refusal(a, b, prev, t))


@dataclasses.dataclass(frozen=True)
class Compose(Transform):
    """``t1 | t2 | ...``: apply left to right."""

    kind: ClassVar[str] = "compose"
    transforms: tuple[Transform, ...]

    def __post_init__(self):
        seen: list[Transform] = []
        for t in self.transforms:
            _refuse_second(t, seen)
            seen.append(t)

    def __call__(self, plan: Plan) -> Plan:
        for t in self.transforms:
            plan = t(plan)
        return plan

    def apply(self, plan: Plan) -> Plan:
        return self(plan)

    @property
    def parts(self) -> tuple[Transform, ...]:
        return self.transforms

    def to_json(self) -> dict:
        return {"kind": "compose", "transforms": [t.to_json() for t in self.transforms]}

    def __repr__(self) -> str:
        return " | ".join(repr(t) for t in self.transforms)


@dataclasses.dataclass(frozen=True)
class Identity(Transform):
    """The transform that changes nothing (a neutral element for ``|``)."""

    kind: ClassVar[str] = "identity"

    def __call__(self, plan: Plan) -> Plan:
        return plan

    def __repr__(self) -> str:
        return "identity()"


# -- field codec: the few value types transforms hold ---------------------------------
def encode(v: Any) -> Any:
    from ..core.rules import Rules
    from ..core.spec import P

    if isinstance(v, P):
        return {"P": v.to_json()}
    if isinstance(v, Rules):
        return {"Rules": v.to_json()}
    if isinstance(v, Transform):
        return {"transform": v.to_json()}
    if isinstance(v, Mapping):
        return {"map": [[encode(k), encode(x)] for k, x in v.items()]}
    if isinstance(v, (tuple, list)):
        return {"tuple": [encode(x) for x in v]}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    enc = getattr(v, "to_json", None)
    if enc is None:
        raise ConfigError(f"{type(v).__name__} {v!r} cannot be written as JSON; give the "
                          f"transform a to_json/_from_fields pair")
    return {"value": type(v).__name__, "json": enc()}


def decode(v: Any) -> Any:
    from ..core.rules import Rules
    from ..core.spec import P

    if not isinstance(v, dict):
        return v
    if "P" in v:
        return P.from_json(v["P"])
    if "Rules" in v:
        return Rules.from_json(v["Rules"])
    if "transform" in v:
        return Transform.from_json(v["transform"])
    if "map" in v:
        return {decode(k): decode(x) for k, x in v["map"]}
    if "tuple" in v:
        return tuple(decode(x) for x in v["tuple"])
    return v
