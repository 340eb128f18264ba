"""parallelize: plan, bind, check, materialize — the one pass that touches the model."""

from __future__ import annotations

import logging
from typing import Mapping

import torch
from torch import nn

from .plan import plan as make_plan
from ..core.context import current_mesh
from ..core.agree import agree
from ..core.errors import ConfigError, MeshError, MeshlabError
from ..core.log import get_logger
from .materialize import control_group, materialize
from ..core.mesh import AbstractMesh, Mesh
from ..transforms._protocol import Transform


def parallelize(model: nn.Module, spec: Transform, mesh: Mesh | None = None, *, seed: int = 0,
                state_dict: Mapping[str, torch.Tensor] | None = None,
                uneven: bool = False, sync_module_states: bool = False) -> nn.Module:
    """Run ``model`` as ``spec`` says on ``mesh``; returns the same module, mutated.

    A model on the meta device is initialized here, module by module with the RNG seeded
    to ``seed`` (the same values as ``meshlab.init_weights(model, seed)`` in one process),
    each tensor-parallel module sharded as soon as it exists; ``state_dict`` (full
    tensors) overrides the initial values. A model with real weights must hold the same
    values on every rank (``RankMismatchError`` names the first that differs), or, with
    ``sync_module_states=True``, the parameters and buffers that differ take rank 0's
    values, as torch's DDP does at construction (a warning says how many differed). All
    checks run before the first collective, and the ranks agree
    on a fingerprint of what they run (transforms, mesh, model config, parameter shapes,
    seed): a rank that differs, or fails a check alone, makes every rank raise one typed
    error (``RankMismatchError``, ``PeerError``) instead of hanging.

    >>> model = parallelize(model, shard(policies.auto, rules) | zero_shard(3), mesh)  # doctest: +SKIP
    """
    from ..core.errors import check_int

    from ..core.errors import check_bool

    check_int(seed, "parallelize", "seed", low=0, example=0)
    check_bool(sync_module_states, "parallelize", "sync_module_states")
    if state_dict is not None and not isinstance(state_dict, Mapping):
        raise ConfigError(f"parallelize(state_dict=...): a mapping of parameter names to full "
                          f"tensors, got {type(state_dict).__name__}")
    mesh = mesh if mesh is not None else current_mesh()
    if mesh is None:
        raise MeshError("parallelize: no mesh given and none is active; pass mesh= or use "
                        "`with mesh:`")
    if isinstance(mesh, AbstractMesh):
        raise MeshError(f"parallelize(..., {mesh!r}): an abstract mesh is for planning only; "
                        f"plan on it with meshlab.plan(model, spec, mesh), and run on a "
                        f"Mesh({', '.join(f'{n}={s}' for n, s in mesh.shape.items())}) built "
                        f"inside launched processes (meshlab run --nproc-per-node {mesh.size})")
    ctrl = control_group()
    bound, error = None, None
    try:
        bound = make_plan(model, spec, mesh, uneven=uneven)
        if bound.not_runnable:
            raise ConfigError(bound.not_runnable[0])
    except MeshlabError as e:
        error = e
    # Every rank runs the same program, or every rank raises here (no collective ran yet).
    # With sync_module_states every rank broadcasts the buffers that differ as well: their
    # names, shapes and dtypes must agree too.
    agree(ctrl, "parallelize", {**_fingerprint(model, spec, mesh, seed, state_dict, uneven),
                                "sync_module_states": sync_module_states,
                                "buffer shapes": [(n, list(b.shape), str(b.dtype))
                                                  for n, b in model.named_buffers()]
                                if sync_module_states else None}, error)
    out = materialize(model, bound, mesh, seed=seed, state_dict=state_dict, ctrl_group=ctrl,
                      sync_module_states=sync_module_states)
    log = get_logger("meshlab.apply")
    if log.isEnabledFor(logging.INFO):
        log.info("parallelized %s on %r: %s", type(model).__name__, mesh, bound)
    return out


def _fingerprint(model: nn.Module, spec, mesh: Mesh, seed: int, state_dict, uneven) -> dict:
    """What must be equal on every rank for ``parallelize`` to run: the transforms, the
    mesh, the model's class, config and parameter shapes, the seed and the state's keys."""
    try:
        spec_json = spec.to_json()
    except (MeshlabError, AttributeError, TypeError):
        spec_json = repr(spec)
    cfg = getattr(model, "config", None)
    return {
        "spec": spec_json,
        "mesh": [list(mesh.shape.items()), mesh.device_type],   # axis order matters
        "model": type(model).__name__,
        "config": cfg.to_dict() if hasattr(cfg, "to_dict") else None,
        "parameter shapes": [(n, list(p.shape), str(p.dtype))
                             for n, p in model.named_parameters()],
        "seed": seed,
        "uneven": uneven,
        "state_dict keys": sorted(state_dict) if state_dict is not None else None,
    }
