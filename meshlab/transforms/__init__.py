"""Transforms, one room each: frozen values ``Plan -> Plan`` composed with ``|``, and
everything each one does at bind, install and run time (see ``_protocol``).

Import order is the dependency order: a room imports only the rooms above it. What
composes with what is the table in ``composition``, which no room imports.
"""

from ._protocol import (Compose as Compose, CommOp as CommOp, Identity as Identity,
                        MemRow as MemRow, Part as Part, Phase as Phase, Transform as Transform)
from . import composition as composition
from .composition import (Cell as Cell, composes as composes, meaningless as meaningless,
                          not_yet as not_yet)
from .precision import Precision as Precision, precision as precision
from .shard import Shard as Shard, shard as shard
from .expert import ExpertRoute as ExpertRoute, expert_route as expert_route
from .zero import ZeroShard as ZeroShard, data_parallel as data_parallel, zero_shard as zero_shard
from .remat import Remat as Remat, remat as remat
from .pipeline import Pipeline as Pipeline, pipeline as pipeline
from .sequence import Sequence as Sequence, sequence as sequence
from .fuse import Fuse as Fuse, fuse as fuse
from .offload import Offload as Offload, offload as offload
from .lora import Lora as Lora, Quantize as Quantize, lora as lora
from .compile import Compile as Compile, compile_blocks as compile_blocks
from .step_in_backward import (StepInBackward as StepInBackward,
                               step_in_backward as step_in_backward)
