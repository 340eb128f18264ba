"""Progress bars of a checkpoint's save, load and exports: rank 0's only, shown where
stderr is a terminal or ``MESHLAB_PROGRESS=1`` asks, never where it says 0; each bar
reaches its total and is closed (also when the loop raises); what is written is the same
with and without them."""

from __future__ import annotations

import io
import json
import os
import random
import sys

import numpy as np
import pytest
import torch
from torch import nn

from meshlab.core import progress
from meshlab.core.errors import ConfigError

pytestmark = pytest.mark.timeout(300)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Recorder:
    """``tqdm.auto.tqdm`` replaced by a subclass recording each bar as it closes:
    ``(desc, n, total, shown)``."""

    def __init__(self):
        import tqdm.auto

        self.closed: list[tuple[str, int, int | None, bool]] = []
        self._module, self._orig = tqdm.auto, tqdm.auto.tqdm
        closed = self.closed

        class _Bar(self._orig):
            def __init__(self, *a, desc=None, **k):
                super().__init__(*a, desc=desc, **k)
                self._what = desc          # a disabled tqdm keeps no desc of its own

            def close(self):
                if not getattr(self, "_recorded", False):
                    self._recorded = True
                    closed.append((self._what, self.n, self.total, not self.disable))
                super().close()

        tqdm.auto.tqdm = _Bar

    def restore(self):
        self._module.tqdm = self._orig


@pytest.fixture
def recorder():
    r = _Recorder()
    yield r
    r.restore()


# -- the switch ---------------------------------------------------------------------------
@pytest.mark.parametrize("env, on, rank, tty, want", [
    (None, None, 0, True, True),        # a terminal: shown
    (None, None, 0, False, False),      # a pipe or a log file: not
    ("1", None, 0, False, True),        # asked for
    ("0", None, 0, True, False),        # refused, even on a terminal
    ("1", None, 1, True, False),        # never on another rank
    (None, None, 1, True, False),
    (None, True, 0, False, True),       # the caller's own switch replaces the terminal test
    ("0", True, 0, True, False),        # but MESHLAB_PROGRESS=0 still hides it
    ("1", False, 0, True, False),
])
def test_shown_follows_the_variable_the_terminal_and_the_rank(monkeypatch, env, on, rank, tty,
                                                               want):
    if env is None:
        monkeypatch.delenv(progress.ENV, raising=False)
    else:
        monkeypatch.setenv(progress.ENV, env)
    monkeypatch.setattr(progress, "_rank", lambda: rank)
    monkeypatch.setattr(sys, "stderr", _Terminal() if tty else io.StringIO())
    assert progress.shown(on) is want


def test_an_unknown_value_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(progress.ENV, "loud")
    with pytest.raises(ConfigError, match="MESHLAB_PROGRESS='loud'"):
        progress.shown()


def test_the_bar_closes_when_the_loop_raises(monkeypatch, recorder):
    monkeypatch.setenv(progress.ENV, "1")
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with pytest.raises(KeyError):
        with progress.bar(5, "work") as b:
            b.update(2)
            raise KeyError("x")
    assert recorder.closed == [("work", 2, 5, True)]


# -- one process --------------------------------------------------------------------------
def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def test_a_failing_export_closes_its_bar_and_a_save_and_load_reach_their_totals(
        tmp_path, monkeypatch, recorder):
    import meshlab as ml
    from meshlab.checkpoint import _stream

    monkeypatch.setenv(progress.ENV, "1")
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    m = _model()
    ml.checkpoint.save(tmp_path / "ck", m)
    ml.checkpoint.load(tmp_path / "ck", m)
    assert [(d, n, t) for d, n, t, _ in recorder.closed] == [("save", 4, 4), ("load", 4, 4)]
    assert "save: 100%" in err.getvalue() and "load: 100%" in err.getvalue()

    calls = []

    def write(self, name, t):
        calls.append(name)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(self, name, t)

    real = _stream.StreamWriter.write
    monkeypatch.setattr(_stream.StreamWriter, "write", write)
    with pytest.raises(ml.checkpoint.CheckpointError, match="No space left"):
        ml.checkpoint.save_pretrained(tmp_path / "hf", m)
    (desc, n, total, shown), = recorder.closed[2:]
    # the gathering goes on after the failed write, so every byte is counted, and closed
    assert (desc, shown, total) == ("export", True, sum(p.numel() * 4 for p in m.parameters()))
    assert n == total


# -- two gloo ranks -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def world():
    from tests._world import World

    w = World(2)
    yield w
    w.close()


def _lora_model(world_size):
    import meshlab as ml
    from tests import _models as M

    spec = ml.lora(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) | \
        ml.zero_shard(3, "dp")
    model = ml.parallelize(M.build("llama"), spec, ml.Mesh(dp=world_size), seed=0)
    with torch.no_grad():          # adapters that change the weights when merged
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.add_(0.01)
    return model


