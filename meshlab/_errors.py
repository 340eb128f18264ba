"""Typed errors. Every message names the thing, states the rule and offers the fix."""

from __future__ import annotations


class MeshlabError(Exception):
    """Base class of every error meshlab raises on purpose."""


class SpecError(MeshlabError, ValueError):
    """A PartitionSpec is malformed or does not fit the tensor or mesh it is applied to."""


class MeshError(MeshlabError, ValueError):
    """A mesh description is malformed or does not match the processes that were started."""


class RulesError(MeshlabError, ValueError):
    """Logical-axis rules are malformed or two rule sets disagree."""


class PlanError(MeshlabError, ValueError):
    """A plan cannot be built, bound or composed (glob matching nothing, conflicting transforms)."""


class PolicyError(MeshlabError, LookupError):
    """No sharding policy exists for a model, or a policy does not fit it."""


class ConfigError(MeshlabError, ValueError):
    """A transform or training option was given a value it does not accept."""


class NotRunnable(ConfigError):
    """A layout a plan may describe (JAX shards any array this way) that ``parallelize``
    cannot run. ``bind`` records it in ``plan.not_runnable`` and the plan's table shows it;
    ``parallelize`` raises it before any collective."""


class RankMismatchError(MeshlabError, RuntimeError):
    """The ranks of one job disagree on what they run (spec, mesh, model, batch shape, or
    which collective call they are in); raised on every rank before any collective."""


class PeerError(MeshlabError, RuntimeError):
    """Another rank failed before a collective section; every rank raises instead of
    waiting for it."""
