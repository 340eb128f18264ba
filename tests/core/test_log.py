"""meshlab's logger: rank 0's records by default, every rank's on request, the level from
the environment, and optional dependencies that name their extra."""

from __future__ import annotations

import logging

import pytest

from meshlab.core import log as mlog
from meshlab.core.errors import ConfigError


class _Keep(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def kept():
    root = mlog.get_logger()            # configured first (it sets the level once)
    h, level = _Keep(), root.level
    root.addHandler(h)
    root.setLevel(logging.INFO)
    yield h.records
    root.removeHandler(h)
    root.setLevel(level)


def test_rank_zero_speaks_others_only_when_asked(kept, monkeypatch):
    log = mlog.get_logger("meshlab.test")
    monkeypatch.setenv("RANK", "1")
    log.info("from rank 1")
    assert kept == []
    monkeypatch.setenv("MESHLAB_LOG_RANKS", "all")
    log.info("from rank 1, asked")
    assert [r.getMessage() for r in kept] == ["from rank 1, asked"]
    assert kept[0].rank == 1
    monkeypatch.delenv("MESHLAB_LOG_RANKS")
    monkeypatch.setenv("RANK", "0")
    log.info("from rank 0")
    assert [r.getMessage() for r in kept][-1] == "from rank 0"


def test_names_are_children_of_meshlab():
    assert mlog.get_logger("apply").name == "meshlab.apply"
    assert mlog.get_logger("meshlab.apply") is mlog.get_logger("apply")


def test_level_from_the_environment(monkeypatch):
    monkeypatch.setenv("MESHLAB_LOG_LEVEL", "debug")
    assert mlog._level() == logging.DEBUG
    monkeypatch.setenv("MESHLAB_LOG_LEVEL", "loud")
    with pytest.raises(ConfigError, match="MESHLAB_LOG_LEVEL='LOUD'"):
        mlog._level()


def test_a_missing_optional_dependency_names_its_extra():
    with pytest.raises(mlog.MissingExtraError, match=r"pip install 'meshlab\[plot\]'"):
        mlog.require("meshlab_no_such_module.pyplot", "plot", "Advice.plot")
    assert mlog.require("json", "none", "x").__name__ == "json"


def test_parallelize_says_what_it_ran(kept, one_process):
    import torch
    from torch import nn

    import meshlab as ml

    model = ml.parallelize(nn.Sequential(nn.Linear(4, 4)), ml.zero_shard(1), ml.Mesh(dp=1))
    assert isinstance(model, nn.Module)
    said = [r.getMessage() for r in kept if r.name == "meshlab.apply"]
    assert len(said) == 1 and said[0].startswith("parallelized Sequential on ") \
        and "zero_shard" in said[0], said
    assert torch.is_tensor(next(model.parameters()))
