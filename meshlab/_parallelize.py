"""parallelize: plan, bind, check, materialize — the one pass that touches the model."""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from ._api import plan as make_plan
from ._context import current_mesh
from ._errors import MeshError
from ._materialize import materialize
from ._mesh import Mesh
from .parallel._protocol import Transform


def parallelize(model: nn.Module, spec: Transform, mesh: Mesh | None = None, *, seed: int = 0,
                state_dict: Mapping[str, torch.Tensor] | None = None,
                uneven: bool = False) -> nn.Module:
    """Run ``model`` as ``spec`` says on ``mesh``; returns the same module, mutated.

    A model on the meta device is initialized here, module by module with the RNG seeded
    to ``seed`` (the same values as ``meshlab.init_weights(model, seed)`` in one process),
    each tensor-parallel module sharded as soon as it exists; ``state_dict`` (full
    tensors) overrides the initial values. A model with real weights must hold the same
    values on every rank. All checks run before the first collective.

    >>> model = parallelize(model, shard(policies.auto, rules) | zero_shard(3), mesh)  # doctest: +SKIP
    """
    mesh = mesh if mesh is not None else current_mesh()
    if mesh is None:
        raise MeshError("parallelize: no mesh given and none is active; pass mesh= or use "
                        "`with mesh:`")
    bound = make_plan(model, spec, mesh, uneven=uneven)
    return materialize(model, bound, mesh, seed=seed, state_dict=state_dict)
