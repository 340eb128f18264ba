"""meshlab: a JAX-style functional sharding layer on PyTorch DTensor.

>>> import meshlab as ml
>>> from meshlab import P
>>> mesh = ml.Mesh(dp=4, tp=2, fake=True)
>>> ml.Rules(batch='dp', mlp='tp').resolve(P('batch', 'mlp'), mesh.axis_names)
P('dp', 'tp')
"""

from .core.spec import P as P, PartitionSpec as PartitionSpec
from .core.errors import (MeshlabError as MeshlabError, SpecError as SpecError,
                      MeshError as MeshError, RulesError as RulesError,
                      PlanError as PlanError, PolicyError as PolicyError,
                      ConfigError as ConfigError, NotRunnable as NotRunnable,
                      RankMismatchError as RankMismatchError, PeerError as PeerError,
                      BatchError as BatchError, NonFiniteError as NonFiniteError)
from .core.rules import (Rules as Rules, LOGICAL_AXES as LOGICAL_AXES, first as first,
                         joint as joint)
from .core.mesh import Mesh as Mesh, AbstractMesh as AbstractMesh
from .core.context import use_mesh as use_mesh, use_rules as use_rules, current_mesh as current_mesh
from .core.placement import to_placements as to_placements, from_placements as from_placements
from .core.distribute import distribute as distribute, constrain as constrain, spec_of as spec_of
from .core.shard_map import shard_map as shard_map
from .core.named import (psum as psum, pmean as pmean, pmax as pmax, pmin as pmin,
                         all_gather as all_gather, psum_scatter as psum_scatter,
                         ppermute as ppermute, all_to_all as all_to_all,
                         axis_index as axis_index, axis_size as axis_size, pcast as pcast)
from .core.visualize import visualize as visualize, typeof as typeof, type_string as type_string
from .planning.plan import Plan as Plan, ParamEntry as ParamEntry, ActivationEntry as ActivationEntry
from .planning.trace import trace as trace
from .core.specs_tree import specs_like as specs_like
from .transforms import (Transform as Transform, shard as shard, zero_shard as zero_shard,
                       data_parallel as data_parallel, precision as precision, remat as remat,
                       pipeline as pipeline, sequence as sequence, fuse as fuse,
                       offload as offload, expert_route as expert_route,
                       lora as lora, Quantize as Quantize, compile_blocks as compile_blocks,
                       step_in_backward as step_in_backward)
from .checkpoint.adapters import (save_adapter as save_adapter, load_adapter as load_adapter,
                            save_merged as save_merged, merge as merge_adapters,
                            unmerge as unmerge_adapters)
from .apply.plan import plan as plan
from .estimate.advise import advise as advise
from .estimate.machine import Machine as Machine, machine as machine, calibrate as calibrate
from .apply.parallelize import parallelize as parallelize
from .apply.materialize import init_weights as init_weights
from .train.optimizer import optimizer as optimizer
from .train.step import no_sync as no_sync
from .train.step import step as step
from .train.verify import verify as verify
from .train.data import dataloader as dataloader
from . import losses
from . import checkpoint
from . import policies
from .policies import presets as presets

from . import data
from . import parallel
from .train.launch import notebook_launcher as notebook_launcher

__version__ = "0.1.0"
