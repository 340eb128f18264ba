"""Checkpoints in one process: atomicity, retention, async staging, strict reports, and
the refusal of pickles (their payload never runs)."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from torch import nn

import meshlab as ml
from meshlab.checkpoint import CheckpointError

pytestmark = pytest.mark.timeout(120)


def _model(seed=0, hidden=8):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, hidden), nn.Tanh(), nn.Linear(hidden, 2))


def _trained(seed=0):
    m = _model(seed)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(2):
        m(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_save_load_roundtrip_with_optimizer_and_extra(tmp_path):
    m, opt = _trained()
    ml.checkpoint.save(tmp_path / "step-2", m, opt, extra={"step": 2, "note": "x"})
    m2 = _model(seed=9)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    extra, report = ml.checkpoint.load(tmp_path / "step-2", m2, opt2)
    assert extra == {"step": 2, "note": "x"} and report.ok
    assert _same(m, m2)
    for p, q in zip(m.parameters(), m2.parameters()):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], opt2.state[q][k]), k


def test_existing_step_is_not_overwritten_by_default(tmp_path):
    m, opt = _trained()
    ml.checkpoint.save(tmp_path / "s", m, opt)
    with pytest.raises(CheckpointError, match="overwrite=True"):
        ml.checkpoint.save(tmp_path / "s", m, opt)
    m.state_dict()["0.weight"].add_(1.0)
    ml.checkpoint.save(tmp_path / "s", m, opt, overwrite=True)
    m2 = _model(seed=3)
    ml.checkpoint.load(tmp_path / "s", m2)
    assert _same(m, m2)


def test_incomplete_directory_is_never_loaded(tmp_path):
    m, opt = _trained()
    ml.checkpoint.save(tmp_path / "step-1", m, opt, extra={"step": 1})
    ml.checkpoint.save(tmp_path / "step-2", m, opt, extra={"step": 2})
    os.remove(tmp_path / "step-2" / "meshlab.json")          # as if the commit never happened
    os.makedirs(tmp_path / "step-3.partial")
    assert ml.checkpoint.latest(tmp_path) == str(tmp_path / "step-1")
    with pytest.raises(CheckpointError, match="interrupted save"):
        ml.checkpoint.load(tmp_path / "step-2", _model())


def test_keep_last_never_deletes_the_newest_valid(tmp_path):
    m, opt = _trained()
    for s in range(1, 5):
        ml.checkpoint.save(tmp_path / f"step-{s}", m, opt, extra={"step": s}, keep_last=2)
    left = sorted(p for p in os.listdir(tmp_path) if ml.checkpoint.is_complete(tmp_path / p))
    assert left == ["step-3", "step-4"]
    with pytest.raises(CheckpointError, match="keep at least"):
        ml.checkpoint.save(tmp_path / "step-5", m, opt, keep_last=0)
    assert ml.checkpoint.latest(tmp_path) == str(tmp_path / "step-4")


def test_async_save_stages_before_returning(tmp_path):
    m, opt = _trained()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    ml.checkpoint.save(tmp_path / "a", m, opt, async_save=True)
    with torch.no_grad():                      # later updates must not reach the file
        for p in m.parameters():
            p.add_(100.0)
    ml.checkpoint.save(tmp_path / "b", m, opt, async_save=True)   # waits for "a" first
    ml.checkpoint.wait()
    m2 = _model(seed=5)
    ml.checkpoint.load(tmp_path / "a", m2)
    assert all(torch.equal(before[k], v) for k, v in m2.state_dict().items())
    ml.checkpoint.load(tmp_path / "b", m2)
    assert _same(m, m2)


def test_strict_load_names_keys_and_shapes(tmp_path):
    m, opt = _trained()
    ml.checkpoint.save(tmp_path / "s", m, opt)
    other = _model(hidden=16)
    with pytest.raises(CheckpointError) as ei:
        ml.checkpoint.load(tmp_path / "s", other)
    msg = str(ei.value)
    assert "0.weight: saved (8, 4) torch.float32, expected (16, 4) torch.float32" in msg
    extra, report = ml.checkpoint.load(tmp_path / "s", other, strict=False)
    assert {x[0] for x in report.mismatched} == {"0.weight", "0.bias", "2.weight"}
    assert torch.equal(other.state_dict()["2.bias"], m.state_dict()["2.bias"])  # what fits loads
    bigger = nn.Sequential(*_model(), nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match="missing from the checkpoint: \\['3.bias', '3.weight'\\]"):
        ml.checkpoint.load(tmp_path / "s", bigger)


class _Payload:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_pickle_payload_in_metadata_never_runs(tmp_path):
    m, opt = _trained()
    ml.checkpoint.save(tmp_path / "s", m, opt)
    sentinel = tmp_path / "pwned"
    with open(tmp_path / "s" / ".metadata", "wb") as f:
        pickle.dump({"x": _Payload(sentinel)}, f)
    with pytest.raises(CheckpointError, match="posix.system|os.system|refuses"):
        ml.checkpoint.load(tmp_path / "s", _model())
    assert not sentinel.exists()


def test_pickled_objects_in_a_dcp_checkpoint_are_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    m, _ = _trained()
    path = tmp_path / "foreign"
    dcp.save({**m.state_dict(), "blob": {"python": "object"}}, checkpoint_id=str(path),
             no_dist=True)
    with open(path / "meshlab.json", "w") as f:   # even when it looks committed
        json.dump({"format": "meshlab.checkpoint/1", "world_size": 1}, f)
    with pytest.raises(CheckpointError, match="pickled objects"):
        ml.checkpoint.load(path, _model())


def test_scheduler_and_dataloader_position_resume(tmp_path):
    m, opt = _trained()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    sched.step()
    ds = torch.utils.data.TensorDataset(torch.arange(20))
    dl = ml.dataloader(ds, ml.Mesh(dp=1, fake=True), batch_size=2, axes=())
    it = iter(dl)
    seen = [next(it)[0].tolist() for _ in range(3)]
    ml.checkpoint.save(tmp_path / "s", m, opt, sched, dataloader=dl)
    rest = [b[0].tolist() for b in it]
    m2 = _model(seed=1)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    dl2 = ml.dataloader(ds, ml.Mesh(dp=1, fake=True), batch_size=2, axes=())
    ml.checkpoint.load(tmp_path / "s", m2, opt2, sched2, dataloader=dl2)
    assert sched2.state_dict() == sched.state_dict()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert [b[0].tolist() for b in dl2] == rest and len(seen) + len(rest) == 10