def progress_case(rank, world, directory, env, tty):
    """Save, load, export, load the export and export merged, with ``MESHLAB_PROGRESS``
    set to ``env`` (None: unset) and stderr a terminal or not. Returns the bars as they
    closed and what reached stderr."""
    import meshlab as ml
    from meshlab import checkpoint
    from tests import _models as M

    for seed in (torch.manual_seed, random.seed, np.random.seed):
        seed(0)
    saved_env, saved_err = os.environ.get(progress.ENV), sys.stderr
    if env is None:
        os.environ.pop(progress.ENV, None)
    else:
        os.environ[progress.ENV] = env
    err = _Terminal() if tty else io.StringIO()
    rec = _Recorder()
    try:
        model = ml.parallelize(M.build("llama"), M.spec("tp"), M.mesh_for("tp", world), seed=0)
        lora = _lora_model(world)
        sys.stderr = err
        checkpoint.save(os.path.join(directory, "ck"), model, extra={"step": 1})
        checkpoint.load(os.path.join(directory, "ck"), model)
        checkpoint.save_pretrained(os.path.join(directory, "hf"), model, max_shard_size="40KB")
        checkpoint.load_pretrained(os.path.join(directory, "hf"), model)
        ml.save_merged(os.path.join(directory, "merged"), lora, max_shard_size="40KB")
    finally:
        sys.stderr = saved_err
        rec.restore()
        if saved_env is None:
            os.environ.pop(progress.ENV, None)
        else:
            os.environ[progress.ENV] = saved_env
    return rec.closed, err.getvalue()


DESCS = ["save", "load", "export", "load", "export merged"]


def _safetensors_bytes(d: str) -> int:
    """The tensors' bytes in an export's safetensors files (their headers' ranges)."""
    total = 0
    for name in os.listdir(d):
        if name.endswith(".safetensors"):
            with open(os.path.join(d, name), "rb") as f:
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            total += sum(e["data_offsets"][1] - e["data_offsets"][0]
                         for k, e in header.items() if k != "__metadata__")
    return total


def _files(d: str) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(d):
        for n in names:
            p = os.path.join(root, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, d)] = f.read()
    return out


def _dcp_metadata(data: bytes):
    """What DCP's ``.metadata`` says of the tensors and where they lie (its storage_meta
    carries the save's own id, different at every save)."""
    from meshlab.checkpoint._safe import read_metadata_bytes

    md = read_metadata_bytes(data, ".metadata")
    return md.state_dict_metadata, md.storage_data


@pytest.fixture(scope="module")
def runs(world, tmp_path_factory):
    d = tmp_path_factory.mktemp("progress")
    out = {}
    for label, env, tty in (("forced", "1", False), ("piped", None, False),
                            ("terminal", None, True), ("off", "0", True)):
        out[label] = (str(d / label), world.run(progress_case, directory=str(d / label),
                                                env=env, tty=tty))
    return out


def test_forced_bars_reach_their_totals_on_rank_0_only(runs):
    d, ((bars0, err0), (bars1, err1)) = runs["forced"]
    assert [b[0] for b in bars0] == DESCS, bars0
    for desc, n, total, shown in bars0:
        assert shown and total and n == total, (desc, n, total)
    # the exports count every byte written
    assert bars0[2][2] == _safetensors_bytes(os.path.join(d, "hf"))
    assert bars0[4][2] == _safetensors_bytes(os.path.join(d, "merged"))
    for desc in DESCS:
        assert f"{desc}: 100%" in err0, (desc, err0)
    assert [b[0] for b in bars1] == DESCS and not any(b[3] for b in bars1), bars1
    assert err1 == ""


def test_a_terminal_shows_rank_0_bars_and_a_pipe_or_zero_nothing(runs):
    _, ((bars0, err0), (bars1, err1)) = runs["terminal"]
    assert all(shown and n == total for _, n, total, shown in bars0), bars0
    assert "export merged: 100%" in err0 and err1 == ""
    assert not any(b[3] for b in bars1)
    for label in ("piped", "off"):
        _, ((bars0, err0), (bars1, err1)) = runs[label]
        assert len(bars0) == len(DESCS) and not any(b[3] for b in bars0 + bars1), label
        assert err0 == "" and err1 == "", (label, err0, err1)


def test_the_files_are_the_same_with_and_without_bars(runs):
    on, off = _files(runs["forced"][0]), _files(runs["piped"][0])
    assert sorted(on) == sorted(off)
    assert any(k.endswith(".distcp") for k in on) and any(k.endswith(".safetensors")
                                                          for k in on)
    for name in sorted(on):
        if name.endswith(".metadata"):
            assert _dcp_metadata(on[name]) == _dcp_metadata(off[name]), name
        elif name.endswith("meshlab.json"):
            # the marker records the save's time and .metadata's size and checksum (DCP
            # writes the save's id and directory into .metadata, bars or not)
            a, b = (json.loads(x) for x in (on[name], off[name]))
            for doc in (a, b):
                doc.pop("time"), doc.pop("digest"), doc["files"].pop(".metadata")
            assert a == b, name
        else:
            assert on[name] == off[name], name
