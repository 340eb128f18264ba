"""zero_shard and data_parallel: what is split or replicated over the data-parallel axes.

The room: ``ZeroShard`` (claims the ``dp`` role), its checks, its install (FSDP2
``fully_shard`` for stages 2 and 3; meshlab's flat sharded optimizer for stage 1, in
``_zero1``), its gradient sync (all-reduce, reduce-scatter, or what FSDP2 left), its
memory rows and its traffic. Plain data parallelism implied by the rules (the batch
maps to an axis no transform claims) is this room at stage 0; parameter specs that shard
over such an axis (``P('fsdp', 'tp')``) make it stage 3 with FSDP2 sharding each
parameter on the dimension its spec names.

Plain data parallelism and ZeRO-1 whose parameters rest on the host (``data_parallel('dp')
| offload(params=...)``, ``zero_shard(1) | offload(params=...)``) run on FSDP2 too, as
hybrid sharding over the data axes and a size-1 shard dimension: each unit's gradient is
all-reduced over the data axes as stage 0 does, and FSDP2 keeps the units ``offload``
names on the host between their uses. ZeRO-1 then steps its slices of those averaged
gradients (no reduce-scatter) and all-gathers the updated slices into the parameters,
wherever they rest.

Under a 16-bit ``precision`` FSDP2's mixed precision casts the parameters it manages to
the compute dtype for the forward and reduces their gradients in the reduction dtype,
keeping float32 shards for the optimizer. The parameters it leaves whole (``fsdp_ignored``:
a packed q|k|v projection tensor parallelism already strides) get the same: they stay
float32, each module that holds one reads it cast for its forward (``cast_whole``, a
differentiable cast), and the backward averages their gradients over the data axes in
that reduction dtype (``reductions``).

Hybrid sharding (PyTorch's HSDP, torchtitan's ``dp_replicate`` x ``dp_shard``):
``data_parallel('rep') | zero_shard(s, 'dp')`` combine into one value,
``zero_shard(s, 'dp', replicate='rep')``: the batch is split over both axes, the state is
replicated over ``rep`` and sharded over ``dp``. Stages 2 and 3 run FSDP2 on the 2-D mesh
``(rep, dp)`` (it reduce-scatters over ``dp``, then all-reduces the shards over ``rep``);
stage 1 all-reduces the gradients over ``rep`` from the backward, then reduce-scatters them
into its slices over ``dp``. Either way each gradient is the mean over the global batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from ...core.errors import ConfigError, NotRunnable, check_int, check_names, check_number
from ...planning.plan import Plan
from ...planning.roles import implied_room
from .._protocol import Phase, Transform
from ._batchnorm import BatchStatistics, choose as choose_batch_statistics
from ._estimates import zero_comm, zero_memory, zero_transients
from .._gradsync import BUCKET_MB, Reduction
from .._install import shared_module
from ._install import (HostResidency as HostResidency, HostUnits as HostUnits, fsdp_ignored,
                       install_zero)


def _axes(axis, call: str = "zero_shard") -> tuple[str, ...]:
    """``axis`` as a tuple of distinct mesh axis names."""
    return check_names(axis, call, "axis")


def _stage(stage) -> int:
    """ZeRO's stage, 0 to 3; a bool or a float (``True``, ``1.0``) is refused."""
    return check_int(stage, "zero_shard", "stage", low=0, high=3, example=1)


