"""Colossal-AI's Booster surface over meshlab: a script written for ``colossalai`` runs with
its imports changed (``from meshlab import booster as colossalai``; ``colossalai.X`` and
``colossalai.booster.X`` are both ``meshlab.booster.X``).

>>> from meshlab.booster import Booster, LowLevelZeroPlugin
>>> LowLevelZeroPlugin(stage=2, precision='bf16', max_norm=1.0).spec
zero_shard(stage=2, axis='dp') | precision(compute='bfloat16', reduce='float32', loss_scale=None)

Every plugin is a mesh shape plus a stack of meshlab transforms (``plugin.spec``); every
argument of every plugin is implemented, or refused with ``UnsupportedArgument`` naming
the meshlab equivalent, or (tuning hints that cannot change a result) accepted with a
``NoEffectWarning`` — the table in ``docs/booster.md`` lists each, generated from the
plugins' own argument lists (``mapping_table()``).
"""

from ._args import NoEffectWarning as NoEffectWarning, UnsupportedArgument as UnsupportedArgument
from .plugin import (Plugin as Plugin, TorchDDPPlugin as TorchDDPPlugin,
                     TorchFSDPPlugin as TorchFSDPPlugin, LowLevelZeroPlugin as LowLevelZeroPlugin,
                     GeminiPlugin as GeminiPlugin, HybridParallelPlugin as HybridParallelPlugin,
                     MoeHybridParallelPlugin as MoeHybridParallelPlugin, PLUGINS as PLUGINS)
from ._optim import HybridAdam as HybridAdam, CPUAdam as CPUAdam, FusedAdam as FusedAdam
from ._booster import Booster as Booster, launch_from_torch as launch_from_torch
from ._launch import (launch as launch, launch_from_openmpi as launch_from_openmpi,
                      launch_from_slurm as launch_from_slurm)
from ._table import mapping_table as mapping_table
from . import (accelerator, checkpoint_io, cluster, fx, interface, lazy,  # noqa: F401
               logging, mixed_precision, nn, optimizer, shardformer, utils)
