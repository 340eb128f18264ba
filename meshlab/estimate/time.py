"""Step time of a bound plan on a ``Machine``: compute from the profile, communication from
``plan.comm()``, each room saying how its share overlaps.

Compute, per rank: the profile's work (``meshlab.estimate.profile``: matmul FLOPs, fused-attention
FLOPs, bytes the other ops move, ops launched; forward, backward and any recompute) at the
machine's rates, ``flops / matmul + attn (1 + knee / kv) / attention + bytes / elementwise +
ops * launch`` on the device (attention at its head dim's rate and knee, 64 or 128: a
shorter kv length amortizes the per-row work worse), or on the host ``(ops - fused) *
host_op + fused * host_fused`` (an eager step's dispatch; a fused op's call costs
``host_fused``) plus, for the ``hooked`` ops selective checkpointing's mode sees,
``host_hook`` each (``host_hook_fused`` for a fused op): whichever is longer, plus the
optimizer step (the bytes AdamW reads and writes on the device). The
rooms then scale it (``Transform.step_time``): tensor and sequence parallelism divide the
block's work, a pipeline rank runs its stages' blocks and idles for the bubble (its
schedule replayed at each stage's profiled forward and backward seconds, the embeddings
on the first stage and the head and loss on the last), offload adds its host step.

Communication: every collective of ``plan.comm()`` takes ``latency + moved / bandwidth``,
where ``moved`` is a ring's traffic (all-reduce ``2 (n-1)/n`` of the tensor, all-gather and
reduce-scatter ``(n-1)/n``, send/recv the tensor) and the bandwidth is the node's
(``intra``) when the axis spans no more ranks than a node holds, else the network's. The
room that claims the axis says what its collectives hide behind: the data-parallel rooms'
behind the backward and (ZeRO-3) the forward, the pipeline's sends behind the stage's
compute; tensor- and sequence-parallel collectives sit on the critical path.
"""

from __future__ import annotations

import dataclasses

from .machine import Machine, machine as _machine
from .profile import Work, profile


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds of one training step per rank, by part; ``tokens_per_s`` for the mesh."""

    compute: float
    comm: float                      # all collectives, serialized
    exposed: float                   # what of ``comm`` is not hidden behind compute
    bubble: float = 0.0              # pipeline idle fraction
    extra: float = 0.0               # offload's host step
    tokens: int = 0                  # tokens one step trains, over the whole mesh
    parts: tuple = ()                # (name, seconds)
    machine: str = ""
    kinds: tuple = ()                # (kind, seconds): matmul, attention, memory, launch, host

    @property
    def step(self) -> float:
        return (self.compute + self.exposed) / (1.0 - self.bubble) + self.extra

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step if self.step else 0.0

    def mfu(self, flops_per_token: float, peak: float = 989e12, ranks: int = 1) -> float:
        """Model FLOPs utilization at ``peak`` FLOP/s per card."""
        return self.tokens_per_s * flops_per_token / (peak * ranks)

    def __repr__(self) -> str:
        return (f"StepTime({self.step * 1e3:.1f} ms on {self.machine}: compute "
                f"{self.compute * 1e3:.1f} ms, communication {self.comm * 1e3:.1f} ms of "
                f"which {self.exposed * 1e3:.1f} ms exposed, bubble {self.bubble:.1%}, extra "
                f"{self.extra * 1e3:.1f} ms; {self.tokens_per_s:,.0f} tokens/s)")


def work_kinds(w: Work, m: Machine, streaming: bool = False) -> dict:
    """Device seconds of ``w`` by kind (matmul, attention at its head dim's rate, memory
    traffic at the eager elementwise rate or, ``streaming``, the card's bandwidth; a
    launch gap per kernel), and the host's seconds issuing its ops (a fused op's call costs
    ``host_fused``; those a Python dispatch mode sees cost ``host_hook`` more, or
    ``host_hook_fused`` for a fused op; ops replayed from CUDA graphs cost nothing each,
    a replay ``host_fused``, as one call of a compiled function)."""
    attn = m.attention or m.matmul * 0.66
    narrow = m.attention_narrow or attn * 0.73
    rate = m.hbm if streaming else (m.elementwise or m.hbm * 0.72)
    return {"matmul": w.flops / m.matmul,
            "attention": (w.attn - w.attn_narrow + (w.attn_kv - w.attn_kv_narrow) *
                          m.attention_knee) / attn +
            (w.attn_narrow + w.attn_kv_narrow * m.attention_knee_narrow) / narrow,
            "memory": w.bytes / rate, "launch": w.ops * m.launch,
            "host": (w.ops - w.replayed - w.fused) * m.host_op + (w.fused + w.graphs) *
            m.host_fused + (w.hooked - w.hooked_fused) * m.host_hook +
            w.hooked_fused * m.host_hook_fused}


def _longer(k: dict) -> float:
    """The device's time (its work, and a launch gap per kernel) or the host's (issuing
    every op of an eager step), whichever is longer: the host runs ahead of the device
    until the device waits on it."""
    return max(k["matmul"] + k["attention"] + k["memory"] + k["launch"], k["host"])


def comm_seconds(kind: str, n: int, nbytes: float, bandwidth: float, latency: float,
                 count: int) -> float:
    if n <= 1 or not count:
        return 0.0
    factor = {"all_reduce": 2 * (n - 1) / n, "send": 1.0, "recv": 0.0,
              "all_to_all": (n - 1) / n}.get(kind, (n - 1) / n)
    return count * latency + nbytes * factor / bandwidth


def axis_bandwidth(plan, axis: str, m: Machine) -> float:
    """The node's bandwidth if ``axis`` (with every axis inside it) fits in a node."""
    names = [n for n, _ in plan.mesh]
    sizes = plan.mesh_shape
    span = 1
    for name in reversed(names):
        span *= sizes[name]
        if name == axis:
            break
    return m.intra if span <= m.gpus_per_node else m.inter


