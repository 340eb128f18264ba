"""A pipeline's schedule at profiled costs: each stage's forward and backward timed from
the one-block profile on a machine, and the schedule replayed with them (the pipeline
room's own ``bubble`` is the formula, with equal stages)."""

from __future__ import annotations

from ..core.errors import ConfigError, PlanError
from ..planning.plan import Plan
from ..transforms.pipeline import Pipeline, _schedule
from ..transforms.pipeline import bubble as _formula
from .machine import machine
from .profile import profile
from .time import part_seconds


def bubble(plan: Plan, *, batch: int | None = None, seq: int | None = None,
           gpu="h200", inputs=None, loss=None) -> float:
    """Expected idle fraction of the pipeline schedule, the mean over its ranks: the
    formula (``meshlab.transforms.pipeline.bubble``), or with ``batch`` and ``seq`` (per
    data-parallel rank) the schedule replayed at each stage's profiled costs on ``gpu``,
    where the first stage also runs the embeddings and the last the final norm, head and
    loss (``inputs`` / ``loss``: the example step, ``meshlab.estimate.example``)."""
    if plan.get(Pipeline) is None:
        return 0.0
    if batch is None and seq is None:
        return _formula(plan)
    return costed(plan, batch=batch, seq=seq, gpu=gpu, inputs=inputs, loss=loss)["mean"]


def costed(plan: Plan, *, batch: int, seq: int, gpu="h200", inputs=None, loss=None) -> dict:
    """The schedule replayed at each stage's profiled costs (``bubble``): ``{'mean',
    'busiest', 'per_rank', 'step', 'costs'}``, costs per stage and microbatch (forward,
    backward) in seconds on ``gpu``."""
    t = plan.get(Pipeline)
    if t is None:
        raise ConfigError("this plan has no pipeline(); compose one into the spec first")
    if batch is None or seq is None:
        raise ConfigError("pipeline.costed: give both batch and seq (per data-parallel rank)")
    if plan.source is None:
        raise PlanError("pipeline.costed: this plan has no model to profile (read from "
                        "JSON); plan the model with meshlab.plan(model, spec, mesh)")
    seconds = part_seconds(profile(plan.source, plan, batch, seq, inputs, loss), machine(gpu))
    costs = _schedule.stage_costs(plan, t, seconds)
    return {**_schedule.idle(plan, t, costs), "costs": costs}