@dataclasses.dataclass(frozen=True)
class ZeroShard(Transform):
    """ZeRO over ``axis``: stage 1 shards optimizer state, 2 also gradients, 3 also
    parameters. Stages 2 and 3 run on FSDP2 ``fully_shard``; stage 1 is meshlab's own
    sharded optimizer. Stage 0 is plain data parallelism (gradients all-reduced)."""

    kind: ClassVar[str] = "zero"
    phase: ClassVar[Phase] = Phase.DATA

    stage: int
    axis: tuple[str, ...] = ("dp",)
    bucket_mb: float = BUCKET_MB       # the gradient all-reduce buckets (stage 0, leftovers)
    replicate: tuple[str, ...] = ()    # hybrid sharding: data axes the state is replicated on
    reshard: float = 1.0               # stage 3: the share of blocks freed after the forward

    def __post_init__(self):
        object.__setattr__(self, "stage", _stage(self.stage))
        object.__setattr__(self, "reshard", check_number(
            self.reshard, "zero_shard", "reshard", example=0.5, allow_zero=True))
        if not 0.0 <= self.reshard <= 1.0:
            raise ConfigError(f"zero_shard(reshard={self.reshard!r}): the share of blocks "
                              f"whose parameters are freed after the forward, from 0.0 to "
                              f"1.0, e.g. reshard=0.5")
        if self.stage != 3 and self.reshard != 1.0:
            raise ConfigError(f"zero_shard({self.stage}, reshard={self.reshard!r}): only "
                              f"stage 3 frees parameters after the forward; use "
                              f"zero_shard(3, reshard={self.reshard!r})")
        object.__setattr__(self, "axis", _axes(self.axis))
        object.__setattr__(self, "bucket_mb", check_number(
            self.bucket_mb, "zero_shard", "bucket_mb", example=25.0))
        rep = () if self.replicate in ((), [], None) else _axes(self.replicate, "zero_shard")
        object.__setattr__(self, "replicate", rep)
        if rep and self.stage == 0:
            raise ConfigError(f"zero_shard(0, {_name(self.axis)!r}, replicate={_name(rep)!r}): "
                              f"plain data parallelism replicates over every data axis; use "
                              f"data_parallel({rep + self.axis!r})")
        if set(rep) & set(self.axis):
            raise ConfigError(_same_axis(rep, self))

    def claims(self, plan: Plan):
        """The data axes: the replicate ones and the sharded ones, in mesh order."""
        mine = set(self.replicate + self.axis)
        return {"dp": tuple(a for a in plan.mesh_shape if a in mine)
                if self.replicate and plan.mesh is not None else self.replicate + self.axis}

    def rows(self, plan: Plan | None) -> tuple[str, ...]:
        """``data_parallel`` at stage 0, else ``zero_shard(stage)``; both under hybrid
        sharding (``replicate``)."""
        if self.stage == 0:
            return ("data_parallel",)
        return (("data_parallel",) if self.replicate else ()) + (f"zero_shard({self.stage})",)

    def combine(self, other):
        """``data_parallel(rep) | zero_shard(s, axis)`` (either order): hybrid sharding,
        ``zero_shard(s, axis, replicate=rep)``. The same axis in both is refused."""
        if not isinstance(other, ZeroShard) or self.replicate or other.replicate or \
                (self.stage == 0) == (other.stage == 0):
            return None
        dp, zero = (self, other) if self.stage == 0 else (other, self)
        if set(dp.axis) & set(zero.axis):
            raise ConfigError(_same_axis(dp.axis, zero))
        mb = {b for b in (dp.bucket_mb, zero.bucket_mb) if b != BUCKET_MB}
        if len(mb) > 1:
            raise ConfigError(f"{self!r} and {other!r}: two gradient bucket sizes for one "
                              f"data-parallel room; give bucket_mb to one of them")
        return ZeroShard(zero.stage, zero.axis, mb.pop() if mb else BUCKET_MB, dp.axis,
                         zero.reshard)

    def decide(self, plan: Plan) -> BatchStatistics | None:
        """The BatchNorm modules whose statistics are the whole batch's, over the data
        axes (``_batchnorm``), or None where the model has none or the batch is whole."""
        from ..precision import Precision

        prec = plan.get(Precision)
        cast = self.fsdp(plan) and prec is not None and prec.compute != "float32"
        return choose_batch_statistics(plan, cast)

    def check(self, plan: Plan) -> None:
        for a in self.axis + self.replicate:
            if a not in plan.mesh_shape:
                raise ConfigError(f"zero_shard/data-parallel axis {a!r} is not a mesh axis "
                                  f"{tuple(plan.mesh_shape)}; use one of those")
        if self.replicate:
            _check_hybrid(self, plan)
        fsdp = plan.roles.fsdp
        if fsdp and self.stage != 3:
            e = next(e for e in plan.params if set(e.mesh_spec.axes) & set(fsdp))
            raise ConfigError(
                f"{e.fqn}: {e.spec!r} shards a parameter over {fsdp[0]!r}, the axis "
                f"{self!r} keeps parameters whole on; use zero_shard(3, {fsdp[0]!r}) (FSDP) or "
                f"map that logical axis to None in Rules")
        if fsdp:
            _check_fsdp_specs(plan, fsdp)
        twice = shared_module(plan.source, plan.model.blocks) if self.fsdp(plan) else None
        if twice is not None:
            raise ConfigError(
                f"{twice[1]} is {twice[0]} (one module placed twice in the model): "
                f"{self!r} shards parameters with FSDP2 unit by unit, and a module in two "
                f"units would be sharded twice; share its parameters instead of the module "
                f"({twice[1]}.weight = {twice[0]}.weight, each a module of its own), or use "
                f"zero_shard(1) or data_parallel")

    def fsdp(self, plan: Plan) -> bool:
        """Whether FSDP2 runs this room: stages 2 and 3, and plain data parallelism or
        ZeRO-1 some of whose FSDP2 units rest on the host (``host_units``)."""
        return self.stage >= 2 or bool(host_units(plan))

    def install(self, ctx):
        return install_zero(self, ctx)

    def reductions(self, plan: Plan) -> list:
        """Stage 0 averages every gradient over the data axes from the backward; stages
        2/3 (and stage 0 run by FSDP2, ``fsdp``) only those FSDP2 leaves replicated (it
        reduce-scatters or all-reduces the rest itself);
        stage 1 reduce-scatters in ``meshlab.optimizer`` (under hybrid sharding after the
        backward's average over the replicate axes), or where FSDP2 runs it (parameters
        resting on the host) slices what FSDP2 averaged over every data axis."""
        if self.stage == 1 and not self.fsdp(plan):    # hybrid: the replicas' mean first
            return [Reduction(self.replicate, average=True, order=10)] if self.replicate \
                else []
        names = fsdp_ignored(plan) if self.fsdp(plan) else None
        if names is not None and not names:
            return []
        return [Reduction(self.replicate + self.axis, average=True, names=names, order=10)]

    def memory(self, plan: Plan, rows: list) -> list:
        return zero_memory(self, plan, rows)

    def comm(self, plan: Plan, *, batch, seq, coord):
        return zero_comm(self, plan, coord)

    def transients(self, plan: Plan, *, batch: int, seq: int) -> list:
        return zero_transients(self, plan)

    def hidden(self, plan: Plan, kind: str) -> float:
        """Stage 0 all-reduces buckets as the backward makes them, FSDP2 (2, 3) prefetches
        its gathers and reduce-scatters during the backward: all hidden but the last
        bucket or unit (~10%); ZeRO-1 reduces and gathers in the optimizer step."""
        return 0.0 if self.stage == 1 else 0.9

    def __repr__(self) -> str:
        a = _name(self.axis)
        b = "" if self.bucket_mb == BUCKET_MB else f", bucket_mb={self.bucket_mb!r}"
        r = f", replicate={_name(self.replicate)!r}" if self.replicate else ""
        f = "" if self.reshard == 1.0 else f", reshard={self.reshard!r}"
        return f"zero_shard(stage={self.stage}, axis={a!r}{b}{r}{f})"

    def resharded(self, blocks) -> frozenset:
        """The FSDP2 units whose parameters are freed after their forward and gathered
        again for their backward: none below stage 3; at stage 3 the root (``''``) and
        the first ``round(reshard * len(blocks))`` blocks (every block by default); the
        last blocks, whose backward comes first, keep theirs gathered."""
        if self.stage != 3:
            return frozenset()
        return frozenset(("",) + tuple(blocks[:round(self.reshard * len(blocks))]))


