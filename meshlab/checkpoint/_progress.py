"""Progress of a checkpoint's long loops, on ``core.progress``'s bars (rank 0's only; where
stderr is a terminal, or as ``MESHLAB_PROGRESS`` says).

* ``save`` and ``load`` (DCP) count the tensors rank 0 writes or reads (a shard of a
  sharded tensor is one; the total is known once DCP has planned which rank writes what):
  DCP's default planners, each with a counter added, passed to ``dcp.save`` / ``dcp.load``
  only where the bar shows, so without one DCP runs exactly as before.
* ``save_pretrained`` and ``save_merged`` count the bytes rank 0 writes, one tensor at a
  time (``_hf._write_shards``); ``load_pretrained`` the tensors a rank copies in.

What is written or read is the same either way (``tests/checkpoint/test_progress.py``
compares the files).
"""

from __future__ import annotations

from ..core.progress import bar, byte_bar, shown

__all__ = ["bar", "byte_bar", "shown", "save_planner", "load_planner"]


def save_planner(b):
    """DCP's default save planner counting each item it hands to the writer on ``b`` (its
    total set from the plan), or None (DCP's own) where ``b`` is disabled."""
    if b.disable:
        return None
    from torch.distributed.checkpoint import DefaultSavePlanner

    class _Counting(DefaultSavePlanner):
        def finish_plan(self, new_plan):
            plan = super().finish_plan(new_plan)
            _total(b, len(plan.items))
            return plan

        def resolve_data(self, write_item):
            data = super().resolve_data(write_item)
            b.update(1)
            return data

    return _Counting()


def load_planner(b):
    """DCP's default load planner counting each item once it is read into its tensor, or
    None (DCP's own) where ``b`` is disabled."""
    if b.disable:
        return None
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class _Counting(DefaultLoadPlanner):
        def finish_plan(self, new_plan):
            plan = super().finish_plan(new_plan)
            _total(b, len(plan.items))
            return plan

        def load_bytes(self, read_item, value):
            super().load_bytes(read_item, value)
            b.update(1)

        def commit_tensor(self, read_item, tensor):
            super().commit_tensor(read_item, tensor)
            b.update(1)

    return _Counting()


def _total(b, n: int) -> None:
    b.total = n
    b.refresh()
