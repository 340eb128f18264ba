"""Checkpoints in one process: atomicity, retention, async staging, strict reports, and
the refusal of pickles (their payload never runs)."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import warnings

import pytest
import torch
from torch import nn

import meshlab as ml
from meshlab.checkpoint import CheckpointError
from meshlab.checkpoint._files import seal

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
    with pytest.raises(ml.MeshlabError, match="keep at least|keep_last must be"):
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


def _forge(path, name, data: bytes):
    """Write ``data`` as file ``name`` of checkpoint ``path`` and record its checksum in
    the marker (and the marker's own), as a crafted checkpoint would: only the content
    checks remain."""
    with open(path / name, "wb") as f:
        f.write(data)
    marker = json.loads((path / "meshlab.json").read_text())
    marker["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "meshlab.json").write_text(json.dumps(seal(marker)))


def test_pickle_payload_in_metadata_never_runs(tmp_path):
    m, opt = _trained()
    ml.checkpoint.save(tmp_path / "s", m, opt)
    sentinel = tmp_path / "pwned"
    payload = pickle.dumps({"x": _Payload(sentinel)})
    with open(tmp_path / "s" / ".metadata", "wb") as f:
        f.write(payload)
    with pytest.raises(CheckpointError, match=r"\.metadata is truncated"):
        ml.checkpoint.load(tmp_path / "s", _model())
    _forge(tmp_path / "s", ".metadata", payload)      # the checksum matches: the unpickler
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
    with pytest.warns(UserWarning, match="cannot be verified"), \
            pytest.raises(CheckpointError, match="pickled objects"):
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


# -- damage is named, never loaded -------------------------------------------------------
def _shard(path):
    return next(n for n in sorted(os.listdir(path)) if n.endswith(".distcp"))


def _flip(path, offset=200):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def _damage(kind, ck, other):
    shard = ck / _shard(ck)
    if kind == "flip":
        _flip(shard)
    elif kind == "truncate":
        shard.write_bytes(shard.read_bytes()[:-7])
    elif kind == "missing":
        os.remove(shard)
    elif kind == "swap":              # the same file of another checkpoint: sizes agree
        shutil.copy(other / shard.name, shard)
    elif kind == "metadata":
        _forge(ck, ".metadata", b"\x80\x04garbage, not a pickle")
    elif kind == "rank-file":
        _forge(ck, "rank-00000.json", b'{"rng": {"torch": "@@"}}')
    elif kind == "no-rank-file":
        marker = json.loads((ck / "meshlab.json").read_text())
        del marker["files"]["rank-00000.json"]
        (ck / "meshlab.json").write_text(json.dumps(seal(marker)))
        os.remove(ck / "rank-00000.json")
    return shard.name


@pytest.mark.parametrize("kind, damage", [
    ("flip", "is damaged: its SHA-256"), ("truncate", "is truncated"),
    ("missing", "is missing"), ("swap", "is damaged: its SHA-256"),
    ("metadata", r"\.metadata is damaged: it is not DCP metadata"),
    ("rank-file", r"rank-00000\.json is damaged: its random-number states"),
    ("no-rank-file", r"rank-00000\.json is missing")])
def test_damaged_files_are_named_before_anything_is_written(tmp_path, kind, damage):
    m, opt = _trained()
    ml.checkpoint.save(tmp_path / "a", m, opt)
    ml.checkpoint.save(tmp_path / "b", *_trained(seed=4))
    name = _damage(kind, tmp_path / "a", tmp_path / "b")
    fresh = _model(seed=7)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError, match=damage) as ei:
        ml.checkpoint.load(tmp_path / "a", fresh, torch.optim.AdamW(fresh.parameters()))
    if kind in ("flip", "truncate", "missing", "swap"):
        assert name in str(ei.value)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())


def _crafted(tmp_path, where):
    """A checkpoint whose .metadata (checksum forged) points its shard at ``where``."""
    m, opt = _trained()
    ck = tmp_path / "s"
    ml.checkpoint.save(ck, m, opt)
    md = pickle.loads((ck / ".metadata").read_bytes())  # our own file: safe to unpickle here
    for info in md.storage_data.values():
        info.relative_path = where
    _forge(ck, ".metadata", pickle.dumps(md))
    return ck


@pytest.mark.parametrize("where", ["../secret.distcp", "/etc/hostname", "link.distcp"])
def test_metadata_pointing_outside_the_directory_is_refused(tmp_path, where):
    ck = _crafted(tmp_path, where)
    shutil.copy(ck / _shard(ck), tmp_path / "secret.distcp")
    os.symlink(tmp_path / "secret.distcp", ck / "link.distcp")
    with pytest.raises(CheckpointError, match="outside the checkpoint directory|leading out"):
        ml.checkpoint.load(ck, _model())


def test_metadata_pointing_at_an_unlisted_file_is_refused(tmp_path):
    ck = _crafted(tmp_path, "extra.distcp")
    shutil.copy(ck / _shard(ck), ck / "extra.distcp")
    with pytest.raises(CheckpointError, match="not one of the files the checkpoint's marker"):
        ml.checkpoint.load(ck, _model())


# -- bad markers are skipped; extra is a dict ----------------------------------------------
def test_latest_skips_bad_markers_and_returns_the_newest_good(tmp_path):
    m, opt = _trained()
    for s in (1, 2, 3, 4):
        ml.checkpoint.save(tmp_path / f"step-{s}", m, opt, extra={"step": s})
    marker = (tmp_path / "step-2" / "meshlab.json").read_text()
    (tmp_path / "step-4" / "meshlab.json").write_text(marker[:len(marker) // 2])  # truncated
    (tmp_path / "step-3" / "meshlab.json").write_text("[]")
    (tmp_path / "step-5").mkdir()
    (tmp_path / "step-5" / "meshlab.json").write_text(json.dumps({**json.loads(marker),
                                                                  "extra": [1, 2]}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert ml.checkpoint.latest(tmp_path) == str(tmp_path / "step-2")
    text = "\n".join(str(w.message) for w in caught)
    for bad in ("step-3", "step-4", "step-5"):
        assert f"skipping {tmp_path / bad}" in text, text
    with pytest.raises(CheckpointError, match="not a JSON document"):
        ml.checkpoint.load(tmp_path / "step-4", _model())
    with pytest.raises(CheckpointError, match="holds a JSON list"):
        ml.checkpoint.load(tmp_path / "step-3", _model())


@pytest.mark.parametrize("extra", [[1, 2], "step-3", {1: "a"}, {"f": object()}])
def test_extra_must_be_a_dict_of_json_values(tmp_path, extra):
    m, opt = _trained()        # a typed error: ConfigTypeError (argument check) or CheckpointError
    with pytest.raises((CheckpointError, ml.ConfigError), match="extra"):
        ml.checkpoint.save(tmp_path / "s", m, opt, extra=extra)
    assert os.listdir(tmp_path) == []           # refused before anything was written


# -- a save before the first step changes nothing -----------------------------------------
def _run(tmp_path=None, save_at_start=False, resume=None, steps=3):
    m = _model(seed=2)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    if resume is not None:          # an optimizer with state of its own loads "no state yet"
        m(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        ml.checkpoint.load(resume, m, opt)
        assert not opt.state
    if save_at_start:
        ml.checkpoint.save(tmp_path / "step-0", m, opt, extra={"step": 0})
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        loss = m(torch.randn(5, 4, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in m.state_dict().items()}, opt


def test_a_save_before_the_first_step_changes_nothing(tmp_path):
    plain_losses, plain_w, plain_opt = _run()
    losses, w, opt = _run(tmp_path, save_at_start=True)
    assert losses == plain_losses
    assert all(torch.equal(plain_w[k], v) for k, v in w.items())
    for p, q in zip(plain_opt.state.values(), opt.state.values()):
        assert all(torch.equal(p[k], q[k]) for k in p)       # step counters included
    # and a run resumed from that checkpoint is the same run
    resumed_losses, resumed_w, _ = _run(resume=tmp_path / "step-0")
    assert resumed_losses == plain_losses
    assert all(torch.equal(plain_w[k], v) for k, v in resumed_w.items())


class _CountingSGD(torch.optim.Optimizer):
    """An optimizer that keeps its step as a Python int in the state (as LAMB and
    Colossal-AI's optimizers do) and decays its update by it."""

    def __init__(self, params, lr=0.1, extra=None):
        super().__init__(params, {"lr": lr})
        self.extra = extra

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                st["step"] = st.get("step", 0) + 1
                if self.extra is not None:
                    st["extra"] = self.extra
                p.add_(p.grad, alpha=-g["lr"] / st["step"])


def _count_steps(m, opt, xs):
    for x in xs:
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()


def test_numbers_in_optimizer_state_survive_a_resume(tmp_path):
    """A step kept as an int is saved and loaded (it was dropped, and the resumed run
    restarted its decay at step 1); state of any other kind is refused by name."""
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    whole = _model()
    _count_steps(whole, _CountingSGD(whole.parameters()), xs)
    m = _model()
    opt = _CountingSGD(m.parameters())
    _count_steps(m, opt, xs[:2])
    ml.checkpoint.save(tmp_path / "s", m, opt)
    m2 = _model(seed=1)
    opt2 = _CountingSGD(m2.parameters())
    ml.checkpoint.load(tmp_path / "s", m2, opt2)
    assert all(type(st["step"]) is int and st["step"] == 2 for st in opt2.state.values())
    _count_steps(m2, opt2, xs[2:])
    assert _same(m2, whole)
    m3 = _model()
    bad = _CountingSGD(m3.parameters(), extra=[1, 2])
    _count_steps(m3, bad, xs[:1])
    with pytest.raises(CheckpointError, match="'extra' of 0.weight is a list"):
        ml.checkpoint.save(tmp_path / "t", m3, bad)


def test_a_save_that_fails_off_the_disk_does_not_advise_freeing_space():
    """torch's checkpoint writer refusing a layout (GPT-2's fused c_attn split by heads
    under tensor parallelism: "overlapping chunks") was reported with the disk's advice,
    free space or save elsewhere; only a failure of the disk gets that advice now."""
    import errno

    from meshlab.checkpoint._ranks import as_error

    planner = as_error(ValueError("Failed to validate global plan: overlapping chunks"),
                       "save", "/ckpt")
    assert "not a disk fault" in str(planner) and "Free space" not in str(planner)
    assert "save_pretrained" in str(planner)
    full = as_error(OSError(errno.ENOSPC, "No space left on device", "/ckpt/x"), "save", "/ckpt")
    assert "ran out of space" in str(full) and "Free space" in str(full)