def host_units(plan: Plan) -> tuple[str, ...]:
    """The FSDP2 units whose parameters a room keeps on the host (``offload(params=...)``),
    as the bound plan's decisions record them; none before ``bind``."""
    got = plan.decision(HostUnits) if plan.is_bound else None
    return got.units if got is not None else ()


def _name(axes: tuple[str, ...]):
    """Axes as they are written: one name, or a tuple of several."""
    return axes[0] if len(axes) == 1 else axes


def _same_axis(rep: tuple[str, ...], zero: ZeroShard) -> str:
    both = [a for a in rep if a in zero.axis]
    return (f"data_parallel({_name(rep)!r}) and {zero!r}: axis "
            f"{both[0]!r} would both replicate and shard the same state; keep "
            f"zero_shard({zero.stage}, {both[0]!r}) alone, or give the replicas an axis of "
            f"their own for hybrid sharding, e.g. Mesh(rep=2, {both[0]}=2) with "
            f"data_parallel('rep') | zero_shard({zero.stage}, {both[0]!r})")


def _check_hybrid(t: ZeroShard, plan: Plan) -> None:
    """FSDP2 takes hybrid sharding's 2-D mesh as a slice ``(replicate, shard)`` of the
    mesh, so (stages 2, 3) the replicate axes come first; parameter specs shard over no
    data axis (FSDP by spec beside replicas is not yet shown against one process)."""
    order = list(plan.mesh_shape)
    if t.stage >= 2 and max(order.index(a) for a in t.replicate) > \
            min(order.index(a) for a in t.axis):
        want = [a for a in order if a in t.replicate] + [a for a in order if a in t.axis] + \
            [a for a in order if a not in t.replicate + t.axis]
        mesh = ", ".join(f"{a}={plan.mesh_shape[a]}" for a in want)
        raise ConfigError(f"{t!r}: FSDP2's hybrid sharding runs on the 2-D mesh (replicate, "
                          f"shard), so the replicate axes {t.replicate} come before the shard "
                          f"axes {t.axis} in the mesh, which is {tuple(order)}; build it as "
                          f"Mesh({mesh})")
    for e in plan.params:
        if set(e.mesh_spec.axes) & set(t.replicate):
            raise ConfigError(f"{e.fqn}: {e.spec!r} -> {e.mesh_spec!r} shards a parameter over "
                              f"{t.replicate}, the axes {t!r} replicates it on; map that "
                              f"logical axis to None in Rules")
    if plan.roles.fsdp:
        e = next(e for e in plan.params if set(e.mesh_spec.axes) & set(plan.roles.fsdp))
        raise ConfigError(f"{e.fqn}: {e.spec!r} -> {e.mesh_spec!r} shards a parameter over the "
                          f"data axis {plan.roles.fsdp[0]!r} beside the replicate axes of "
                          f"{t!r}, which is not yet supported; map that logical axis to None "
                          f"in Rules and let {t!r} shard the parameters")


