"""plan: trace a model, run the transforms, bind to a mesh — without touching the model."""

from __future__ import annotations

from torch import nn

from ..core.context import current_mesh
from ..core.errors import ConfigTypeError, MeshError, check_bool
from ..core.mesh import Mesh, MeshBase
from ..planning.plan import Plan
from ..planning.trace import trace
from ..transforms._protocol import Transform


def plan(model: nn.Module | Plan, spec: Transform | None = None, mesh: Mesh | None = None, *,
         uneven: bool = False, example_inputs=None) -> Plan:
    """Trace ``model``, apply ``spec`` (a transform or ``t1 | t2 | ...``), bind to ``mesh``.

    Pure: the model is only read (put it on the meta device to plan models of any size).
    ``mesh`` defaults to the one of an enclosing ``with mesh:``. Every check runs here,
    before anything is materialized or communicated.

    >>> mesh = Mesh(dp=2, tp=2, fake=True)
    >>> p = plan(torch.nn.Linear(8, 4), shard({'weight': P('tp', None)}), mesh)  # doctest: +SKIP
    """
    check_plan_args(model, spec, mesh, uneven, "plan")
    mesh = mesh if mesh is not None else current_mesh()
    if mesh is None:
        raise MeshError("plan: no mesh given and none is active; pass mesh= or use `with mesh:`")
    p = model if isinstance(model, Plan) else trace(model, example_inputs)
    if spec is not None:
        p = spec(p)
    return p.bind(mesh, uneven=uneven)


def check_plan_args(model, spec, mesh, uneven, call: str) -> None:
    """The arguments ``plan`` and ``parallelize`` share: a module (or plan), a transform,
    a mesh and a flag, each refused by name when it is something else."""
    if not isinstance(model, (nn.Module, Plan)):
        raise ConfigTypeError(f"{call}: model must be a torch nn.Module (on the meta device to "
                              f"plan any size) or a Plan, got {type(model).__name__}")
    if spec is not None and not isinstance(spec, Transform):
        raise ConfigTypeError(f"{call}: spec must be a transform such as shard(...) | "
                              f"zero_shard(...), got {type(spec).__name__}; a dict of specs "
                              f"goes into shard({{...}})")
    if mesh is not None and not isinstance(mesh, MeshBase):
        raise MeshError(f"{call}: mesh must be a meshlab.Mesh, e.g. Mesh(dp=2, tp=2, "
                        f"fake=True), got {type(mesh).__name__}")
    check_bool(uneven, call, "uneven")
