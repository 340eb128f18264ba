"""Colossal-AI's ``PipelineGraph``: the cost model a script builds to hand-make a
zero-bubble V schedule (``HybridParallelPlugin(pp_style='zbv', scheduler_nodes=...)``).

meshlab's ``'zbv'`` schedule is torch.distributed.pipelining's, which orders the stages'
forward, input-gradient and weight-gradient steps itself, so a plugin takes no
``scheduler_nodes``. The graph is accepted with Colossal-AI's arguments (a script imports
and builds it whatever its ``pp_style``), and ``get_v_schedule()`` refuses with
``UnsupportedArgument`` naming the plugin arguments that run the same schedule.

>>> from meshlab.booster.pipeline.schedule.v_schedule import PipelineGraph
>>> g = PipelineGraph(n_stage=2, n_micro=4, f_cost=1, b_cost=1, w_cost=1, c_cost=1,
...                   f_mem=1, b_mem=1, w_mem=1)
>>> g.get_v_schedule()
Traceback (most recent call last):
...
meshlab.booster._args.UnsupportedArgument: HybridParallelPlugin(scheduler_nodes=PipelineGraph(n_stage=2, n_micro=4)): ...
"""

from __future__ import annotations

from ....core.errors import check_int
from ..._args import UnsupportedArgument


class PipelineGraph:
    """The stage and microbatch counts and the per-step costs and memory of a V schedule
    (Colossal-AI's arguments, checked and kept)."""

    def __init__(self, n_stage: int, n_micro: int, f_cost: float, b_cost: float, w_cost: float,
                 c_cost: float, f_mem: float, b_mem: float, w_mem: float,
                 max_mem: float | None = None) -> None:
        check_int(n_stage, "PipelineGraph", "n_stage", low=1, example=2)
        check_int(n_micro, "PipelineGraph", "n_micro", low=1, example=8)
        self.n_stage, self.n_micro = n_stage, n_micro
        self.costs = {"f": f_cost, "b": b_cost, "w": w_cost, "c": c_cost}
        self.mem = {"f": f_mem, "b": b_mem, "w": w_mem}
        self.max_mem = max_mem

    def __repr__(self) -> str:
        return f"PipelineGraph(n_stage={self.n_stage}, n_micro={self.n_micro})"

    def get_v_schedule(self, only_run_time: bool = False):
        """Refused: meshlab builds no schedule from a cost model."""
        raise UnsupportedArgument(
            "HybridParallelPlugin", "scheduler_nodes", self,
            "meshlab's 'zbv' schedule is torch.distributed.pipelining's, which orders the "
            "forward, input-gradient and weight-gradient steps itself",
            f"HybridParallelPlugin(pp_size={self.n_stage}, pp_style='zbv', "
            f"num_model_chunks=2) without scheduler_nodes")
