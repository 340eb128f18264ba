"""Shared fixtures: gloo worlds that live for one test module (see ``_world.World``)."""

from __future__ import annotations

import pytest

from ._world import World


@pytest.fixture(scope="module")
def world4():
    w = World(4)
    yield w
    w.close()


@pytest.fixture(scope="module")
def world2():
    w = World(2)
    yield w
    w.close()


@pytest.fixture
def one_process():
    """A test that parallelizes on a real one-rank mesh in the pytest process starts a
    process group (world 1) there; this ends it afterwards, so later tests that start
    their own find none."""
    import torch.distributed as dist

    had = dist.is_available() and dist.is_initialized()
    yield
    if not had and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