def estimate_time(plan, *, batch: int, seq: int, gpu="h200", inputs=None,
                  loss=None) -> StepTime:
    """The step time of ``plan`` (module docstring) for ``batch`` sequences of ``seq``
    tokens per data-parallel rank, on ``gpu`` (a preset, a JSON profile or a Machine), of
    the example step ``inputs`` / ``loss`` (``meshlab.estimate.example``)."""
    from ..core.errors import PlanError

    from .example import check_example

    check_example("plan.time", inputs, loss, batch)
    m = _machine(gpu)
    if plan.source is None:
        raise PlanError("plan.time(): this plan has no model to profile (read from JSON); "
                        "plan the model with meshlab.plan(model, spec, mesh)")
    pr = profile(plan.source, plan, batch, seq, inputs, loss)
    n_blocks = len(plan.model.blocks)
    block = pr.work.get(("block", "fwd"), Work()) + pr.work.get(("block", "bwd"), Work())
    rest = pr.work.get(("rest", "fwd"), Work()) + pr.work.get(("rest", "bwd"), Work())
    parts = {"blocks": block.scale(n_blocks), "rest": rest}
    for t in plan.rooms:
        parts = t.work_share(plan, parts)
    parts["optimizer"] = _optimizer_work(plan)
    by_part = {k: work_kinds(w, m, streaming=k == "optimizer") for k, w in parts.items()}
    compute = sum(_longer(k) for k in by_part.values())
    comm, hidable, fixed = 0.0, 0.0, 0.0
    est = plan.comm(batch=batch, seq=seq, inputs=inputs, loss=loss)
    owner = _owners(plan)
    for (kind, axis), (count, nbytes) in est.ops.items():
        if axis is None or kind == "control":
            continue
        n = _axis_size(plan, axis)
        s = comm_seconds(kind, n, nbytes, _bandwidth(plan, axis, m), m.latency, count)
        comm += s
        room = owner.get(axis)
        frac = room.hidden(plan, kind) if room is not None else 0.0
        hidable += s * frac
        fixed += s * (1 - frac)
    exposed = fixed + max(0.0, hidable - compute)
    bubble, extra = 0.0, 0.0
    seconds = part_seconds(pr, m)
    for t in plan.rooms:
        bubble = max(bubble, t.idle(plan, seconds))
        extra += t.host_seconds(plan)
    dp = _dp_size(plan)
    kinds: dict = {}
    for part in by_part.values():
        for k, v in part.items():
            kinds[k] = kinds.get(k, 0.0) + v
    return StepTime(compute=compute, comm=comm, exposed=exposed, bubble=bubble, extra=extra,
                    tokens=batch * seq * dp,
                    parts=tuple((name, _longer(k)) for name, k in by_part.items()),
                    machine=m.name, kinds=tuple(kinds.items()))


def part_seconds(pr, m: Machine) -> dict:
    """Seconds of the profiled step by part and direction, for the whole batch:
    ``{'block': (fwd, bwd) of one block, 'embed': (fwd, bwd) of the input embeddings,
    'head': (fwd, bwd) of the rest (final norm, head, loss)}``."""
    def sec(part, d):
        return _longer(work_kinds(pr.work.get((part, d), Work()), m))

    out = {"block": (sec("block", "fwd"), sec("block", "bwd")),
           "embed": (sec("embed", "fwd"), sec("embed", "bwd"))}
    out["head"] = tuple(max(0.0, sec("rest", d) - e) for d, e in zip(("fwd", "bwd"),
                                                                        out["embed"]))
    return out


def _optimizer_work(plan) -> Work:
    """The optimizer step on the device: AdamW reads the parameters, gradients and its
    states and writes the parameters and states back (fused: a few launches)."""
    from ..planning.rows import room_rows

    by: dict[str, int] = {}
    for r in room_rows(plan):
        if r.where == "device":
            by[r.category] = by.get(r.category, 0) + r.bytes
    moved = 2 * by.get("params", 0) + by.get("grads", 0) + 2 * by.get("optimizer", 0)
    return Work(bytes=moved, ops=8)


def _axis_size(plan, axis: str) -> int:
    import math

    sizes = plan.mesh_shape
    return math.prod(sizes[a] for a in axis.split("_") if a in sizes) if axis not in sizes \
        else sizes[axis]


def _bandwidth(plan, axis: str, m: Machine) -> float:
    names = [a for a in axis.split("_") if a in plan.mesh_shape] if axis not in \
        plan.mesh_shape else [axis]
    return min(axis_bandwidth(plan, a, m) for a in names) if names else m.inter


def _owners(plan) -> dict:
    """Mesh axis (or joined axes) -> the room that claims it."""
    out = {}
    for t in plan.rooms:
        if t.kind == "shard" and plan.roles.tp:
            out[plan.roles.tp] = t
        for axes in t.claims(plan).values():
            axes = tuple(axes)
            out["_".join(axes)] = t
            for a in axes:
                out.setdefault(a, t)
    return out


def _dp_size(plan) -> int:
    import math

    r = plan.roles
    axes = tuple(getattr(r, "dp", ()) or ()) + tuple(getattr(r, "fsdp", ()) or ())
    return math.prod(plan.mesh_shape[a] for a in axes if a in plan.mesh_shape) or 1
