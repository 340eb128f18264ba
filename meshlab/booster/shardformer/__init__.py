"""Colossal-AI's Shardformer configuration values a script passes to a plugin:
``GradientCheckpointConfig`` (``HybridParallelPlugin(gradient_checkpoint_config=...)``:
a ratio of 1.0 is ``remat('full')``, other ratios are refused by the plugin)."""

from __future__ import annotations

import dataclasses

from ...core.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class GradientCheckpointConfig:
    """The fraction of blocks whose activations are recomputed in backward."""

    gradient_checkpointing_ratio: float = 0.0

    def __post_init__(self):
        r = self.gradient_checkpointing_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0:
            raise ConfigError(f"GradientCheckpointConfig(gradient_checkpointing_ratio={r!r}): "
                              f"a fraction in [0, 1]")


@dataclasses.dataclass(frozen=True)
class PipelineGradientCheckpointConfig(GradientCheckpointConfig):
    """``GradientCheckpointConfig`` with a count of recomputed blocks per stage (refused
    by the plugin unless every block is: ``remat('full')``)."""

    num_ckpt_layers_per_stage: list | None = None
