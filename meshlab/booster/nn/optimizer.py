"""The optimizers, where Colossal-AI scripts import them from (``colossalai.nn.optimizer``)."""

from .._optim import CPUAdam as CPUAdam, FusedAdam as FusedAdam, HybridAdam as HybridAdam
