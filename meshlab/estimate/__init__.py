"""The estimates: memory, communication, activations, the one-block profile, step time,
machine presets and the layout search, each a function of a bound plan.

Importing this layer hands ``estimate_memory``, ``estimate_comm`` and ``estimate_time`` to
the plan (``Plan.memory()``, ``comm()``, ``time()``), which sits below it and imports none
of them.
"""

from ..planning.plan import register_estimator
from .comm import estimate_comm
from .memory import estimate_memory
from .time import estimate_time

register_estimator("memory", estimate_memory)
register_estimator("comm", estimate_comm)
register_estimator("time", estimate_time)
