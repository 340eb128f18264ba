"""What ``materialize`` hands the rooms: values kept by type between a room's ``prepare``
and an ``install`` (never under string keys), the runtime reached through the functions of
``transforms._install``, and the ``Part`` hooks a part that steps no tensors of its own
leaves at their defaults."""

from __future__ import annotations

import dataclasses

import pytest
from torch import nn

import meshlab as ml
from meshlab.transforms._install import (Install, attach_runtime, runtime_of,
                                         runtime_or_none)
from meshlab.transforms._protocol import Part
from meshlab.transforms.zero import HostResidency


@dataclasses.dataclass(frozen=True)
class _Setup:
    blocks: tuple[str, ...]


def _install() -> Install:
    return Install(model=nn.Linear(2, 2), plan=None, mesh=None, ctrl_group=None)


def test_prepare_keeps_a_typed_value_for_install():
    ctx = _install()
    assert ctx.kept(_Setup) is None and ctx.kept(HostResidency) is None
    ctx.keep(_Setup(("a",)))
    ctx.keep(HostResidency(units=("",), pinned=False, optimizer_host=frozenset({"w"})))
    assert ctx.kept(_Setup) == _Setup(("a",))
    assert ctx.kept(HostResidency).optimizer_host == frozenset({"w"})
    assert not hasattr(ctx, "state")
    with pytest.raises(ml.ConfigError, match="_Setup is kept already"):
        ctx.keep(_Setup(("b",)))


def test_the_runtime_is_reached_through_install_functions():
    model = nn.Linear(2, 2)
    assert runtime_or_none(model) is None
    with pytest.raises(ml.ConfigError, match="parallelize"):
        runtime_of(model)
    rt = object()
    attach_runtime(model, rt)
    assert runtime_or_none(model) is rt and runtime_of(model) is rt


def test_a_part_steps_the_parameters_unless_it_says_otherwise():
    p = Part()
    assert p.stepped() == [] and p.state_to_save({}) is None
    assert p.load_saved_state({}, lambda q, key: None) is False
