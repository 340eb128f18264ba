"""What ``expert_route`` installs: sharded expert weights and the dispatching experts
implementation (``_dispatch``)."""

from __future__ import annotations

import torch
from torch import nn

from ...core.errors import ConfigError
from .._install import EagerModules, mesh_device
from .._protocol import Part
from ._layout import placement
from ._dispatch import IMPL, EPState, EPStats, attach_state, ep_experts_forward


def _interface():
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:                # transformers 4: no ExpertsInterface
        return None
    return ALL_EXPERTS_FUNCTIONS


def check_model(t, ctx) -> None:
    """The model has what the dispatching implementation needs (before anything changes)."""
    if _interface() is None:
        import transformers

        raise ConfigError(f"{t!r} needs transformers' ExpertsInterface (transformers >= 5); "
                          f"this is transformers {transformers.__version__}")
    mods = dict(ctx.model.named_modules())
    for x in placement(ctx.plan, t).layouts:
        m = mods[x.fqn]
        if not hasattr(type(m).forward, "__wrapped__") or not hasattr(m, "config"):
            raise ConfigError(f"{x.fqn} ({x.cls}): not an ExpertsInterface module (no "
                              f"@use_experts_implementation forward); expert_route cannot "
                              f"dispatch it")


def install_experts(t, ctx):
    from torch.distributed.tensor import DTensor, Shard

    _interface().register(IMPL, ep_experts_forward)
    mesh = ctx.device_mesh(t.axis)
    n, rank = ctx.size(t.axis), ctx.coordinate(t.axis)
    group = ctx.group(t.axis)
    stats = EPStats(routed_on_device=torch.zeros((), dtype=torch.int64,
                                                 device=mesh_device(ctx.mesh)))
    mods = dict(ctx.model.named_modules())
    where = placement(ctx.plan, t)
    # The experts of this rank's pipeline stage (the others' modules are gone).
    layouts = [x for x in where.layouts if x.fqn in mods]
    # What each module ran before: read all first, as modules share one config object.
    before = {x.fqn: mods[x.fqn].config._experts_implementation for x in layouts}
    for x in layouts:
        m = mods[x.fqn]
        for fqn in x.params if n > 1 else ():      # one rank holds them all as they are
            name = fqn.rsplit(".", 1)[-1]
            p = m._parameters[name]
            full = p.detach()
            held = where.held(x, rank)              # this rank's run of the experts
            local = full[held.start:held.stop].contiguous()
            d = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                   shape=full.shape, stride=full.stride())
            m._parameters[name] = nn.Parameter(d, requires_grad=p.requires_grad)
        prev = before[x.fqn]
        attach_state(m, EPState(group, n, rank, None if prev == IMPL else prev,
                                t.capacity_factor, stats))
        m.config._experts_implementation = IMPL
    if n > 1 or t.capacity_factor is not None:
        ctx.keep(EagerModules(frozenset(x.fqn for x in layouts),
                              "the expert dispatch reads its all-to-all's split sizes (or "
                              "its capacity's drops) from the routing on the host"))
    # else one rank holds every expert and the family's own path runs: compiled blocks
    # take the experts with the rest of the block
    return ExpertPart(stats)


class ExpertPart(Part):
    """The runtime's handle on the exchanges (``stats``: all-to-alls, rows, drops)."""

    def __init__(self, stats: EPStats):
        self.stats = stats
