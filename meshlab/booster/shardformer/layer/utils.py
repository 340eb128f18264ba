"""``colossalai.shardformer.layer.utils.Randomizer``: Colossal-AI numbers the dropout
random streams of its tensor-parallel layers with a process-wide index, and its tests
reset that index between models. meshlab seeds each model's dropout streams when it is
parallelized, so there is no process-wide index: both methods change nothing."""

from __future__ import annotations


class Randomizer:
    """The index Colossal-AI's tests reset; each parallelized model has its own streams."""

    @staticmethod
    def reset_index() -> None:
        """Nothing to reset: the next ``parallelize`` seeds its model's streams itself."""

    @staticmethod
    def increment_index() -> None:
        """Nothing to count: see :meth:`reset_index`."""
