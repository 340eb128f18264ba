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
