"""Per-step communication of a bound plan, and a counter of what a step really sends.

``estimate_comm(plan, batch, seq)`` sums what each room of the plan says it sends
(``Transform.comm``). It predicts, per rank and per training step, how many
collectives of each kind run over each mesh axis and how many bytes they carry (the
size of the full tensor each one reduces or gathers: an all-reduce of ``n`` bytes moves
``2 n (k-1)/k`` over a ring of ``k`` ranks, a reduce-scatter or all-gather ``n (k-1)/k``).

Data parallel and ZeRO, with Ψ the bytes of this rank's (TP-local) gradients:
  * stage 0: one all-reduce of Ψ (a reduce-scatter plus an all-gather: 2Ψ of ring work);
  * stage 1: a reduce-scatter of Ψ and an all-gather of Ψ (2Ψ);
  * stage 2: an all-gather of Ψ in forward, a reduce-scatter of Ψ in backward (2Ψ);
  * stage 3: the same plus an all-gather of every unit again in backward (3Ψ).
  FSDP2 (stages 2/3) pads every parameter's first dim to a multiple of the axis size.
  Hybrid sharding (replicated over ``rep``, ZeRO over ``dp``): the same over ``dp``, plus
  over ``rep`` an all-reduce of each unit's gradient shard (stages 2/3, Ψ/dp in all) or of
  Ψ from the backward (stage 1).
Tensor parallel (per step, T local tokens, h hidden, 4-byte activations, L blocks):
  * without SP: 2L + 1 all-reduces of T·h in forward (row-parallel outputs, embedding),
    2L + 1 in backward (region entries, LM head input); the vocab-parallel loss adds 3
    all-reduces of T' scalars (max, sum-exp, target logit);
  * with SP: per block 2 all-gathers and 2 reduce-scatters of T·h each way; the
    sequence is gathered once after the blocks (forward) and once before them (backward).
Plus one all-reduce of the step's loss (8 bytes) over the data-parallel axes.

The hidden size h is the config's; a model of your own (no Hugging Face config) that
moves activations between ranks (tensor, sequence or expert parallelism) has it measured:
the width of the hidden states entering its first block, in the one-block profile of the
example step (``inputs=`` / ``loss=``, ``meshlab.estimate.example``). Where such a model runs
on DTensors (specs without policy regions), DTensor's sharding propagation chooses its
collectives: the count here is Megatron's for the same layout, the least it needs (a real
step may run more of them, in its backward).
"""

from __future__ import annotations

from ..planning.rows import CommOp as CommOp

import dataclasses
import math
from collections import defaultdict



@dataclasses.dataclass(frozen=True)
class CommEstimate:
    """``ops[(kind, axis)] = (count, bytes)`` per rank per step."""

    ops: dict

    def count(self, kind: str, axis: str | None = None) -> int:
        return sum(c for (k, a), (c, _) in self.ops.items() if k == kind and axis in (None, a))

    def bytes(self, kind: str, axis: str | None = None) -> int:
        return sum(b for (k, a), (_, b) in self.ops.items() if k == kind and axis in (None, a))

    TITLE = "communication per rank per step"

    def rows(self) -> list[tuple[str, str, str, str]]:
        """``(collective, axis, count, bytes)`` per kind and axis, bytes in binary units."""
        from ..core.units import fmt_bytes

        return [(k, a or "", str(c), fmt_bytes(b))
                for (k, a), (c, b) in sorted(self.ops.items(), key=lambda kv: (
                    kv[0][0], kv[0][1] or ""))]

    def __rich__(self):
        from rich.table import Table

        t = Table(title=self.TITLE)
        for c in ("collective", "axis", "count", "bytes"):
            t.add_column(c, justify="right" if c in ("count", "bytes") else "left")
        for row in self.rows():
            t.add_row(*row)
        return t

    def __repr__(self) -> str:
        """One line: ``kind/axis count× bytes`` for each collective of a step."""
        ops = ", ".join(f"{k}/{a or '-'} {c}× {b}" for k, a, c, b in self.rows())
        return f"CommEstimate(per rank per step: {ops or 'no collectives'})"

    def _repr_html_(self) -> str:
        from ..planning.view import html_table

        return html_table(("collective", "axis", "count", "bytes"), self.rows(),
                          title=self.TITLE)

    def __str__(self) -> str:
        from ..planning.view import render_text

        return render_text(self.__rich__())


