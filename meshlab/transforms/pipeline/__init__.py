"""pipeline: split the repeated blocks into stages over a mesh axis.

The room: ``Pipeline`` (claims the ``pp`` role), its checks (stages fill the ranks, no
tied weights across stages; the rooms it runs with are the composition table's), its
install (other ranks' blocks dropped after initialization, ``torch.distributed.pipelining``
stages, and torch's schedule runtime over the schedule's action lists; ``_runtime``): a
Hugging Face decoder on stages of its parts (``_stage``), any model with declared blocks
on its own forward (``blocks=``, ``_blocks``), the batch matched to the stages by its
keys and the caller's loss on the last stage (``_feed``), its
part (the schedule runs the step; the gradient norm is summed over stages) and the
schedule's picture and idle fraction (``_schedule``), from the same action lists the
runtime runs:

* GPipe and 1F1B:           (p - 1) / (m + p - 1)
* interleaved 1F1B (v > 1): (p - 1) / (v m + p - 1)
* zero-bubble and ZB-V: the action lists replayed with forward = 1, backward = 2 units
  (``simulate``), which gives the two formulas above exactly for the others

with p pipeline ranks, m microbatches and v stages per rank. Those formulas give every
stage the same work; ``meshlab.estimate.pipeline.bubble(plan, batch=, seq=)`` and ``plan.time()`` replay the
schedule at each stage's profiled seconds instead, the embeddings on the first stage and
the final norm, head and loss on the last.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ...core.errors import ConfigError, PlanError, check_choice, check_int, check_name
from ...planning.plan import Plan
from .._protocol import Phase, Transform
from . import _schedule
from ._schedule import PipelineStages as PipelineStages, Stage as Stage

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zero_bubble": 2, "zbv": 2}


@dataclasses.dataclass(frozen=True)
class Pipeline(Transform):
    """Pipeline parallelism over ``axis`` with ``schedule`` and ``microbatches``; with
    ``microbatch_size``, each batch is cut into microbatches of that many rows as it
    comes (``microbatches`` then the count the plan's estimates take)."""

    kind: ClassVar[str] = "pipeline"
    phase: ClassVar[Phase] = Phase.SCHEDULE

    axis: str = "pp"
    schedule: str = "1f1b"
    microbatches: int = 4
    virtual_stages: int | None = None
    layers_per_stage: tuple[int, ...] | None = None
    blocks: str | tuple[str, ...] | None = None
    microbatch_size: int | None = None

    def __post_init__(self):
        check_name(self.axis, "pipeline", "axis", example="pp")
        check_choice(self.schedule, "pipeline", "schedule", tuple(SCHEDULES))
        object.__setattr__(self, "microbatches", check_int(
            self.microbatches, "pipeline", "microbatches", example=4))
        if self.microbatch_size is not None:
            object.__setattr__(self, "microbatch_size", check_int(
                self.microbatch_size, "pipeline", "microbatch_size", example=1))
        if self.virtual_stages is not None:
            object.__setattr__(self, "virtual_stages", check_int(
                self.virtual_stages, "pipeline", "virtual_stages", example=2))
        v = self.v
        if self.schedule in ("gpipe", "1f1b") and v != 1:
            raise ConfigError(f"{self.schedule} runs one stage per rank; use "
                              f"schedule='interleaved' for virtual_stages={v}")
        if self.schedule == "zbv" and v != 2:
            raise ConfigError("zbv runs exactly two stages per rank (a V shape)")
        object.__setattr__(self, "virtual_stages", v)
        if self.layers_per_stage is not None:
            object.__setattr__(self, "layers_per_stage", _layers(self.layers_per_stage))
        if self.blocks is not None:
            object.__setattr__(self, "blocks", _block_names(self.blocks))

    @property
    def v(self) -> int:
        return self.virtual_stages or SCHEDULES[self.schedule]

    def memory(self, plan: Plan, rows: list) -> list:
        """Each rank holds its own stages' parameters: the rows of the heaviest rank."""
        from ._schedule import rank_rows

        return rank_rows(plan, self, rows)

    def comm(self, plan: Plan, *, batch, seq, coord):
        """The stage boundaries' sends and receives of the rank at ``coord`` (``_p2p``)."""
        from ._p2p import p2p_comm

        return p2p_comm(plan, self, batch, seq, coord)

    def local_blocks(self, plan: Plan, coord) -> tuple[str, ...]:
        """The blocks of the stages the rank at ``coord`` runs (default: the busiest)."""
        from ._p2p import rank_blocks

        return rank_blocks(plan, self, coord)

    def work_share(self, plan: Plan, parts: dict) -> dict:
        """The busiest pipeline rank: its stages' blocks, the head and loss if it holds them."""
        st = _schedule.stages(plan, self)
        L = len(plan.model.blocks)
        b, r = parts["blocks"], parts["rest"]
        best = None
        for rank in sorted({s.rank for s in st}):
            n = sum(len(s.blocks) for s in st if s.rank == rank)
            ends = any(s.last or s.first for s in st if s.rank == rank)
            cand = {"blocks": b.scale(n / L), "rest": r if ends else r.scale(0.0)}
            if best is None or cand["blocks"].flops + cand["rest"].flops > \
                    best["blocks"].flops + best["rest"].flops:
                best = cand
        return best

    def hidden(self, plan: Plan, kind: str) -> float:
        return 0.5      # sends and receives are batched with the neighbour's, half waited

    def idle(self, plan: Plan, seconds: dict | None = None) -> float:
        """The busiest rank's idle fraction: the schedule replayed at the stages' profiled
        costs (embeddings on the first stage, head and loss on the last), or the formula
        without a profile."""
        if seconds is None or not seconds["block"][0]:
            return _schedule.bubble(plan, self)
        costs = _schedule.stage_costs(plan, self, seconds)
        return _schedule.idle(plan, self, costs)["busiest"]

    def activation_memory(self, plan: Plan, rows: list, *, batch: int, seq: int) -> list:
        """The rank holding the most: its stages' blocks per microbatch in flight."""
        from ._schedule import rank_activations

        return rank_activations(plan, self, rows, _head_modules(plan))

    def apply(self, plan: Plan) -> Plan:
        """The declared blocks (``blocks=``) become the plan's blocks, which every room
        reads from here on; without them, the blocks the trace found are split."""
        if self.blocks is not None:
            from ._blocks import declared_blocks

            blocks = declared_blocks(plan, self.blocks)
            plan = plan.replace(model=dataclasses.replace(plan.model, blocks=blocks))
        if not plan.model.blocks:
            raise PlanError(f"pipeline: {plan.model.cls or 'the model'} has no repeated blocks "
                            f"to split into stages; declare them: pipeline(..., "
                            f"blocks='layers') names a ModuleList or ModuleDict attribute")
        return plan

    def claims(self, plan: Plan):
        return {"pp": (self.axis,)}

    def decide(self, plan: Plan) -> PipelineStages:
        """The stages, once: the blocks split over the pipeline ranks (``_schedule.split``);
        every other step reads them from the plan (``stages(plan)``), with the modules the
        first and the last stage alone hold. Without declared blocks, a model laid out
        otherwise than meshlab's decoder stages run is refused first, by name (an
        encoder-decoder, say), not by a split of blocks that are not a decoder's."""
        from ._stage import check_layout

        if self.blocks is None:
            check_layout(plan)
        return _schedule.split(plan, self)

    def check(self, plan: Plan) -> None:
        from ._stage import check_layout, check_untied

        if self.blocks is None:
            check_layout(plan)
        check_untied(plan, _schedule.stages(plan, self), self.blocks is not None)
        _check_split_backward(self, plan)
        _check_batch_norms(self, plan)

    def prepare(self, ctx) -> None:
        from ._runtime import PipelineSetup

        ctx.keep(PipelineSetup(self, ctx))

    def check_batch(self, plan: Plan, batch, layout) -> None:
        """meshlab's stages of a Hugging Face decoder read ``input_ids`` (the first stage),
        ``attention_mask`` and ``position_ids`` (every stage: each builds its microbatch's
        mask and positions from them as the model's forward does, so padded and packed
        batches train as one process) and ``labels`` (the loss): a batch with any other
        key is refused by name before the step's first collective. A model with declared
        ``blocks`` gets every key its forward takes, and masks as it does. Under
        ``microbatch_size`` a batch it does not cut into one microbatch per stage or more
        is refused there too."""
        from ._runtime import check_keys, microbatch_count

        if self.blocks is None:
            check_keys(batch)
        microbatch_count(self, plan.mesh_shape[self.axis], batch)

    def install(self, ctx):
        from ._runtime import PipelineSetup

        return ctx.kept(PipelineSetup).build(ctx)

    def __repr__(self) -> str:
        layers = ("" if self.layers_per_stage is None
                  else f", layers_per_stage={self.layers_per_stage!r}")
        blocks = "" if self.blocks is None else f", blocks={self.blocks!r}"
        size = "" if self.microbatch_size is None else \
            f", microbatch_size={self.microbatch_size}"
        return (f"pipeline({self.axis!r}, schedule={self.schedule!r}, "
                f"microbatches={self.microbatches}, virtual_stages={self.v}{layers}{blocks}"
                f"{size})")


def _check_split_backward(t: Pipeline, plan: Plan) -> None:
    """zero_bubble and zbv split each backward into its input and weight gradients;
    under FSDP2 stages (``zero_shard(2)``, ``zero_shard(3)``) that split does not train
    like one process. Measured on pp=2, dp=2 (Llama, float64, SGD): under zero_shard(3)
    both schedules leave weights off by ~1e-5 after the first step where rounding is 1e-10;
    zbv under zero_shard(2) hangs in its first step."""
    if t.schedule not in ("zero_bubble", "zbv"):
        return
    rows = {r for room in plan.rooms for r in room.rows(plan)}
    fsdp = sorted(rows & {"zero_shard(2)", "zero_shard(3)"})
    if fsdp:
        raise ConfigError(
            f"pipeline(schedule={t.schedule!r}) with {fsdp[0]}: the split backward (input "
            f"gradients, then weight gradients later) does not yet train like one process "
            f"under FSDP2 stages (measured: weights off after the first step, or a hang); "
            f"use schedule='1f1b', 'interleaved' or 'gpipe' with {fsdp[0]}, or keep "
            f"{t.schedule!r} with zero_shard(1)")


def _block_names(value) -> str | tuple[str, ...]:
    """``blocks``: a module name, or a non-empty list of distinct module names."""
    if isinstance(value, str) and value:
        return value
    if isinstance(value, (tuple, list)) and value and len(set(value)) == len(value) and \
            all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise ConfigError(f"pipeline(blocks={value!r}): name the ModuleList or ModuleDict "
                      f"attribute holding the blocks, e.g. blocks='layers', or list the "
                      f"block modules, e.g. blocks=['h.0', 'h.1'] (distinct, non-empty names)")


def _layers(value) -> tuple[int, ...]:
    """``layers_per_stage``: a non-empty tuple (or list) of block counts, each >= 1."""
    if not isinstance(value, (tuple, list)) or not value:
        raise ConfigError(f"pipeline(layers_per_stage={value!r}): give one block count per "
                          f"stage, e.g. layers_per_stage=(3, 3, 2), or None to balance them")
    return tuple(check_int(n, "pipeline", f"layers_per_stage[{i}]", example=2)
                 for i, n in enumerate(value))


def _check_batch_norms(t: Pipeline, plan: Plan) -> None:
    """A stage's BatchNorm would normalize each microbatch with its own statistics, and an
    InstanceNorm keeping running statistics would update them once per microbatch, where
    the step over the whole batch normalizes with the batch's and updates once: refused
    by name."""
    from ..zero._batchnorm import BATCH_NORM, batch_norms, microbatch_error

    if t.microbatches <= 1 and t.microbatch_size is None:
        return
    for m in batch_norms(plan, instance=True):
        if BATCH_NORM.fullmatch(m.cls):
            raise microbatch_error(repr(t), m.fqn, m.cls, False,
                                   "pipeline a model without BatchNorm (GroupNorm or "
                                   "LayerNorm normalize each sample), or use data "
                                   "parallelism, whose BatchNorms see the whole batch")
        if m.get("track_running_stats"):
            raise microbatch_error(repr(t), m.fqn, m.cls, True,
                                   "build it with track_running_stats=False, or use data "
                                   "parallelism, which averages each rank's update")


def pipeline(axis: str = "pp", *, schedule: str = "1f1b", microbatches: int = 4,
             virtual_stages: int | None = None,
             layers_per_stage: tuple[int, ...] | list[int] | None = None,
             blocks: str | tuple[str, ...] | list[str] | None = None,
             microbatch_size: int | None = None) -> Pipeline:
    """Split the model's blocks into pipeline stages over mesh axis ``axis``.

    ``microbatch_size`` cuts each batch into microbatches of that many rows, however
    many rows it has (Colossal-AI's ``microbatch_size``); ``microbatches`` is then the
    count the plan's estimates take.

    ``blocks`` declares them for any model: the name of a ``ModuleList``/``ModuleDict``
    attribute, or a list of module names. The model's own forward then runs on every
    stage and skips what a stage does not hold (``None``; the contract is in
    ``_blocks`` and docs/transforms.md). Without it, a Hugging Face decoder laid out as
    ``embed_tokens -> layers -> norm`` runs on meshlab's stages of its parts.

    >>> pipeline('pp', schedule='interleaved', microbatches=8)
    pipeline('pp', schedule='interleaved', microbatches=8, virtual_stages=2)
    >>> pipeline('pp', blocks='layers')
    pipeline('pp', schedule='1f1b', microbatches=4, virtual_stages=1, blocks='layers')
    """
    return Pipeline(axis, schedule, microbatches, virtual_stages, layers_per_stage, blocks,
                    microbatch_size)


def stages(plan: Plan) -> list[Stage]:
    """The stages a bound plan's pipeline runs (as ``bind`` split the blocks, balanced by
    compute: the matmul weights each token meets, the head's counted on the last stage, an
    embedding's not at all); none without a pipeline."""
    t = plan.get(Pipeline)
    return [] if t is None else _schedule.stages(plan, t)


def bubble(plan: Plan) -> float:
    """Expected idle fraction of the pipeline schedule by the formula (module docstring);
    ``meshlab.estimate.pipeline.bubble(plan, batch=, seq=)`` replays it at profiled costs."""
    t = plan.get(Pipeline)
    return 0.0 if t is None else _schedule.bubble(plan, t)


def simulate(plan: Plan, forward: float = 1.0, backward: float = 2.0):
    """Replay the schedule with unit costs: ``[(rank, start, end, tag, microbatch, stage)]``."""
    return _schedule.simulate(plan, _need(plan), forward, backward)


def draw_schedule(plan: Plan) -> str:
    """A text picture of the schedule, one row per pipeline rank."""
    return _schedule.draw_schedule(plan, _need(plan))


def plot_schedule(plan: Plan, ax=None, forward: float = 1.0, backward: float = 2.0):
    """The schedule as a picture: one row per pipeline rank, a box per forward (blue),
    backward (orange) or weight-gradient step (green) at its replayed time, labelled with
    its microbatch; the gaps are the bubble, its share in the title. Returns the axes."""
    from ...core.log import require

    plt = require("matplotlib.pyplot", "plot", "pipeline.plot_schedule")
    events = simulate(plan, forward, backward)
    opt = _need(plan)
    p = plan.mesh_shape[opt.axis]
    end = max(e[2] for e in events)
    ax = ax or plt.subplots(figsize=(max(6.0, end / 4), 0.5 * p + 1.2))[1]
    colour = {"F": "tab:blue", "B": "tab:orange", "I": "tab:orange", "W": "tab:green"}
    for r in range(p):
        mine = [e for e in events if e[0] == r]
        for tag in sorted({e[3] for e in mine}):
            spans = [(t0, t1 - t0) for _, t0, t1, t, _, _ in mine if t == tag]
            bars = ax.broken_barh(spans, (r - 0.4, 0.8), facecolors=colour.get(tag, "gray"),
                                  edgecolor="white")
            bars.meshlab_events = [e for e in mine if e[3] == tag]
        for _, t0, t1, _, mb, _ in mine:
            ax.text((t0 + t1) / 2, r, str(mb), ha="center", va="center", fontsize=6)
    busy = sum(e[2] - e[1] for e in events) / (p * end)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.invert_yaxis()
    ax.set_xlim(0, end)
    ax.set_xlabel(f"time (forward = {forward:g}, backward = {backward:g})")
    ax.set_title(f"{opt.schedule}, {p} stages x {opt.microbatches} microbatches: "
                 f"idle {1 - busy:.1%}", fontsize=9)
    return ax


def stage_table(plan: Plan):
    """A rich table: each stage's rank, blocks and parameter bytes, and the bubble."""
    return _schedule.stage_table(plan, _need(plan))


def _head_modules(plan: Plan) -> set[str]:
    """Modules after the last block: the final norm, the head (the last stage's)."""
    last = plan.model.blocks[-1]
    names = [m.fqn for m in plan.model.modules]
    after = names[names.index(last) + 1:] if last in names else []
    return {n for n in after if n and not n.startswith(last + ".")} | (
        {plan.model.head} if plan.model.head else set())


def _need(plan: Plan) -> Pipeline:
    t = plan.get(Pipeline)
    if t is None:
        raise ConfigError("this plan has no pipeline(); compose one into the spec first")
    return t