def _check_fsdp_specs(plan: Plan, fsdp: tuple[str, ...]) -> None:
    """FSDP2 shards one dimension of each parameter over the whole data axis."""
    for e in plan.params:
        dims = [d for d in range(len(e.mesh_spec)) if set(e.mesh_spec.dim_axes(d)) & set(fsdp)]
        if not dims:
            continue
        d = dims[0]
        if len(dims) > 1 or tuple(a for a in e.mesh_spec.dim_axes(d) if a in fsdp) != fsdp \
                or len(e.mesh_spec.dim_axes(d)) > len(fsdp):
            raise NotRunnable(
                f"{e.fqn} {e.shape}: {e.spec!r} -> {e.mesh_spec!r}; FSDP over {fsdp} shards "
                f"one dimension of a parameter over all of {fsdp} and nothing else; give that "
                f"dimension exactly {fsdp} in the spec")


def zero_shard(stage: int = 3, axis: str | tuple[str, ...] = "dp", *,
               bucket_mb: float = BUCKET_MB,
               replicate: str | tuple[str, ...] = (), reshard: float = 1.0) -> ZeroShard:
    """Shard optimizer state (1), + gradients (2), + parameters (3) over ``axis``;
    with ``replicate``, hybrid sharding: the batch split over those axes too, the state
    replicated on them (what ``data_parallel(replicate) | zero_shard(stage, axis)`` makes).
    ``reshard`` (stage 3): the share of blocks freed after their forward and gathered again
    for their backward (FSDP2's ``reshard_after_forward`` per block); the others, the last
    blocks, stay gathered from their forward to their backward, as at stage 2. Between 0.0
    and 1.0 it trades memory for a gather per block; the numbers are the same.

    >>> zero_shard(3, 'dp', reshard=0.5)
    zero_shard(stage=3, axis='dp', reshard=0.5)

    >>> zero_shard(3, 'dp')
    zero_shard(stage=3, axis='dp')
    >>> data_parallel('rep') | zero_shard(3, 'dp')
    zero_shard(stage=0, axis='rep') | zero_shard(stage=3, axis='dp')
    """
    return ZeroShard(stage=_stage(stage), axis=_axes(axis), bucket_mb=bucket_mb,
                     replicate=replicate, reshard=reshard)


def data_parallel(axis: str | tuple[str, ...] = "dp", *,
                  bucket_mb: float = BUCKET_MB) -> ZeroShard:
    """Plain data parallelism over ``axis`` (``zero_shard(0, axis)``): replicated
    parameters, gradients all-reduced from the backward in buckets of ``bucket_mb`` MiB
    (DDP's ``bucket_cap_mb``)."""
    return ZeroShard(stage=0, axis=_axes(axis, "data_parallel"), bucket_mb=bucket_mb)


@implied_room
def _implied_dp(plan: Plan, roles) -> Any:
    """The batch maps to axes no transform claims: data parallelism over them (FSDP where
    the parameter specs shard over them too)."""
    if not roles.dp or any(isinstance(t, ZeroShard) for t in plan.options):
        return None
    return ZeroShard(3 if roles.fsdp else 0, roles.dp)


