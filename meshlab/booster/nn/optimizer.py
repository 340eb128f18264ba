"""The optimizers, where Colossal-AI scripts import them from (``colossalai.nn.optimizer``).

``Lamb`` is imported on first use: it needs the ``optim`` extra (``torch-optimizer``)."""

from .._optim import CPUAdam as CPUAdam, FusedAdam as FusedAdam, HybridAdam as HybridAdam


def __getattr__(name: str):
    if name == "Lamb":
        from .._lamb import Lamb

        return Lamb
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
