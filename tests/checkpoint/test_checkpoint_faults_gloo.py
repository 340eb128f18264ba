"""Checkpoint faults: a save killed before each of its filesystem steps, a disk that fills
up on one rank, a rank that fails alone, damaged files read by two ranks, pipeline stages
loading strictly, a ZeRO-1 load that does not fit, and an asynchronous save beside the
steps' agreement.

The kill tests fork a child that runs the save and SIGKILLs itself just before its k-th
filesystem step (rename, replace, unlink, rmdir, mkdir, fsync: every step that changes
what is on disk, or makes it durable), for every k until the save completes; after each
kill the previous checkpoint or the new one must be found and load whole, never neither,
and the next save must tidy what the killed one left.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import shutil
import signal
import time

import pytest
import torch
from torch import nn

from tests import _models as M
from tests._world import World

pytestmark = pytest.mark.timeout(300)

_STEPS = ("rename", "replace", "unlink", "remove", "rmdir", "mkdir", "fsync")


def _killed_at(k: int, action) -> bool:
    """Run ``action`` in a forked child SIGKILLed just before its k-th filesystem step;
    True if it finished first (there is no k-th step)."""
    pid = os.fork()
    if pid == 0:                                   # the child: never returns
        code = 0
        try:
            count = [0]

            def counted(fn):
                def step(*args, **kwargs):
                    count[0] += 1
                    if count[0] == k:
                        os.kill(os.getpid(), signal.SIGKILL)
                    return fn(*args, **kwargs)
                return step

            for name in _STEPS:
                setattr(os, name, counted(getattr(os, name)))
            action()
        except BaseException:
            code = 3
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the save killed at step {k} hung")
        time.sleep(0.002)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return False
    assert os.WEXITSTATUS(status) == 0, f"the save failed (not killed) at step {k}"
    return True


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _which(model: nn.Module, versions: dict[str, nn.Module]) -> str:
    sd = model.state_dict()
    for name, ref in versions.items():
        if all(torch.equal(sd[k], v) for k, v in ref.state_dict().items()):
            return name
    raise AssertionError("what loaded is neither checkpoint: data was lost or mixed")


def _kill_everywhere(tmp_path, start, save, found, label):
    """For k = 1, 2, ...: copy ``start``, kill ``save(work)`` before step k, record
    ``found(work)``; returns the states seen and a copy of the first crash state whose
    target directory is gone."""
    seen, gone = [], None
    for k in itertools.count(1):
        work = tmp_path / f"{label}-{k}"
        shutil.copytree(start, work, symlinks=True)
        finished = _killed_at(k, lambda: save(work))
        if gone is None and not (work / "ck").exists():
            gone = shutil.copytree(work, tmp_path / f"{label}-gone")
        seen.append(found(work))
        shutil.rmtree(work)
        if finished:
            return seen, gone


def _in_order(seen: list[str], order: list[str]) -> None:
    assert seen[0] == order[0] and seen[-1] == order[-1], seen
    assert seen == sorted(seen, key=order.index), f"went back after the commit: {seen}"


def test_overwrite_killed_before_every_step_keeps_the_old_or_the_new(tmp_path):
    import meshlab as ml

    versions = {"old": _model(1), "new": _model(2), "next": _model(3)}
    start = tmp_path / "start"
    ml.checkpoint.save(start / "ck", versions["old"], extra={"step": 1})

    def found(work):
        path = ml.checkpoint.latest(work)
        assert path is not None, f"no committed checkpoint in {sorted(os.listdir(work))}"
        model = _model(0)
        extra, _ = ml.checkpoint.load(work / "ck", model)   # the name finds it too
        state = _which(model, versions)
        assert extra == {"step": {"old": 1, "new": 2, "next": 3}[state]}
        # the next save recovers whatever the kill left, and leaves nothing else
        ml.checkpoint.save(work / "ck", versions["next"], extra={"step": 3}, overwrite=True)
        assert sorted(os.listdir(work)) == ["ck"]
        return state

    def overwrite(work):
        ml.checkpoint.save(work / "ck", versions["new"], extra={"step": 2}, overwrite=True)

    seen, gone = _kill_everywhere(tmp_path, start, overwrite, found, "save")
    assert len(seen) > 15, seen                      # the steps were really counted
    _in_order(seen, ["old", "new"])
    assert gone is not None       # some kill fell between the two renames: only .old held it

    def again(work):              # and a save killed while it recovers from that state
        ml.checkpoint.save(work / "ck", versions["next"], extra={"step": 3}, overwrite=True)

    seen, _ = _kill_everywhere(tmp_path, gone, again, found, "recover")
    _in_order(seen, ["old", "next"])


def test_save_pretrained_killed_before_every_step_keeps_the_old_or_the_new(tmp_path):
    import meshlab as ml

    versions = {"old": _model(1), "new": _model(2)}
    start = tmp_path / "start"
    ml.checkpoint.save_pretrained(start / "ck", versions["old"], max_shard_size=100)

    def found(work):
        model = _model(0)
        assert ml.checkpoint.load_pretrained(work / "ck", model).ok
        state = _which(model, versions)
        ml.checkpoint.save_pretrained(work / "ck", versions["new"], max_shard_size=100)
        assert sorted(os.listdir(work)) == ["ck"]
        return state

    def export(work):
        ml.checkpoint.save_pretrained(work / "ck", versions["new"], max_shard_size=100)

    seen, gone = _kill_everywhere(tmp_path, start, export, found, "hf")
    assert len(seen) > 12, seen
    _in_order(seen, ["old", "new"])
    assert gone is not None


def test_a_failed_save_removes_what_it_wrote(tmp_path, monkeypatch):
    """One process: the writer hits ENOSPC; the error says so, .partial is gone, and the
    next save succeeds."""
    import torch.distributed.checkpoint.filesystem as fs

    import meshlab as ml

    m = _model(1)
    ml.checkpoint.save(tmp_path / "step-1", m, extra={"step": 1})
    real = fs._write_item

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fs, "_write_item", full)
    with pytest.raises(ml.checkpoint.CheckpointError, match="rank 0 ran out of space") as ei:
        ml.checkpoint.save(tmp_path / "step-2", m, extra={"step": 2})
    assert "step-2" in str(ei.value) and "Free space" in str(ei.value)
    assert sorted(os.listdir(tmp_path)) == ["step-1"]
    monkeypatch.setattr(fs, "_write_item", real)
    ml.checkpoint.save(tmp_path / "step-2", m, extra={"step": 2})
    assert ml.checkpoint.latest(tmp_path) == str(tmp_path / "step-2")


# -- two gloo ranks ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world():
    w = World(2)
    yield w
    w.close()


_CACHE: dict = {}


def _tp(world_size):
    """A tensor-parallel Llama and its optimizer, built once per process and spec."""
    import meshlab as ml

    if "tp" not in _CACHE:
        model = ml.parallelize(M.build("llama"), M.spec("tp"), M.mesh_for("tp", world_size),
                               seed=0)
        _CACHE["tp"] = model, ml.optimizer(model, torch.optim.AdamW, lr=1e-3)
    return _CACHE["tp"]


def _caught(fn):
    """(error type, message) of the ``CheckpointError`` ``fn`` raises; anything else fails."""
    import meshlab as ml

    try:
        fn()
    except ml.checkpoint.CheckpointError as e:
        return type(e).__name__, str(e)
    raise AssertionError("no CheckpointError was raised")


def enospc_case(rank, world, directory, where):
    """``where`` fails with ENOSPC on one rank: the DCP writer (rank 1), its RNG file
    (rank 1) or the marker (rank 0). Every rank raises; the next save succeeds."""
    import torch.distributed.checkpoint.filesystem as fs

    import meshlab as ml
    from meshlab.checkpoint import _dcp

    model, opt = _tp(world)
    ml.step(model, opt, {"input_ids": M.batches(1)[0]})
    ml.checkpoint.save(os.path.join(directory, "step-1"), model, opt, extra={"step": 1})
    real_item, real_json = fs._write_item, _dcp.write_json
    victim = {"shard": 1, "rank-file": 1, "marker": 0}[where]
    target = {"rank-file": "rank-00001.json", "marker": "meshlab.json"}.get(where)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def json_full(path, obj):
        if path.endswith(target):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path + ".tmp")
        return real_json(path, obj)

    if rank == victim:
        if where == "shard":
            fs._write_item = full
        else:
            _dcp.write_json = json_full
    try:
        out = _caught(lambda: ml.checkpoint.save(os.path.join(directory, "step-2"), model, opt,
                                                 extra={"step": 2}, timeout=30))
    finally:
        fs._write_item, _dcp.write_json = real_item, real_json
    listing = sorted(os.listdir(directory))
    ml.checkpoint.save(os.path.join(directory, "step-2"), model, opt, extra={"step": 2})
    return out, listing, os.path.basename(ml.checkpoint.latest(directory))


@pytest.mark.parametrize("where", ["shard", "rank-file", "marker"])
def test_disk_full_on_one_rank_raises_on_every_rank(world, tmp_path, where):
    out = world.run(enospc_case, directory=str(tmp_path), where=where, timeout=120)
    victim = {"shard": 1, "rank-file": 1, "marker": 0}[where]
    for r, ((kind, msg), listing, newest) in enumerate(out):
        assert f"rank {victim} ran out of space" in msg, (r, msg)
        assert "step-2" in msg and "nothing was committed" in msg, msg
        if where != "shard":     # DCP shares its own failure; meshlab's is agreed
            assert kind == ("CheckpointError" if r == victim else "CheckpointPeerError"), kind
        if where == "marker":
            assert "meshlab.json" in msg
        assert newest == "step-2"
    assert out[0][1] == ["step-1"]       # the failed save left nothing behind


def _snapshot(model, opt):
    """Every full parameter and optimizer tensor (collective: every rank calls it)."""
    import meshlab as ml

    opt_t, _ = ml.checkpoint._state.optimizer_state(opt, model)
    return ({n: M.full(p).detach().clone() for n, p in model.named_parameters()},
            {k: M.full(v).detach().clone() for k, v in opt_t.items()})


def _same(a: dict, b: dict, keys=None) -> bool:
    return all(torch.equal(a[k], b[k]) for k in (a if keys is None else keys))


def save_tp_case(rank, world, path):
    import meshlab as ml

    model, opt = _tp(world)
    ml.step(model, opt, {"input_ids": M.batches(1)[0]})
    ml.checkpoint.save(path, model, opt, extra={"step": 1})


def damaged_load_case(rank, world, path):
    """Loading a damaged checkpoint raises on every rank and writes nothing."""
    import meshlab as ml

    model, opt = _tp(world)
    before = _snapshot(model, opt)
    out = _caught(lambda: ml.checkpoint.load(path, model, opt, timeout=30))
    after = _snapshot(model, opt)
    assert _same(before[0], after[0]) and _same(before[1], after[1]), "half-loaded"
    return out


def _swap(ck):
    a, b = ck / "__0_0.distcp", ck / "__1_0.distcp"
    tmp = ck / "swap"
    os.rename(a, tmp)
    os.rename(b, a)
    os.rename(tmp, b)
    return r"__[01]_0\.distcp is (damaged|truncated|longer)"


def _forge(ck, name, data: bytes):
    import hashlib

    from meshlab.checkpoint._files import seal

    (ck / name).write_bytes(data)
    marker = json.loads((ck / "meshlab.json").read_text())
    marker["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ck / "meshlab.json").write_text(json.dumps(seal(marker)))


def _drop(ck, name):
    from meshlab.checkpoint._files import seal

    marker = json.loads((ck / "meshlab.json").read_text())
    del marker["files"][name]
    (ck / "meshlab.json").write_text(json.dumps(seal(marker)))
    os.remove(ck / name)


def _cut(path):
    path.write_bytes(path.read_bytes()[:100])


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04
    path.write_bytes(bytes(data))


_DAMAGE = {   # kind: (damage it, what every rank's message says, the rank that finds it)
    "flip": (lambda ck: _flip(ck / "__1_0.distcp"), r"__1_0\.distcp is damaged: its SHA", 0),
    "truncate": (lambda ck: _cut(ck / "__0_0.distcp"), r"__0_0\.distcp is truncated", None),
    "missing": (lambda ck: os.remove(ck / "__1_0.distcp"), r"__1_0\.distcp is missing", None),
    "swap": (_swap, None, None),
    "metadata": (lambda ck: _forge(ck, ".metadata", os.urandom(300)),
                 r"\.metadata is damaged: it is not DCP metadata", None),
    "rank-file": (lambda ck: _forge(ck, "rank-00001.json", b"{\"rng\": [1, 2"),
                  r"rank-00001\.json is damaged: not a JSON", 1),
    "no-rank-file": (lambda ck: _drop(ck, "rank-00001.json"), r"rank-00001\.json is missing", 1),
}


@pytest.fixture(scope="module")
def pristine(world, tmp_path_factory):
    path = tmp_path_factory.mktemp("pristine") / "ck"
    world.run(save_tp_case, path=str(path))
    return path


@pytest.mark.parametrize("kind", sorted(_DAMAGE))
def test_damage_read_by_two_ranks_is_named_on_every_rank(world, pristine, tmp_path, kind):
    import re

    ck = shutil.copytree(pristine, tmp_path / "ck")
    damage, expect, finder = _DAMAGE[kind]
    expect = damage(ck) or expect
    out = world.run(damaged_load_case, path=str(ck), timeout=120)
    for r, (cls, msg) in enumerate(out):
        assert re.search(expect, msg), (r, msg)
        if finder is not None:    # found by one rank only: the other is told, not left waiting
            assert cls == ("CheckpointError" if r == finder else "CheckpointPeerError"), (r, cls)
            assert r == finder or f"rank {finder}" in msg


def pipeline_case(rank, world, directory):
    """A pipeline checkpoint loads back strictly on the same mesh (each stage checks the
    keys it owns; together they cover the checkpoint)."""
    import meshlab as ml

    mesh = ml.Mesh(ml.Mesh.parse("pp=2").shape)
    spec = ml.pipeline("pp", schedule="1f1b", microbatches=2)

    def build(seed):
        m = ml.parallelize(M.build("llama"), spec, mesh, seed=seed)
        return m, ml.optimizer(m, torch.optim.AdamW, lr=1e-3)

    model, opt = build(0)
    ml.step(model, opt, {"input_ids": M.batches(1)[0]})
    path = os.path.join(directory, "pp")
    ml.checkpoint.save(path, model, opt, extra={"step": 1})
    other, other_opt = build(5)
    extra, report = ml.checkpoint.load(path, other, other_opt)
    assert report.ok and extra == {"step": 1}, str(report)
    saved, loaded = _snapshot(model, opt), _snapshot(other, other_opt)
    assert _same(saved[0], loaded[0]) and _same(saved[1], loaded[1])
    return sorted(saved[0])


def test_pipeline_checkpoint_loads_strictly_on_the_same_mesh(world, tmp_path):
    owned = world.run(pipeline_case, directory=str(tmp_path), timeout=120)
    assert not set(owned[0]) & set(owned[1])           # each stage holds its own blocks
    assert "lm_head.weight" in owned[1] and "model.embed_tokens.weight" in owned[0]


def zero1_misfit_case(rank, world, directory):
    """ZeRO-1, another MLP width: strict refuses before writing anything; strict=False
    loads what fits (weights and optimizer state) and keeps the rest as it was."""
    import meshlab as ml

    mesh = ml.Mesh(dp=2)

    def build(seed, **kw):
        m = ml.parallelize(M.build("llama", **kw), M.spec("zero1"), mesh, seed=seed)
        return m, ml.optimizer(m, torch.optim.AdamW, lr=1e-3)

    batch = {"input_ids": M.batches(1)[0].chunk(2)[rank]}
    model, opt = build(0)
    ml.step(model, opt, batch)
    path = os.path.join(directory, "z1")
    ml.checkpoint.save(path, model, opt)
    saved = _snapshot(model, opt)
    other, other_opt = build(5, intermediate_size=48)
    ml.step(other, other_opt, batch)
    before = _snapshot(other, other_opt)
    cls, msg = _caught(lambda: ml.checkpoint.load(path, other, other_opt))
    assert "mlp.gate_proj.weight: saved (64, 32)" in msg, msg
    after = _snapshot(other, other_opt)
    assert _same(before[0], after[0]) and _same(before[1], after[1]), "half-loaded"
    _, report = ml.checkpoint.load(path, other, other_opt, strict=False)
    bad = {m[0] for m in report.mismatched}
    after = _snapshot(other, other_opt)
    for part in (0, 1):
        for k, v in after[part].items():
            want = before[part][k] if k in bad else saved[part][k]
            assert torch.equal(v, want), k
    ml.step(other, other_opt, batch)                     # and it trains on
    return sorted(bad)


def test_zero1_load_that_does_not_fit_checks_before_writing(world, tmp_path):
    bad = world.run(zero1_misfit_case, directory=str(tmp_path), timeout=120)[0]
    assert "model.layers.0.mlp.up_proj.weight" in bad
    assert "optim.model.layers.0.mlp.up_proj.weight.exp_avg" in bad
    assert not any("embed_tokens" in k for k in bad)


def async_case(rank, world, directory):
    """Steps agree on the control group while the background save writes: the save has
    a group of its own, so neither hangs nor reads the other's messages."""
    import meshlab as ml

    from meshlab.checkpoint import _dcp

    model, opt = _tp(world)
    path = os.path.join(directory, "async")
    before = _snapshot(model, opt)
    real = _dcp._write_rank_file

    def slow(*args):              # rank 1's save is still writing while both ranks step
        time.sleep(0.5 * rank)
        return real(*args)

    _dcp._write_rank_file = slow
    try:
        ml.checkpoint.save(path, model, opt, extra={"step": 7}, async_save=True)
        for b in M.batches(3):
            ml.step(model, opt, {"input_ids": b})
        ml.checkpoint.wait()
    finally:
        _dcp._write_rank_file = real
    extra, _ = ml.checkpoint.load(path, model, opt)
    after = _snapshot(model, opt)
    assert extra == {"step": 7}
    assert _same(before[0], after[0]) and _same(before[1], after[1])


def test_async_save_beside_steps(world, tmp_path):
    world.run(async_case, directory=str(tmp_path), timeout=120)