def estimate_comm(plan, *, batch: int | None = None, seq: int | None = None,
                  coord: dict[str, int] | None = None, inputs=None,
                  loss=None) -> CommEstimate:
    """The backward's gradient reductions (``GradSync``'s buckets) plus every room's
    ``comm`` (see the module docstring). ``batch`` is the
    per-data-parallel-rank batch; without ``batch``/``seq`` only parameter traffic is
    counted. ``coord`` picks the rank (mesh coordinate) whose uneven shards are counted;
    the default is the largest. ``inputs`` / ``loss``: the example step that measures
    the hidden size of a model without a config."""
    from .example import check_example

    check_example("plan.comm", inputs, loss, batch)
    if batch is not None and seq is not None:
        plan = _with_hidden_size(plan, batch, seq, inputs, loss)
    ops: dict = defaultdict(lambda: [0, 0])
    grads = grad_sync_ops(plan, coord)     # the backward's bucketed reductions
    for op in grads + [op for t in plan.rooms
                       for op in t.comm(plan, batch=batch, seq=seq, coord=coord)]:
        ops[(op.kind, op.axis)][0] += op.count
        ops[(op.kind, op.axis)][1] += op.bytes
    return CommEstimate({k: tuple(v) for k, v in ops.items()})


def _with_hidden_size(plan, batch: int, seq: int, inputs, loss):
    """``plan`` as the rooms count its activation traffic on: where the config gives no
    hidden size and activations cross ranks (tensor, sequence or expert parallelism), the
    width the profile measures joins the config the rooms read (this plan only, never
    the one the caller holds)."""
    import dataclasses

    from ..core.errors import PlanError

    cfg = plan.model.config_get
    crossing = plan.roles.tp or plan.roles.sp or plan.roles.axes("ep")
    if not crossing or cfg("hidden_size") or cfg("n_embd") or cfg("d_model"):
        return plan
    if plan.source is None:
        raise PlanError("plan.comm(batch=, seq=): this plan has no model to measure the "
                        "hidden size of (it was read from JSON, and its model has no "
                        "config); plan the model itself with meshlab.plan(model, spec, mesh)")
    from .profile import profile

    width = profile(plan.source, plan, batch, seq, inputs, loss).width
    if width is None:
        raise PlanError(f"plan.comm(batch=, seq=): the first block of {plan.model.cls} "
                        f"({plan.model.blocks[0]}) takes no tensor, so the width of its "
                        f"hidden states cannot be measured; give its hidden states as the "
                        f"block's first argument")
    model = dataclasses.replace(plan.model, config=plan.model.config + (("hidden_size",
                                                                         width),))
    return plan.replace(model=model)


def grad_sync_ops(plan, coord) -> list[CommOp]:
    """The all-reduces ``GradSync`` sends per step for ``plan`` on the rank at ``coord``:
    one per bucket and reduction, of its gradients plus one flag per parameter (the
    buckets come from the same ``_gradsync.layout`` the backward hooks use)."""
    from ..core.placement import local_shape
    from ..core.units import dtype_bytes
    from ..transforms._gradsync import bucket_mb, layout, plan_reductions, reduce_dtype, routes

    sizes = plan.mesh_shape
    from ..planning.rows import alike, rank_params

    items = [(e.fqn, math.prod(local_shape(e.shape, e.mesh_spec, sizes, coord)), e.dtype,
              dtype_bytes(e.dtype)) for e in rank_params(plan, coord)
             if e.tied_to is None and e.requires_grad]
    # Inside advise's search, a layout with remat added reduces as the one without it
    # does (``planning.rows.alike``), whose reductions its check has already laid out.
    route_of = routes(plan_reductions(alike(plan)), sizes, [i[0] for i in items])
    narrow = reduce_dtype(plan)       # precision(reduce=...): the data axes' buckets

    def nbytes(route, dt) -> int:
        data = any(a in plan.roles.data for r in route for a in r.axes)
        return narrow.itemsize if narrow is not None and data else dtype_bytes(dt)

    return [CommOp("all_reduce", "_".join(r.axes), 1, (numel + len(names)) * nbytes(route, dt))
            for route, names, numel, dt in layout(items, route_of, bucket_mb(plan) * 2 ** 20)
            for r in route]


def _inside(func):
    """The implementation of a custom op that communicates inside (``COMMUNICATING_OPS``),
    or None."""
    from ..core.collectives import COMMUNICATING_OPS

    packet = getattr(func, "_overloadpacket", None)
    return COMMUNICATING_OPS.get(getattr(packet, "_qualified_op_name", None))


