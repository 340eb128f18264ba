"""Per-step communication of a bound plan, and a counter of what a step really sends.

``estimate_comm(plan, batch, seq)`` predicts, per rank and per training step, how many
collectives of each kind run over each mesh axis and how many bytes they carry (the
size of the full tensor each one reduces or gathers: an all-reduce of ``n`` bytes moves
``2 n (k-1)/k`` over a ring of ``k`` ranks, a reduce-scatter or all-gather ``n (k-1)/k``).

Data parallel and ZeRO, with Ψ the bytes of this rank's (TP-local) gradients:
  * stage 0: one all-reduce of Ψ (a reduce-scatter plus an all-gather: 2Ψ of ring work);
  * stage 1: a reduce-scatter of Ψ and an all-gather of Ψ (2Ψ);
  * stage 2: an all-gather of Ψ in forward, a reduce-scatter of Ψ in backward (2Ψ);
  * stage 3: the same plus an all-gather of every unit again in backward (3Ψ).
  FSDP2 (stages 2/3) pads every parameter's first dim to a multiple of the axis size.
Tensor parallel (per step, T local tokens, h hidden, 4-byte activations, L blocks):
  * without SP: 2L + 1 all-reduces of T·h in forward (row-parallel outputs, embedding),
    2L + 1 in backward (region entries, LM head input); the vocab-parallel loss adds 3
    all-reduces of T' scalars (max, sum-exp, target logit);
  * with SP: per block 2 all-gathers and 2 reduce-scatters of T·h each way; the
    sequence is gathered once after the blocks (forward) and once before them (backward).
Plus one all-reduce of the step's loss (8 bytes) over the data-parallel axes.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

from ._placement import local_shape
from ._plan import dtype_bytes


@dataclasses.dataclass(frozen=True)
class CommEstimate:
    """``ops[(kind, axis)] = (count, bytes)`` per rank per step."""

    ops: dict

    def count(self, kind: str, axis: str | None = None) -> int:
        return sum(c for (k, a), (c, _) in self.ops.items() if k == kind and axis in (None, a))

    def bytes(self, kind: str, axis: str | None = None) -> int:
        return sum(b for (k, a), (_, b) in self.ops.items() if k == kind and axis in (None, a))

    def __rich__(self):
        from rich.table import Table

        from ._plan_view import _fmt_bytes

        t = Table(title="communication per rank per step")
        for c in ("collective", "axis", "count", "bytes"):
            t.add_column(c, justify="right" if c in ("count", "bytes") else "left")
        for (k, a), (c, b) in sorted(self.ops.items()):
            t.add_row(k, a, str(c), _fmt_bytes(b))
        return t

    def __str__(self) -> str:
        from ._plan_view import render_text

        return render_text(self.__rich__())


def estimate_comm(plan, *, batch: int | None = None, seq: int | None = None,
                  act_bytes: int = 4, causal: bool = True,
                  coord: dict[str, int] | None = None) -> CommEstimate:
    """See the module docstring. ``batch`` is the per-data-parallel-rank batch; without
    ``batch``/``seq`` only parameter traffic is counted. ``coord`` picks the rank (mesh
    coordinate) whose uneven shards are counted; the default is the largest."""
    from ._layout import build_layout

    sizes = plan.mesh_shape
    ops: dict = defaultdict(lambda: [0, 0])

    def add(kind, axis, n, nbytes):
        ops[(kind, axis)][0] += n
        ops[(kind, axis)][1] += nbytes

    zero = plan.option("zero") or {}
    stage = zero.get("stage", 0)
    prec = plan.option("precision") or {}
    sharded_axes = {a for e in plan.params for a in (e.mesh_spec.axes if e.mesh_spec else ())
                    if sizes[a] > 1}
    tp_axis = next(iter(sharded_axes), None) if len(sharded_axes) == 1 else None
    if zero:
        dp_axes = tuple(zero["axis"])
    else:
        from ._spec import P

        batch_axes = plan.rules.resolve(P("batch"), tuple(sizes)).dim_axes(0) if plan.rules else ()
        dp_axes = tuple(a for a in batch_axes if a != tp_axis)
    dp = math.prod(sizes[a] for a in dp_axes) if dp_axes else 1
    dp_name = "_".join(dp_axes) if dp_axes else None
    # gradient buckets: (dtype, tp-sharded?) -> elements
    buckets: dict = defaultdict(int)
    fsdp_units: dict = defaultdict(int)   # FSDP unit -> padded elements
    blocks = plan.model.blocks
    for e in plan.params:
        if e.tied_to is not None or not e.requires_grad:
            continue
        ls = local_shape(e.shape, e.mesh_spec, sizes, coord)
        n = math.prod(ls)
        dt = prec.get("grad", e.dtype) if stage < 2 else e.dtype
        buckets[(dt, bool(e.mesh_spec.axes))] += n
        unit = next((b for b in blocks if e.fqn.startswith(b + ".")), "")
        d0 = -(-ls[0] // dp) * dp if ls else 1
        fsdp_units[unit] += d0 * math.prod(ls[1:]) if ls else 1
    if dp > 1:
        if stage == 0:
            by_dtype: dict = defaultdict(int)
            for (dt, _), n in buckets.items():
                by_dtype[dt] += n
            for dt, n in by_dtype.items():
                add("all_reduce", dp_name, 1, n * dtype_bytes(dt))
        elif stage == 1:
            for (dt, _), n in buckets.items():
                padded = -(-n // dp) * dp
                add("reduce_scatter", dp_name, 1, padded * 4)
                add("all_gather", dp_name, 1, padded * 4)
        else:
            pbytes = dtype_bytes(prec.get("param", "float32"))
            gbytes = dtype_bytes(prec.get("grad", "float32"))
            for unit, n in fsdp_units.items():
                add("all_gather", dp_name, 1, n * pbytes)
                add("reduce_scatter", dp_name, 1, n * gbytes)
                if stage == 3:              # re-gathered for backward (the root too)
                    add("all_gather", dp_name, 1, n * pbytes)
        add("all_reduce", dp_name, 1, 8)    # the step's loss
    if tp_axis is not None and batch is not None and seq is not None:
        h = plan.model.config_get("hidden_size") or plan.model.config_get("n_embd")
        L = len(blocks)
        T = batch * seq
        act = T * h * act_bytes
        sp = any(a.module in blocks and a.output is not None and len(a.output) > 1
                 and a.output.dim_axes(1) == (tp_axis,) for a in plan.activations)
        if sp:
            add("all_gather", tp_axis, 4 * L + 2, (4 * L + 2) * act)
            add("reduce_scatter", tp_axis, 4 * L, 4 * L * act)
            add("all_reduce", tp_axis, 2, 2 * act)
        else:
            add("all_reduce", tp_axis, 4 * L + 2, (4 * L + 2) * act)
        tokens = batch * (seq - 1 if causal else seq)
        add("all_reduce", tp_axis, 3, 3 * tokens * 4)
        reduce_tags = {"kv_replicated", "replicated_with_grad_allreduce"}
        if sp:
            reduce_tags.add("sequence_parallel")
        extra = 0
        for e in plan.params:
            if e.tied_to is None and e.requires_grad and set(e.tags) & reduce_tags:
                extra += math.prod(local_shape(e.shape, e.mesh_spec, sizes, coord))
        if sp:
            for e in plan.params:   # row-parallel biases are added to sequence shards
                if e.fqn.endswith(".bias") and set(e.tags) & {"rowwise", "conv1d_rowwise"}:
                    extra += math.prod(e.shape)
        if extra:
            add("all_reduce", tp_axis, 1, extra * 4)
    return CommEstimate({k: tuple(v) for k, v in ops.items()})


class CommCounter:
    """``CommDebugMode`` that also sums the bytes of every collective, per axis size.

    Bytes are those of the full tensor: an all-gather's output, a reduce-scatter's
    input, an all-reduce's tensor (the convention of ``estimate_comm``).

    >>> with CommCounter() as cc:      # doctest: +SKIP
    ...     step(model, opt, batch)
    >>> cc.bytes('all_reduce')         # doctest: +SKIP
    """

    def __init__(self, *, per_module: bool = True) -> None:
        from torch.distributed.tensor.debug import CommDebugMode
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class _Mode(CommDebugMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = super().__torch_dispatch__(func, types, args, kwargs)
                outer._record(func, args)
                return out

        class _Plain(TorchDispatchMode):
            # CommDebugMode's per-module tracker does not follow a pipeline schedule,
            # which runs stage modules outside their parents; count without it there.
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
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
                "send": "send", "recv_": "recv"}.get(name)
        if kind is None:
            return

        def nbytes(x):
            if isinstance(x, torch.Tensor):
                return x.numel() * x.element_size()
            if isinstance(x, (list, tuple)):
                return sum(nbytes(y) for y in x)
            return 0

        # c10d signatures: allreduce_(tensors, pg, ...), _allgather_base_(out, in, pg, ...),
        # _reduce_scatter_base_(out, in, pg, ...)
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
            size = pg.size() if pg is not None else dist.get_world_size()
        except (AttributeError, RuntimeError):
            size = -1
        self.calls.append((kind, size, b))

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
