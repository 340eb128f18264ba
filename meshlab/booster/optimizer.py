"""The optimizers, where Colossal-AI scripts import them from (``...nn.optimizer``).

``Lamb``, ``Lars``, ``CAME``, ``Adafactor``, ``GaLoreAdamW`` and the ``Distributed*`` classes
are imported on first use: ``Lamb`` and ``CAME`` need the ``optim`` extra (``torch-optimizer``,
``came-pytorch``), ``GaLoreAdamW`` the ``galore`` extra (``galore-torch``)."""

from ._optim import CPUAdam as CPUAdam, FusedAdam as FusedAdam, HybridAdam as HybridAdam


def __getattr__(name: str):
    if name == "Lamb":
        from ._lamb import Lamb

        return Lamb
    from ._colossal_optims import NAMES, get

    if name in NAMES:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
