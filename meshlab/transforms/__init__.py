"""Transforms: frozen values ``Plan -> Plan`` composed with ``|``."""

from ._base import Compose as Compose, Identity as Identity, Transform as Transform
from .shard import Shard as Shard, shard as shard
