"""What the rooms decide at bind time is recorded in the plan and read from there: a
pipeline's stages, offload's host selection and expert placement are each worked out once
(``Transform.decide``), travel through JSON, and are refused on a plan that never bound."""

from __future__ import annotations

import dataclasses
import importlib
import json
import pytest

import meshlab as ml
from meshlab import PlanError
from meshlab.planning.decisions import register_decision
from meshlab.transforms.expert import ExpertPlacement
from meshlab.transforms.offload import Choice
from meshlab.transforms.pipeline import PipelineStages, stages

from tests import _models as M

_pipeline = importlib.import_module("meshlab.transforms.pipeline")
_offload = importlib.import_module("meshlab.transforms.offload")
_expert = importlib.import_module("meshlab.transforms.expert")


def _llama(layers: int = 4):
    return M.build("llama", num_hidden_layers=layers)


def _counting(monkeypatch, module, name: str) -> list:
    """Count the calls of ``module.name`` (the function a room's ``decide`` calls)."""
    calls, real = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_an_unbound_plan_has_no_decisions():
    traced = ml.pipeline("pp")(ml.trace(_llama()))
    with pytest.raises(PlanError, match=r"plan\.bind\(mesh\)"):
        traced.decision(PipelineStages)
    with pytest.raises(PlanError, match=r"plan\.bind\(mesh\)"):
        stages(traced)
    assert traced.decisions == ()


def test_the_pipeline_splits_its_blocks_once(monkeypatch):
    calls = _counting(monkeypatch, _pipeline._schedule, "split")
    p = ml.plan(_llama(), ml.pipeline("pp", microbatches=4), ml.Mesh(pp=2, fake=True))
    assert len(calls) == 1
    recorded = p.decision(PipelineStages)
    assert [s.blocks for s in recorded.stages] == [
        ("model.layers.0", "model.layers.1"), ("model.layers.2", "model.layers.3")]
    # every reader after bind reads the record
    p.memory(), p.comm(batch=2, seq=8), p.local_blocks({"pp": 1}), _pipeline.bubble(p)
    _pipeline.stage_table(p), _pipeline.draw_schedule(p)
    assert stages(p) == list(recorded.stages) and len(calls) == 1
    assert p.local_blocks({"pp": 1}) == recorded.stages[1].blocks
    assert all(s.rank_bytes > 0 for s in recorded.stages)


def test_offload_selects_once_and_every_reader_reads_the_selection(monkeypatch):
    calls = _counting(monkeypatch, _offload, "choose")
    p = ml.plan(_llama(), ml.zero_shard(1, "dp") | ml.offload(optimizer=0.5),
                ml.Mesh(dp=2, fake=True))
    assert len(calls) == 1
    off = p.get(ml.parallel.Offload)
    recorded = p.decision(Choice)
    p.memory(), off.step_cost(p)
    assert off.choice(p) is recorded and len(calls) == 1
    assert recorded.reached[2] >= 0.5


def test_expert_placement_is_recorded_once(monkeypatch):
    calls = _counting(monkeypatch, _expert, "place")
    p = ml.plan(M.build("mixtral"), ml.expert_route("ep"), ml.Mesh(ep=2, fake=True))
    assert len(calls) == 1
    where = p.decision(ExpertPlacement)
    assert where.ranks == 2 and where.layouts == tuple(_expert.experts_of(p))
    assert all(n == x.num_experts // 2 for n, x in zip(where.per_rank, where.layouts))
    x = where.layouts[0]
    assert list(where.held(x, 1)) == list(range(x.num_experts // 2, x.num_experts))
    p.memory(), p.comm(batch=2, seq=8), p.get(ml.parallel.ExpertRoute).load(p, batch=2, seq=8)
    assert len(calls) == 1


@pytest.mark.parametrize("case", ["pipeline", "offload", "expert"])
def test_decisions_travel_through_json(case):
    spec, mesh, family, cls = {
        "pipeline": (ml.pipeline("pp"), ml.Mesh(pp=2, fake=True), "llama", PipelineStages),
        "offload": (ml.zero_shard(3, "dp") | ml.offload(params=0.5, grads=0.5, optimizer=1.0),
                    ml.Mesh(dp=2, fake=True), "llama", Choice),
        "expert": (ml.expert_route("ep"), ml.Mesh(ep=2, fake=True), "mixtral",
                   ExpertPlacement)}[case]
    p = ml.plan(M.build(family), spec, mesh)
    text = p.to_json()
    assert [d["kind"] for d in json.loads(text)["decisions"]] == \
        [{"pipeline": "pipeline.stages", "offload": "offload.choice",
          "expert": "expert_route.placement"}[case]]
    back = ml.Plan.from_json(text)
    assert back == p and back.decision(cls) == p.decision(cls)


def test_a_bound_plan_without_its_record_is_refused_with_the_fix():
    p = ml.plan(_llama(), ml.zero_shard(1, "dp") | ml.offload(optimizer=1.0),
                ml.Mesh(dp=2, fake=True))
    bare = p.replace(decisions=())
    with pytest.raises(PlanError, match=r"plan\.bind\(mesh\)"):
        bare.get(ml.parallel.Offload).choice(bare)
    q = ml.plan(_llama(), ml.pipeline("pp"), ml.Mesh(pp=2, fake=True))
    with pytest.raises(PlanError, match=r"plan\.bind\(mesh\)"):
        stages(q.replace(decisions=()))


@dataclasses.dataclass(frozen=True)
class _Seen:
    """A test room's decision: the decisions it saw when it decided."""

    before: tuple[str, ...]

    def to_json(self) -> dict:
        return {"before": list(self.before)}

    @classmethod
    def from_json(cls, d: dict) -> "_Seen":
        return cls(tuple(d["before"]))


register_decision("tests.seen", _Seen)


def test_a_room_sees_the_decisions_of_the_rooms_before_it(monkeypatch):
    """``bind`` asks the rooms in install order; each sees what those before it decided."""
    from meshlab.transforms import Offload, ZeroShard

    seen, real = [], Offload.decide

    def spy(self, plan):
        seen.append(plan.decisions)
        return real(self, plan)

    monkeypatch.setattr(ZeroShard, "decide", lambda self, plan: _Seen(
        tuple(type(d).__name__ for d in plan.decisions)))
    monkeypatch.setattr(Offload, "decide", spy)
    p = ml.plan(_llama(), ml.zero_shard(1, "dp") | ml.offload(optimizer=1.0),
                ml.Mesh(dp=2, fake=True))
    assert seen == [(_Seen(()),)]                    # offload (after zero) saw zero's
    assert [type(d) for d in p.decisions] == [_Seen, Choice]
    assert ml.Plan.from_json(p.to_json()).decisions == p.decisions


def test_a_decision_name_belongs_to_one_type():
    @dataclasses.dataclass(frozen=True)
    class Other:
        pass

    with pytest.raises(PlanError, match="taken by"):
        register_decision("tests.seen", Other)