class CommCounter:
    """``CommDebugMode`` that also sums the bytes of every collective, per axis size.

    Bytes are those of the full tensor: an all-gather's output, a reduce-scatter's
    input, an all-reduce's tensor (the convention of ``estimate_comm``). The ranks'
    agreement exchanges (``meshlab.core.agree``, on the gloo control group) run with
    dispatch modes off, beside the model's communication, and are not counted (one a
    counter sees anyway is filed as kind ``'control'``).

    >>> with CommCounter() as cc:      # doctest: +SKIP
    ...     step(model, opt, batch)
    >>> cc.bytes('all_reduce')         # doctest: +SKIP
    """

    def __init__(self, *, per_module: bool = True) -> None:
        from torch.distributed.tensor.debug import CommDebugMode
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class _Plain(TorchDispatchMode):
            # CommDebugMode's per-module tracker does not follow a pipeline schedule,
            # which runs stage modules outside their parents; count without it there.
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                inside = _inside(func)
                if inside is not None:
                    with _Plain():
                        return inside(*args, **(kwargs or {}))
                out = func(*args, **(kwargs or {}))
                outer._record(func, args)
                return out

        class _Mode(CommDebugMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                inside = _inside(func)
                if inside is not None:     # a custom op that communicates: look inside
                    with _Plain():
                        return inside(*args, **(kwargs or {}))
                out = super().__torch_dispatch__(func, types, args, kwargs)
                outer._record(func, args)
                return out

        self._mode = _Mode() if per_module else _Plain()
        self.calls: list[tuple[str, int, int]] = []   # (kind, group size, bytes)

    def _record(self, func, args) -> None:
        import torch
        import torch.distributed as dist

        name = func._overloadpacket.__name__
        kind = {"allreduce_": "all_reduce", "_allgather_base_": "all_gather",
                "allgather_into_tensor_coalesced_": "all_gather",
                "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor_coalesced_":
                "reduce_scatter", "allgather_": "all_gather", "reduce_scatter_": "reduce_scatter",
                "broadcast_": "broadcast", "alltoall_base_": "all_to_all",
                "send": "send", "recv_": "recv",
                # torch's functional collectives (``_c10d_functional``), autograd's too
                "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor":
                "reduce_scatter", "all_reduce": "all_reduce"}.get(name)
        if kind is not None and func.namespace in ("_c10d_functional",
                                                   "_c10d_functional_autograd"):
            return self._record_functional(kind, func, args)
        if kind is None:
            return
        from ..core.agree import active

        if active():          # ranks agreeing on what they run: not the model's traffic
            kind = "control"

        def nbytes(x):
            if isinstance(x, torch.Tensor):
                return x.numel() * x.element_size()
            if isinstance(x, (list, tuple)):
                return sum(nbytes(y) for y in x)
            return 0

        # c10d signatures: allreduce_(tensors, pg, ...), _allgather_base_(out, in, pg, ...),
        # _reduce_scatter_base_(out, in, pg, ...); the pipeline's point-to-point ops
        # (batch_isend_irecv on gloo): send(tensors, pg, dst, tag), recv_(tensors, pg, src, tag)
        if kind == "all_reduce":
            b, pg = nbytes(args[0]), args[1]
        elif kind == "all_gather":
            b, pg = nbytes(args[0]), args[2] if len(args) > 2 else None
        elif kind == "reduce_scatter":
            b, pg = nbytes(args[1]), args[2] if len(args) > 2 else None
        elif kind in ("send", "recv"):
            b, pg = nbytes(args[0]), args[1]
        else:
            b, pg = nbytes(args[0]), None
        try:
            if isinstance(pg, torch.ScriptObject):     # how c10d's ops receive the group
                pg = dist.ProcessGroup.unbox(pg)
            size = pg.size() if pg is not None else dist.get_world_size()
        except (AttributeError, RuntimeError, TypeError):
            size = -1
        self.calls.append((kind, size, b))

    def _record_functional(self, kind: str, func, args) -> None:
        """A functional collective: ``all_gather_into_tensor(input, group_size, group)``
        (bytes of its output), ``reduce_scatter_tensor(input, op, group_size, group)``,
        ``all_reduce(input, op, group)``; the autograd variants are counted once, as the
        functional op they run."""
        if func.namespace == "_c10d_functional_autograd":
            return
        x = args[0]
        b = x.numel() * x.element_size()
        size = args[1] if kind == "all_gather" else args[2] if kind == "reduce_scatter" \
            else -1
        self.calls.append((kind, size, b * size if kind == "all_gather" else b))

    def __enter__(self) -> "CommCounter":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)

    def count(self, kind: str) -> int:
        return sum(1 for k, _, _ in self.calls if k == kind)

    def bytes(self, kind: str) -> int:
        return sum(b for k, _, b in self.calls if k == kind)

    @property
    def comm_counts(self):
        return getattr(self._mode, "comm_counts", None)
