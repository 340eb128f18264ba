"""The plugins, where Colossal-AI scripts import them from (``...booster.plugin``)."""

from .._base import Plugin as Plugin
from .._hybrid import (HybridParallelPlugin as HybridParallelPlugin,
                       MoeHybridParallelPlugin as MoeHybridParallelPlugin)
from .._plugins import (GeminiPlugin as GeminiPlugin, LowLevelZeroPlugin as LowLevelZeroPlugin,
                        TorchDDPPlugin as TorchDDPPlugin, TorchFSDPPlugin as TorchFSDPPlugin)
from .dp_plugin_base import DPPluginBase as DPPluginBase

PLUGINS = (TorchDDPPlugin, TorchFSDPPlugin, LowLevelZeroPlugin, GeminiPlugin,
           HybridParallelPlugin, MoeHybridParallelPlugin)
