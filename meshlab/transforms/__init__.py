"""Transforms: frozen values ``Plan -> Plan`` composed with ``|``."""

from ._base import Compose as Compose, Identity as Identity, Transform as Transform
from .shard import Shard as Shard, shard as shard
from .zero import ZeroShard as ZeroShard, zero_shard as zero_shard, data_parallel as data_parallel
from .precision import Precision as Precision, precision as precision
from .remat import Remat as Remat, remat as remat
from .pipeline import Pipeline as Pipeline, pipeline as pipeline
from .sequence import Sequence as Sequence, sequence as sequence
from .fuse import Fuse as Fuse, fuse as fuse
