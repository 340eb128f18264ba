"""The plugins, where Colossal-AI scripts import them from (``...booster.plugin``)."""

from ._plugins import (Plugin as Plugin, TorchDDPPlugin as TorchDDPPlugin,
                       TorchFSDPPlugin as TorchFSDPPlugin, LowLevelZeroPlugin as LowLevelZeroPlugin,
                       GeminiPlugin as GeminiPlugin, HybridParallelPlugin as HybridParallelPlugin,
                       MoeHybridParallelPlugin as MoeHybridParallelPlugin)
